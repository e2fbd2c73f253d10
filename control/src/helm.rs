//! Helm chart values for Kubernetes clusters.
//!
//! The server derives the worker chart's values from the cluster ([`derived_values`]); an
//! operator may adjust them through `k8sOptions.helmValues`, a JSON object merged over the derived
//! values ([`merge`], [`effective_values`]):
//!
//! - objects merge per key, recursively;
//! - arrays and scalars replace (a list is never appended to);
//! - `null` removes the key, as `helm --set key=null` does.
//!
//! Some paths are **rejected rather than merged** ([`PROTECTED_PATHS`]): they decide where workers
//! report to, which image they run, which registry it comes from and which Secret holds their
//! token. Letting an overlay change them would silently detach the cluster's workers from the
//! server (or point them at an image or credentials nobody reviewed), so an overlay touching them
//! is refused with the paths named ([`rejected_paths`]), and the cluster's own fields must be
//! edited instead.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value, json};

/// Namespace the chart installs into when the cluster does not name one.
pub const DEFAULT_NAMESPACE: &str = "gpustack-system";

/// Registry used when neither the cluster nor the server configures one.
pub const DEFAULT_REGISTRY: &str = "docker.io";

/// Value paths the server derives and an overlay may not set, sorted. Segments are separated by
/// dots; no segment contains a dot.
pub const PROTECTED_PATHS: &[&str] = &[
    "cluster.id",
    "cluster.name",
    "image.registry",
    "image.repository",
    "image.tag",
    "namespace",
    "nodeSelector",
    "server.url",
    "token.secretName",
];

/// Why each protected path is protected, for error messages and documentation.
pub fn protection_reason(path: &str) -> Option<&'static str> {
    Some(match path {
        "cluster.id" | "cluster.name" => "which cluster the workers register into",
        "image.registry" => "which registry the worker image comes from",
        "image.repository" | "image.tag" => "which image the workers run",
        "namespace" => "where the workers and their token Secret live",
        "nodeSelector" => "which nodes run workers (one DaemonSet per GPU vendor)",
        "server.url" => "where the workers report to",
        "token.secretName" => "which Secret holds the workers' registration token",
        _ => return None,
    })
}

/// What the server knows about a cluster that the chart needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HelmContext {
    pub cluster_id: i64,
    pub cluster_name: String,
    /// URL workers register with and report to.
    pub server_url: String,
    pub image_repository: String,
    pub image_tag: String,
    /// The cluster's default container registry; `None` means [`DEFAULT_REGISTRY`].
    pub registry: Option<String>,
    /// Secret holding the workers' registration token.
    pub token_secret_name: String,
    /// Namespace the workers run in; empty means [`DEFAULT_NAMESPACE`].
    pub namespace: String,
    pub node_selector: BTreeMap<String, String>,
}

impl Default for HelmContext {
    fn default() -> Self {
        HelmContext {
            cluster_id: 0,
            cluster_name: String::new(),
            server_url: String::new(),
            image_repository: String::new(),
            image_tag: String::new(),
            registry: None,
            token_secret_name: String::new(),
            namespace: DEFAULT_NAMESPACE.to_owned(),
            node_selector: BTreeMap::new(),
        }
    }
}

/// Why an overlay cannot be applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HelmError {
    /// The overlay is not a JSON object (values files are always mappings).
    #[error("helmValues must be a JSON object, got {found}")]
    NotAnObject { found: &'static str },
    /// The overlay sets paths the server derives from the cluster.
    #[error(
        "helmValues may not set values the server derives from the cluster (edit the cluster \
         instead): {}",
        describe_paths(paths)
    )]
    Rejected { paths: Vec<String> },
}

fn describe_paths(paths: &[String]) -> String {
    paths
        .iter()
        .map(|path| match protection_reason(path) {
            Some(reason) => format!("{path} ({reason})"),
            None => path.clone(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The chart values the server derives from a cluster, before any overlay.
///
/// `resources`, `tolerations`, `podSecurity`, `imagePullSecrets` and `image.pullPolicy` are
/// defaults an overlay may change; everything under [`PROTECTED_PATHS`] is fixed.
pub fn derived_values(ctx: &HelmContext) -> Value {
    let registry = ctx
        .registry
        .as_deref()
        .filter(|r| !r.is_empty())
        .unwrap_or(DEFAULT_REGISTRY);
    let namespace = if ctx.namespace.is_empty() {
        DEFAULT_NAMESPACE
    } else {
        &ctx.namespace
    };
    json!({
        "cluster": { "id": ctx.cluster_id, "name": ctx.cluster_name },
        "server": { "url": ctx.server_url },
        "image": {
            "registry": registry,
            "repository": ctx.image_repository,
            "tag": ctx.image_tag,
            "pullPolicy": "IfNotPresent",
        },
        "imagePullSecrets": [],
        "token": { "secretName": ctx.token_secret_name },
        "namespace": namespace,
        "nodeSelector": ctx.node_selector,
        // GPU workers need privileged pods; owned namespaces carry these labels.
        "podSecurity": { "enforce": "privileged", "audit": "privileged", "warn": "privileged" },
        "resources": {},
        "tolerations": [],
    })
}

/// Every protected path `overlay` would change, sorted and deduplicated, joined with dots.
///
/// A path counts as changed when the overlay sets it to anything (including `null`, which would
/// delete it), or when the overlay replaces one of its ancestors with a non-object (`"image": "x"`
/// or `"image": null`), in which case the ancestor (`image`) is reported. Keys are compared as
/// whole JSON keys: a top-level key `"image.tag"` is just an oddly named key, not `image` → `tag`.
/// A non-object overlay yields no paths (it is refused as [`HelmError::NotAnObject`] instead).
pub fn rejected_paths(overlay: &Value) -> Vec<String> {
    let mut found = BTreeSet::new();
    if let Value::Object(map) = overlay {
        collect_rejected(map, &mut Vec::new(), &mut found);
    }
    found.into_iter().collect()
}

/// How a value path relates to the protected ones.
#[derive(Debug, PartialEq, Eq)]
enum Protection {
    /// The path is protected.
    Protected,
    /// A protected path lies strictly below it.
    Ancestor,
    /// Neither: the overlay may do what it likes here.
    Free,
}

fn protection(path: &[&str]) -> Protection {
    let mut result = Protection::Free;
    for protected in PROTECTED_PATHS {
        let segments: Vec<&str> = protected.split('.').collect();
        if segments == path {
            return Protection::Protected;
        }
        if segments.starts_with(path) {
            result = Protection::Ancestor;
        }
    }
    result
}

fn collect_rejected<'a>(
    map: &'a Map<String, Value>,
    prefix: &mut Vec<&'a str>,
    found: &mut BTreeSet<String>,
) {
    for (key, value) in map {
        prefix.push(key);
        match (protection(prefix), value) {
            (Protection::Protected, _) => {
                found.insert(prefix.join("."));
            }
            (Protection::Ancestor, Value::Object(inner)) => collect_rejected(inner, prefix, found),
            (Protection::Ancestor, _) => {
                found.insert(prefix.join("."));
            }
            (Protection::Free, _) => {}
        }
        prefix.pop();
    }
}

/// Merges `overlay` into `base` with Helm's rules: objects merge per key recursively; arrays and
/// scalars replace; a `null` value in an overlay object removes that key from `base` (and never
/// appears in the result). A non-object `overlay` replaces `base` entirely.
pub fn merge(base: &mut Value, overlay: &Value) {
    match (&mut *base, overlay) {
        (Value::Object(target), Value::Object(source)) => merge_objects(target, source),
        (_, Value::Object(source)) => {
            // Replacing a non-object: merge into an empty object so nested nulls are dropped too.
            let mut fresh = Map::new();
            merge_objects(&mut fresh, source);
            *base = Value::Object(fresh);
        }
        (_, other) => *base = other.clone(),
    }
}

fn merge_objects(target: &mut Map<String, Value>, source: &Map<String, Value>) {
    for (key, value) in source {
        if value.is_null() {
            target.remove(key);
        } else {
            merge(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// The values the chart is installed with: [`derived_values`] with `overlay` merged over them.
///
/// `None` and a JSON `null` overlay both mean "no overlay". Any protected path in the overlay
/// rejects the whole overlay ([`HelmError::Rejected`]); nothing is merged partially.
pub fn effective_values(ctx: &HelmContext, overlay: Option<&Value>) -> Result<Value, HelmError> {
    apply_overlay(derived_values(ctx), overlay)
}

/// `overlay` merged over `values` (derived values, perhaps extended by the caller) with the same
/// rules and refusals as [`effective_values`].
pub fn apply_overlay(mut values: Value, overlay: Option<&Value>) -> Result<Value, HelmError> {
    let overlay = match overlay {
        None | Some(Value::Null) => return Ok(values),
        Some(overlay @ Value::Object(_)) => overlay,
        Some(other) => {
            return Err(HelmError::NotAnObject {
                found: json_type(other),
            });
        }
    };
    let paths = rejected_paths(overlay);
    if !paths.is_empty() {
        return Err(HelmError::Rejected { paths });
    }
    merge(&mut values, overlay);
    Ok(values)
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ctx() -> HelmContext {
        HelmContext {
            cluster_id: 7,
            cluster_name: "gpu-east".into(),
            server_url: "https://faden.example:443".into(),
            image_repository: "gpustack/gpustack".into(),
            image_tag: "v2.0.1".into(),
            registry: Some("registry.example.com".into()),
            token_secret_name: "gpustack-worker-token".into(),
            namespace: "gpu".into(),
            node_selector: BTreeMap::from([(
                "feature.node.kubernetes.io/pci-10de.present".into(),
                "true".into(),
            )]),
        }
    }

    /// The value at `path`, following object keys only.
    fn at<'v>(value: &'v Value, path: &[&str]) -> Option<&'v Value> {
        path.iter()
            .try_fold(value, |v, key| v.as_object()?.get(*key))
    }

    #[test]
    fn derived_values_carry_the_cluster() {
        let values = derived_values(&ctx());
        assert_eq!(values["cluster"], json!({"id": 7, "name": "gpu-east"}));
        assert_eq!(values["server"]["url"], "https://faden.example:443");
        assert_eq!(
            values["image"],
            json!({
                "registry": "registry.example.com",
                "repository": "gpustack/gpustack",
                "tag": "v2.0.1",
                "pullPolicy": "IfNotPresent",
            })
        );
        assert_eq!(values["token"]["secretName"], "gpustack-worker-token");
        assert_eq!(values["namespace"], "gpu");
        assert_eq!(
            values["nodeSelector"]["feature.node.kubernetes.io/pci-10de.present"],
            "true"
        );
        assert_eq!(values["tolerations"], json!([]));
        assert_eq!(values["podSecurity"]["enforce"], "privileged");
    }

    #[test]
    fn derived_values_fall_back_to_defaults() {
        let values = derived_values(&HelmContext::default());
        assert_eq!(values["namespace"], DEFAULT_NAMESPACE);
        assert_eq!(values["image"]["registry"], DEFAULT_REGISTRY);
        let empty = HelmContext {
            namespace: String::new(),
            registry: Some(String::new()),
            ..HelmContext::default()
        };
        assert_eq!(derived_values(&empty), values);
    }

    #[test]
    fn every_protected_path_exists_in_derived_values_and_has_a_reason() {
        let values = derived_values(&ctx());
        let mut sorted = PROTECTED_PATHS.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, PROTECTED_PATHS);
        for path in PROTECTED_PATHS {
            let segments: Vec<&str> = path.split('.').collect();
            assert!(at(&values, &segments).is_some(), "{path} not derived");
            assert!(protection_reason(path).is_some(), "{path} has no reason");
        }
        assert_eq!(protection_reason("image.pullPolicy"), None);
    }

    #[test]
    fn rejected_paths_names_protected_and_replaced_ancestors() {
        let overlay = json!({
            "image": {"tag": "latest", "pullPolicy": "Always", "registry": null},
            "server": "https://elsewhere",
            "token": {"secretName": {"nested": true}},
            "nodeSelector": {},
            "resources": {"limits": {"cpu": "2"}},
            "tolerations": [{"operator": "Exists"}],
        });
        assert_eq!(
            rejected_paths(&overlay),
            [
                "image.registry",
                "image.tag",
                "nodeSelector",
                "server",
                "token.secretName"
            ]
        );
        assert_eq!(rejected_paths(&json!({"image": null})), ["image"]);
        assert_eq!(rejected_paths(&json!({"cluster": [1]})), ["cluster"]);
        assert_eq!(
            rejected_paths(&json!({"namespace": "other"})),
            ["namespace"]
        );
    }

    #[test]
    fn unprotected_and_dotted_keys_are_allowed() {
        let overlay = json!({
            "image": {"pullPolicy": "Always", "tag.suffix": "x"},
            "image.tag": "not-nested",
            "server": {},
            "resources": {"requests": {"memory": "1Gi"}},
            "tolerations": [],
            "podSecurity": {"enforce": "baseline"},
            "extra": {"namespace": "not-top-level"},
        });
        assert!(rejected_paths(&overlay).is_empty());
        assert!(rejected_paths(&json!("image")).is_empty());
        assert!(rejected_paths(&json!([{"image": null}])).is_empty());
    }

    #[test]
    fn merge_follows_helm_rules() {
        let mut base = json!({
            "image": {"tag": "v1", "pullPolicy": "IfNotPresent"},
            "tolerations": [{"key": "a"}],
            "resources": {"limits": {"cpu": "1"}},
            "keep": 1,
            "drop": {"x": 1},
            "scalar": 5,
        });
        let overlay = json!({
            "image": {"pullPolicy": "Always"},
            "tolerations": [{"key": "b"}],
            "resources": {"limits": {"memory": "1Gi"}},
            "drop": null,
            "scalar": {"now": "an object", "gone": null},
            "new": [1, null],
        });
        merge(&mut base, &overlay);
        assert_eq!(
            base,
            json!({
                "image": {"tag": "v1", "pullPolicy": "Always"},
                "tolerations": [{"key": "b"}],
                "resources": {"limits": {"cpu": "1", "memory": "1Gi"}},
                "keep": 1,
                "scalar": {"now": "an object"},
                "new": [1, null],
            })
        );
        let mut replaced = json!({"a": 1});
        merge(&mut replaced, &json!([1]));
        assert_eq!(replaced, json!([1]));
    }

    #[test]
    fn effective_values_merge_or_refuse() {
        let overlay =
            json!({"image": {"pullPolicy": "Always"}, "tolerations": [{"operator": "Exists"}]});
        let values = effective_values(&ctx(), Some(&overlay)).unwrap();
        assert_eq!(values["image"]["pullPolicy"], "Always");
        assert_eq!(values["image"]["tag"], "v2.0.1");
        assert_eq!(values["tolerations"], json!([{"operator": "Exists"}]));

        assert_eq!(
            effective_values(&ctx(), None).unwrap(),
            derived_values(&ctx())
        );
        assert_eq!(
            effective_values(&ctx(), Some(&Value::Null)).unwrap(),
            derived_values(&ctx())
        );
        assert_eq!(
            effective_values(&ctx(), Some(&json!([]))),
            Err(HelmError::NotAnObject { found: "an array" })
        );

        let bad = json!({"server": {"url": "http://evil"}, "image": {"tag": "x"}});
        let err = effective_values(&ctx(), Some(&bad)).unwrap_err();
        assert_eq!(
            err,
            HelmError::Rejected {
                paths: vec!["image.tag".into(), "server.url".into()]
            }
        );
        let message = err.to_string();
        assert!(
            message.contains("image.tag (which image the workers run)"),
            "{message}"
        );
        assert!(
            message.contains("server.url (where the workers report to)"),
            "{message}"
        );
    }

    // ------------------------------------------------------------------ property tests

    /// Keys that collide with the derived structure often, plus arbitrary ones.
    fn arb_key() -> impl Strategy<Value = String> {
        prop_oneof![
            prop::sample::select(vec![
                "cluster",
                "id",
                "name",
                "server",
                "url",
                "image",
                "registry",
                "repository",
                "tag",
                "pullPolicy",
                "token",
                "secretName",
                "namespace",
                "nodeSelector",
                "resources",
                "tolerations",
                "limits",
                "image.tag",
                "",
            ])
            .prop_map(str::to_owned),
            "[a-zA-Z.]{1,8}",
        ]
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            (-1e9f64..1e9).prop_map(Value::from),
            "\\PC{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(arb_key(), inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn arb_object() -> impl Strategy<Value = Value> {
        prop::collection::btree_map(arb_key(), arb_json(), 0..6)
            .prop_map(|m| Value::Object(m.into_iter().collect()))
    }

    /// `(path, value)` for every non-object value reachable through objects only.
    fn leaves<'v>(
        value: &'v Value,
        prefix: &mut Vec<String>,
        out: &mut Vec<(Vec<String>, &'v Value)>,
    ) {
        match value {
            Value::Object(map) => {
                for (key, inner) in map {
                    prefix.push(key.clone());
                    leaves(inner, prefix, out);
                    prefix.pop();
                }
            }
            other => out.push((prefix.clone(), other)),
        }
    }

    fn lookup<'v>(value: &'v Value, path: &[String]) -> Option<&'v Value> {
        path.iter()
            .try_fold(value, |v, key| v.as_object()?.get(key))
    }

    /// Sets `path` to `leaf`, turning whatever lies in the way into objects.
    fn plant(value: &mut Value, path: &[&str], leaf: Value) {
        let Some((first, rest)) = path.split_first() else {
            *value = leaf;
            return;
        };
        if !value.is_object() {
            *value = json!({});
        }
        if let Value::Object(map) = value {
            plant(map.entry(*first).or_insert(Value::Null), rest, leaf);
        }
    }

    /// Independent oracle for [`rejected_paths`]: walk each protected path down the overlay.
    fn oracle(overlay: &Value) -> Vec<String> {
        let mut found = BTreeSet::new();
        if !overlay.is_object() {
            return Vec::new();
        }
        for protected in PROTECTED_PATHS {
            let segments: Vec<&str> = protected.split('.').collect();
            let mut current = overlay;
            for (depth, segment) in segments.iter().enumerate() {
                let Some(next) = current.as_object().and_then(|m| m.get(*segment)) else {
                    break;
                };
                let is_last = depth + 1 == segments.len();
                if is_last || !next.is_object() {
                    found.insert(segments[..=depth].join("."));
                    break;
                }
                current = next;
            }
        }
        found.into_iter().collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn merging_an_empty_object_is_identity(base in arb_json()) {
            let mut merged = base.clone();
            merge(&mut merged, &json!({}));
            if base.is_object() {
                prop_assert_eq!(merged, base);
            } else {
                prop_assert_eq!(merged, json!({}));
            }
        }

        #[test]
        fn overlay_leaves_win_and_untouched_keys_stay(base in arb_object(), overlay in arb_object()) {
            let mut merged = base.clone();
            merge(&mut merged, &overlay);
            let mut overlay_leaves = Vec::new();
            leaves(&overlay, &mut Vec::new(), &mut overlay_leaves);
            for (path, value) in &overlay_leaves {
                match value {
                    // Null deletes; lists and scalars replace verbatim (never appended to).
                    Value::Null => prop_assert_eq!(lookup(&merged, path), None),
                    value => prop_assert_eq!(lookup(&merged, path), Some(*value)),
                }
            }
            let mut base_leaves = Vec::new();
            leaves(&base, &mut Vec::new(), &mut base_leaves);
            for (path, value) in &base_leaves {
                let touched = (1..=path.len()).any(|n| lookup(&overlay, &path[..n]).is_some());
                if !touched {
                    prop_assert_eq!(lookup(&merged, path), Some(*value));
                }
            }
        }

        #[test]
        fn lists_replace_never_append(base in prop::collection::vec(arb_json(), 0..4),
                                      overlay in prop::collection::vec(arb_json(), 0..4)) {
            let mut merged = json!({"list": base});
            merge(&mut merged, &json!({"list": overlay.clone()}));
            prop_assert_eq!(&merged["list"], &Value::Array(overlay));
        }

        #[test]
        fn rejected_paths_match_the_oracle(overlay in arb_json()) {
            let found = rejected_paths(&overlay);
            prop_assert_eq!(&found, &oracle(&overlay));
            for path in &found {
                // Only protected paths or their ancestors are ever reported.
                prop_assert!(PROTECTED_PATHS.iter().any(|p| p == path
                    || p.starts_with(&format!("{path}."))), "{}", path);
            }
        }

        #[test]
        fn a_planted_protected_path_is_always_found(
            mut overlay in arb_object(),
            index in 0..PROTECTED_PATHS.len(),
            leaf in arb_json(),
        ) {
            let protected = PROTECTED_PATHS[index];
            let segments: Vec<&str> = protected.split('.').collect();
            plant(&mut overlay, &segments, leaf);
            prop_assert!(rejected_paths(&overlay).iter().any(|p| p == protected));
            let rejected = effective_values(&ctx(), Some(&overlay));
            let named = matches!(
                rejected,
                Err(HelmError::Rejected { ref paths }) if paths.iter().any(|p| p == protected)
            );
            prop_assert!(named, "{:?}", rejected);
        }

        #[test]
        fn accepted_overlays_never_change_protected_values(overlay in arb_json()) {
            let derived = derived_values(&ctx());
            match effective_values(&ctx(), Some(&overlay)) {
                Ok(values) => {
                    for protected in PROTECTED_PATHS {
                        let path: Vec<String> = protected.split('.').map(str::to_owned).collect();
                        prop_assert_eq!(lookup(&values, &path), lookup(&derived, &path));
                    }
                }
                Err(HelmError::Rejected { paths }) => prop_assert!(!paths.is_empty()),
                Err(HelmError::NotAnObject { .. }) => prop_assert!(!overlay.is_object() && !overlay.is_null()),
            }
        }
    }
}
