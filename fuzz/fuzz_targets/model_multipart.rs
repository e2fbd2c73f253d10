//! `model` field of a multipart/form-data body (gateway phase 4). The input is the
//! Content-Type header value, a line feed, then the body.
//! Invariant: an accepted model is non-empty, trimmed, and found verbatim in the body.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|b| *b == b'\n').unwrap_or(data.len());
    let Ok(content_type) = std::str::from_utf8(&data[..split]) else {
        return;
    };
    let body = data.get(split + 1..).unwrap_or(&[]);
    let Ok(model) = gateway::route::model_from_multipart(content_type, body) else {
        return;
    };
    assert!(!model.is_empty());
    assert_eq!(model.trim(), &*model);
    let found = body.windows(model.len()).any(|w| w == model.as_bytes());
    assert!(found, "model {model:?} is not in the body");
});
