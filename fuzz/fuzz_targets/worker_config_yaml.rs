//! Worker configuration YAML (cluster `worker_config`, `--config-file`).
//! Invariant: an accepted configuration survives `to_yaml` → `parse_yaml` and `to_json` →
//! `from_json` unchanged (both documented as reading back an equal value).
#![no_main]

use control::worker_config::{from_json, parse_yaml};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let config = match parse_yaml(text) {
        Ok(c) => c,
        Err(errors) => {
            // Rendering the problems must not fail either.
            let _ = errors.to_string();
            return;
        }
    };
    let yaml = config.to_yaml();
    let again = parse_yaml(&yaml).expect("to_yaml output parses");
    assert_eq!(again, config, "YAML round trip of {text:?} via {yaml:?}");
    let json = config.to_json();
    let again = from_json(&json).expect("to_json output validates");
    assert_eq!(again, config, "JSON round trip of {text:?} via {json}");
});
