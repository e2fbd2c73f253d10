//! `model` of a JSON request body (gateway phase 4).
//! Invariant: an accepted body is a JSON object whose top-level `model` is the answer.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let Ok(model) = gateway::route::model_from_json(body) else {
        return;
    };
    assert!(!model.is_empty());
    let value: serde_json::Value =
        serde_json::from_slice(body).expect("an accepted body is valid JSON");
    let object = value
        .as_object()
        .expect("an accepted body is a JSON object");
    assert_eq!(object.get("model").and_then(|m| m.as_str()), Some(&*model));
});
