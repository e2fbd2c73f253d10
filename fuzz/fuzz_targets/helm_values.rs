//! `k8sOptions.helmValues` overlays (JSON) over the derived chart values.
//! Invariants: an accepted overlay never changes a protected path, and leaves no `null` member
//! in any object of the result (outside arrays); a refused one names at least one path.
#![no_main]

use std::collections::BTreeMap;

use control::helm::{self, HelmContext, HelmError, PROTECTED_PATHS};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn at<'v>(v: &'v Value, path: &str) -> Option<&'v Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

/// No `null` member in any object outside arrays (arrays replace whole, as in Helm, so an
/// overlay's list items are kept as written).
fn no_null_members(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.values().all(|v| !v.is_null() && no_null_members(v)),
        _ => true,
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(overlay) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let ctx = HelmContext {
        cluster_id: 7,
        cluster_name: "c".into(),
        server_url: "https://server.example:30080".into(),
        image_repository: "gpustack/gpustack".into(),
        image_tag: "v1".into(),
        registry: Some("registry.example".into()),
        token_secret_name: "worker-token".into(),
        namespace: "ns".into(),
        node_selector: BTreeMap::from([("gpu".into(), "nvidia".into())]),
    };
    let derived = helm::derived_values(&ctx);
    match helm::effective_values(&ctx, Some(&overlay)) {
        Ok(values) => {
            assert!(helm::rejected_paths(&overlay).is_empty());
            for path in PROTECTED_PATHS {
                assert_eq!(at(&values, path), at(&derived, path), "{path} changed");
            }
            if no_null_members(&derived) {
                assert!(no_null_members(&values), "null left in {values}");
            }
        }
        Err(HelmError::Rejected { paths }) => {
            assert!(!paths.is_empty());
            assert_eq!(paths, helm::rejected_paths(&overlay));
        }
        Err(HelmError::NotAnObject { .. }) => assert!(!overlay.is_object()),
    }
});
