//! The worker chart's values for a cluster: what [`crate::helm`] derives, the worker settings
//! and the cluster's Kubernetes options added, and `k8sOptions.helmValues` merged over them.
//! The manifests ([`super::kubernetes`]) are rendered from these values alone, and
//! `GET /v2/clusters/{id}/helm-values` shows them.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::{DATA_DIR, ImageRef, JoinError};
use crate::helm::{self, HelmContext};
use crate::worker_config::{self, WorkerConfig};
use control_client::model::{
    Cluster, DEFAULT_WORKER_METRICS_PORT, DEFAULT_WORKER_PORT, K8sOptions, ProxyMode,
};

/// Host directory that keeps a Kubernetes worker's token across pod restarts.
pub const HOST_DATA_DIR: &str = "/var/lib/faden";

/// Names of the Secrets made from `k8sOptions.imageCredentials`, numbered from 0.
pub const PULL_SECRET_PREFIX: &str = "faden-image-pull-secret-";

/// Volume names the DaemonSets use themselves; a volume mount may not take them.
pub const RESERVED_VOLUMES: &[&str] = &["faden-data"];

/// A volume mounted into every worker pod (`k8sOptions.volumeMounts`, GPUStack's shape).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct VolumeMount {
    pub name: String,
    pub mount_path: String,
    #[serde(default)]
    pub read_only: bool,
    pub volume_source: VolumeSource,
}

/// Where a mounted volume comes from: exactly one of the three.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct VolumeSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<HostPathSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<ClaimSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<ConfigMapSource>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostPathSource {
    pub path: String,
    /// Kubernetes' hostPath type (`Directory`, `DirectoryOrCreate`, `File`, …); absent: no
    /// check.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClaimSource {
    pub claim_name: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigMapSource {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optional: Option<bool>,
}

/// A registry login (`k8sOptions.imageCredentials`), rendered as a `dockerconfigjson` Secret.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageCredential {
    pub registry: String,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
}

/// The `k8sOptions` faden reads, checked. Other keys are kept on the cluster but not read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KubernetesOptions {
    /// `None`: [`helm::DEFAULT_NAMESPACE`].
    pub namespace: Option<String>,
    pub node_selector: BTreeMap<String, String>,
    pub volume_mounts: Vec<VolumeMount>,
    pub image_credentials: Vec<ImageCredential>,
}

const HOST_PATH_TYPES: &[&str] = &[
    "",
    "DirectoryOrCreate",
    "Directory",
    "FileOrCreate",
    "File",
    "Socket",
    "CharDevice",
    "BlockDevice",
];

impl KubernetesOptions {
    /// Reads and checks a cluster's `k8sOptions`; every problem is reported.
    pub fn from_cluster(options: Option<&K8sOptions>) -> Result<Self, Vec<String>> {
        let mut problems = Vec::new();
        let mut out = Self::default();
        let Some(other) = options.map(|o| &o.other) else {
            return Ok(out);
        };
        out.namespace = read(other, "namespace", &mut problems).flatten();
        if let Some(ns) = &out.namespace
            && let Err(e) = check_dns_label(ns)
        {
            problems.push(format!("k8sOptions.namespace: {e}"));
        }
        out.node_selector = read(other, "nodeSelector", &mut problems)
            .flatten()
            .unwrap_or_default();
        for (key, value) in &out.node_selector {
            if let Err(e) = check_label(key, value) {
                problems.push(format!("k8sOptions.nodeSelector: {e}"));
            }
        }
        out.volume_mounts = read(other, "volumeMounts", &mut problems)
            .flatten()
            .unwrap_or_default();
        check_volume_mounts(&out.volume_mounts, &mut problems);
        out.image_credentials = read(other, "imageCredentials", &mut problems)
            .flatten()
            .unwrap_or_default();
        for (i, c) in out.image_credentials.iter().enumerate() {
            if c.registry.trim().is_empty() || c.registry.chars().any(char::is_whitespace) {
                problems.push(format!(
                    "k8sOptions.imageCredentials[{i}].registry must be a registry host"
                ));
            }
        }
        if problems.is_empty() {
            Ok(out)
        } else {
            Err(problems)
        }
    }

    /// The namespace the workers run in.
    pub fn namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or(helm::DEFAULT_NAMESPACE)
    }
}

/// `other[key]` as a `T`; `None` when absent, a problem when it has the wrong shape.
fn read<T: serde::de::DeserializeOwned>(
    other: &Map<String, Value>,
    key: &str,
    problems: &mut Vec<String>,
) -> Option<T> {
    let value = other.get(key)?;
    match serde_path_to_error::deserialize::<_, T>(value) {
        Ok(v) => Some(v),
        Err(e) => {
            let path = e.path().to_string();
            let at = if path == "." {
                format!("k8sOptions.{key}")
            } else {
                format!("k8sOptions.{key}.{path}")
            };
            problems.push(format!("{at}: {}", e.into_inner()));
            None
        }
    }
}

/// A DNS-1123 label: what namespaces and volume names must be.
pub(crate) fn check_dns_label(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a DNS-1123 label (lower-case letters, digits and '-', at most 63, \
             starting and ending with a letter or digit)"
        ))
    }
}

/// A Kubernetes label key (`[prefix/]name`) and value.
fn check_label(key: &str, value: &str) -> Result<(), String> {
    fn name_ok(s: &str, max: usize) -> bool {
        s.len() <= max
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && s.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
            && s.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric())
    }
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty() && p.len() <= 253 && p.split('.').all(|part| check_dns_label(part).is_ok())
    });
    if name.is_empty() || !name_ok(name, 63) || !prefix_ok {
        return Err(format!("{key:?} is not a label key"));
    }
    if !name_ok(value, 63) {
        return Err(format!(
            "the value of {key:?}, {value:?}, is not a label value"
        ));
    }
    Ok(())
}

fn check_volume_mounts(mounts: &[VolumeMount], problems: &mut Vec<String>) {
    let mut names = BTreeSet::new();
    let mut paths = BTreeSet::new();
    for (i, m) in mounts.iter().enumerate() {
        let at = format!("k8sOptions.volumeMounts[{i}]");
        if let Err(e) = check_dns_label(&m.name) {
            problems.push(format!("{at}.name: {e}"));
        }
        let reserved = RESERVED_VOLUMES.contains(&m.name.as_str())
            || super::vendors::VENDORS
                .iter()
                .any(|v| v.k8s_mounts.iter().any(|h| h.name == m.name));
        if reserved {
            problems.push(format!(
                "{at}.name: {:?} is used by the worker itself",
                m.name
            ));
        }
        if !names.insert(m.name.as_str()) {
            problems.push(format!("{at}.name: {:?} is used twice", m.name));
        }
        if let Err(e) = check_absolute(&m.mount_path) {
            problems.push(format!("{at}.mountPath: {e}"));
        } else if m.mount_path.trim_end_matches('/') == DATA_DIR {
            problems.push(format!(
                "{at}.mountPath: {DATA_DIR} is the worker's data directory"
            ));
        }
        if !paths.insert(m.mount_path.trim_end_matches('/')) {
            problems.push(format!("{at}.mountPath: {:?} is used twice", m.mount_path));
        }
        let s = &m.volume_source;
        let sources = [
            s.host_path.is_some(),
            s.persistent_volume_claim.is_some(),
            s.config_map.is_some(),
        ];
        match sources.iter().filter(|set| **set).count() {
            1 => {}
            0 => problems.push(format!(
                "{at}.volumeSource: set one of hostPath, persistentVolumeClaim, configMap"
            )),
            _ => problems.push(format!(
                "{at}.volumeSource: set only one of hostPath, persistentVolumeClaim, configMap"
            )),
        }
        if let Some(h) = &s.host_path {
            if let Err(e) = check_absolute(&h.path) {
                problems.push(format!("{at}.volumeSource.hostPath.path: {e}"));
            }
            if let Some(kind) = &h.kind
                && !HOST_PATH_TYPES.contains(&kind.as_str())
            {
                problems.push(format!(
                    "{at}.volumeSource.hostPath.type: {kind:?} is not one of {}",
                    HOST_PATH_TYPES[1..].join(", ")
                ));
            }
        }
        if let Some(c) = &s.persistent_volume_claim
            && c.claim_name.trim().is_empty()
        {
            problems.push(format!(
                "{at}.volumeSource.persistentVolumeClaim.claimName is empty"
            ));
        }
        if let Some(c) = &s.config_map
            && c.name.trim().is_empty()
        {
            problems.push(format!("{at}.volumeSource.configMap.name is empty"));
        }
    }
}

/// An absolute path without `..`, control characters or `:` (Docker's and Kubernetes' separator).
pub(crate) fn check_absolute(path: &str) -> Result<(), String> {
    if !path.starts_with('/') {
        return Err(format!("{path:?} is not an absolute path"));
    }
    if path.chars().any(char::is_control) {
        return Err(format!("{path:?} holds a control character"));
    }
    if path.contains(':') || path.contains(',') {
        return Err(format!(
            "{path:?}: ':' and ',' cannot be used in a mounted path"
        ));
    }
    if path.split('/').any(|part| part == "..") {
        return Err(format!("{path:?} climbs with '..'"));
    }
    Ok(())
}

/// The worker settings of a cluster's `worker_config`, with the standalone worker's defaults.
pub(crate) fn worker_settings(cluster: &Cluster) -> WorkerConfig {
    let configured = cluster
        .worker_config
        .as_ref()
        .and_then(|v| worker_config::from_api_value(v).ok())
        .unwrap_or_default();
    WorkerConfig {
        proxy_mode: Some(ProxyMode::Worker),
        worker_port: Some(DEFAULT_WORKER_PORT),
        worker_metrics_port: Some(DEFAULT_WORKER_METRICS_PORT),
        disable_worker_metrics: Some(false),
        ..WorkerConfig::default()
    }
    .overlay(&configured)
}

/// The chart values of `cluster`: derived, then `k8sOptions.helmValues` merged over them.
pub fn chart_values(
    cluster: &Cluster,
    server_url: &str,
    image: &ImageRef,
) -> Result<Value, JoinError> {
    let options = KubernetesOptions::from_cluster(cluster.k8s_options.as_ref())
        .map_err(JoinError::Invalid)?;
    let image = image.for_cluster(cluster.default_container_registry.as_deref());
    let ctx = HelmContext {
        cluster_id: cluster.id,
        cluster_name: cluster.name.clone(),
        server_url: server_url.to_owned(),
        image_repository: image.repository.clone(),
        image_tag: image.tag.clone(),
        registry: Some(image.registry().to_owned()),
        token_secret_name: format!("faden-cluster-{}-registration", cluster.id),
        namespace: options.namespace().to_owned(),
        node_selector: options.node_selector.clone(),
    };
    let mut values = helm::derived_values(&ctx);
    let settings = worker_settings(cluster);
    let (mounts, volumes): (Vec<Value>, Vec<Value>) = options
        .volume_mounts
        .iter()
        .map(|m| {
            let mut volume = json!({"name": m.name});
            if let (Value::Object(v), Ok(Value::Object(source))) =
                (&mut volume, serde_json::to_value(&m.volume_source))
            {
                v.extend(source);
            }
            (
                json!({"name": m.name, "mountPath": m.mount_path, "readOnly": m.read_only}),
                volume,
            )
        })
        .unzip();
    if let Value::Object(map) = &mut values {
        map.insert(
            "imagePullSecrets".to_owned(),
            (0..options.image_credentials.len())
                .map(|i| json!({"name": format!("{PULL_SECRET_PREFIX}{i}")}))
                .collect(),
        );
        map.insert(
            "worker".to_owned(),
            json!({
                "proxyMode": settings.proxy_mode.unwrap_or(ProxyMode::Worker).as_str(),
                "port": settings.worker_port,
                "metricsPort": settings.worker_metrics_port,
                "metricsEnabled": !settings.disable_worker_metrics.unwrap_or(false),
                "dataDir": HOST_DATA_DIR,
                "extraVolumeMounts": mounts,
                "extraVolumes": volumes,
            }),
        );
    }
    let overlay = cluster
        .k8s_options
        .as_ref()
        .and_then(|k| k.helm_values.as_ref());
    Ok(helm::apply_overlay(values, overlay)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(value: Value) -> Result<KubernetesOptions, Vec<String>> {
        let k8s: K8sOptions = serde_json::from_value(value).unwrap();
        KubernetesOptions::from_cluster(Some(&k8s))
    }

    #[test]
    fn options_are_read_in_gpustack_shape() {
        let o = options(json!({
            "namespace": "gpu",
            "nodeSelector": {"pool": "a100", "example.com/zone": "b"},
            "volumeMounts": [
                {"name": "models", "mountPath": "/models", "readOnly": true,
                 "volumeSource": {"hostPath": {"path": "/data/models", "type": "Directory"}}},
                {"name": "cache", "mountPath": "/cache",
                 "volumeSource": {"persistentVolumeClaim": {"claimName": "hf-cache"}}},
            ],
            "imageCredentials": [{"registry": "reg.example.com", "username": "u", "password": "p"}],
            "operatorImage": "kept/but-unread:1",
        }))
        .unwrap();
        assert_eq!(o.namespace(), "gpu");
        assert_eq!(o.node_selector["pool"], "a100");
        assert_eq!(o.volume_mounts.len(), 2);
        assert_eq!(o.image_credentials[0].registry, "reg.example.com");
        assert_eq!(
            KubernetesOptions::from_cluster(None).unwrap().namespace(),
            "gpustack-system"
        );
    }

    #[test]
    fn every_bad_option_is_reported() {
        let problems = options(json!({
            "namespace": "GPU_ns",
            "nodeSelector": {"bad key!": "x", "ok": "not ok!"},
            "volumeMounts": [
                {"name": "faden-data", "mountPath": "relative", "volumeSource": {}},
                {"name": "twice", "mountPath": "/a",
                 "volumeSource": {"hostPath": {"path": "/a/../etc", "type": "Dir"}}},
                {"name": "twice", "mountPath": "/a",
                 "volumeSource": {"configMap": {"name": "c"}, "hostPath": {"path": "/x"}}},
                {"name": "data", "mountPath": "/var/lib/faden",
                 "volumeSource": {"configMap": {"name": "c"}}},
            ],
            "imageCredentials": [{"registry": ""}],
        }))
        .unwrap_err();
        let text = problems.join("\n");
        for expected in [
            "k8sOptions.namespace: \"GPU_ns\" is not a DNS-1123 label",
            "\"bad key!\" is not a label key",
            "the value of \"ok\", \"not ok!\", is not a label value",
            "volumeMounts[0].name: \"faden-data\" is used by the worker itself",
            "volumeMounts[0].mountPath: \"relative\" is not an absolute path",
            "volumeMounts[0].volumeSource: set one of",
            "volumeMounts[1].volumeSource.hostPath.path: \"/a/../etc\" climbs",
            "volumeMounts[1].volumeSource.hostPath.type: \"Dir\" is not one of",
            "volumeMounts[2].name: \"twice\" is used twice",
            "volumeMounts[2].mountPath: \"/a\" is used twice",
            "volumeMounts[2].volumeSource: set only one of",
            "volumeMounts[3].mountPath: /var/lib/faden is the worker's data directory",
            "imageCredentials[0].registry must be a registry host",
        ] {
            assert!(text.contains(expected), "{expected}\nin:\n{text}");
        }
        let shape = options(json!({"volumeMounts": [{"name": "x"}], "nodeSelector": {"a": 1}}))
            .unwrap_err()
            .join("\n");
        assert!(shape.contains("k8sOptions.volumeMounts.[0]"), "{shape}");
        assert!(shape.contains("k8sOptions.nodeSelector.a"), "{shape}");
        let unknown = options(json!({"volumeMounts": [{"name": "x", "mountPath": "/x",
            "volumeSource": {"nfs": {}}}]}))
        .unwrap_err()
        .join("\n");
        assert!(unknown.contains("unknown field `nfs`"), "{unknown}");
    }
}
