//! The worker configuration a cluster carries ("Worker Configuration YAML").
//!
//! A cluster stores this document so that every worker joining it starts pre-configured; a worker
//! may also read the same format from its local `--config-file`. The effective configuration of a
//! worker is a stack of these documents, combined with [`WorkerConfig::overlay`]:
//! flag > local file > cluster config > [`WorkerConfig::builtin_defaults`].
//!
//! Validation is deliberately exhaustive: an operator pasting a document into the UI should see
//! *every* problem at once (unknown keys, wrong types, out-of-range ports, ...) rather than fix them
//! one round trip at a time. YAML text ([`parse_yaml`]) and JSON objects ([`from_json`]) are first
//! converted to one intermediate tree (`Node`) and validated by the same code, so both inputs
//! accept and reject exactly the same documents. For YAML, each problem also carries the line and
//! column of the offending key or value when it can be found in the text.
//!
//! `null` (or an empty YAML value such as `cache_dir:`) for any option means "not set", exactly as
//! if the key were absent.
//!
//! The pieces: the configuration and its layers (here); `node` the intermediate tree; `validate`
//! the rules; `suggest` the "did you mean" for unknown keys; `locate` the positions in YAML text;
//! `errors` the issues reported; `port_range` the `"start-end"` ranges.

mod errors;
mod locate;
mod node;
mod port_range;
mod suggest;
#[cfg(test)]
mod tests;
mod validate;

use serde::{Deserialize, Serialize, Serializer};

use control_client::model::{DEFAULT_WORKER_METRICS_PORT, DEFAULT_WORKER_PORT, ProxyMode};

pub use errors::{ConfigErrors, ConfigIssue};
pub use port_range::PortRange;

use locate::Locator;
use node::{NODE_DEPTH, Node};
use validate::validate;

/// Every top-level option, in documentation order.
pub const KNOWN_KEYS: &[&str] = &[
    "debug",
    "tools_download_base_url",
    "pipx_path",
    "cache_dir",
    "log_dir",
    "bin_dir",
    "image_name_override",
    "image_repo",
    "worker_ifname",
    "worker_port",
    "worker_metrics_port",
    "disable_worker_metrics",
    "service_port_range",
    "ray_port_range",
    "proxy_mode",
    "system_reserved",
    "huggingface_token",
    "enable_hf_transfer",
    "insecure_tls",
];

/// The keys of the `system_reserved` mapping.
pub const SYSTEM_RESERVED_KEYS: &[&str] = &["ram", "vram"];

/// A validated worker configuration. `None` means "not set here": a lower layer (or the worker's
/// built-in default) decides.
///
/// Deserializing (e.g. from a stored JSON column) runs the same validation as [`from_json`].
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(try_from = "serde_json::Value")]
pub struct WorkerConfig {
    /// Verbose logging.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub debug: Option<bool>,
    /// Mirror the worker downloads its tools from (`http://` or `https://`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools_download_base_url: Option<String>,
    /// Path of the `pipx` executable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipx_path: Option<String>,
    /// Model and download cache directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<String>,
    /// Log directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_dir: Option<String>,
    /// Directory for downloaded binaries.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bin_dir: Option<String>,
    /// Full image name (`repo:tag`) replacing the one the worker would pick.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_name_override: Option<String>,
    /// Image repository the worker pulls its images from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_repo: Option<String>,
    /// Network interface whose address the worker advertises.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_ifname: Option<String>,
    /// Worker API / reverse-proxy port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_port: Option<u16>,
    /// Worker metrics port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_metrics_port: Option<u16>,
    /// Turns the metrics endpoint off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disable_worker_metrics: Option<bool>,
    /// Ports handed to inference servers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_port_range: Option<PortRange>,
    /// Ports used by Ray for distributed inference.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ray_port_range: Option<PortRange>,
    /// How the data plane reaches this worker's instances.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy_mode: Option<ProxyMode>,
    /// Resources kept back from scheduling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_reserved: Option<SystemReserved>,
    /// Token for gated Hugging Face models.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub huggingface_token: Option<String>,
    /// Use `hf_transfer` for faster Hugging Face downloads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enable_hf_transfer: Option<bool>,
    /// Skip TLS certificate verification towards the server.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub insecure_tls: Option<bool>,
}

/// Resources (in GiB) the scheduler keeps free on a worker for the system itself.
///
/// A `None` field is not reserved by this layer; the worker's default applies.
#[derive(Clone, Copy, Debug, PartialEq, Default, Serialize)]
pub struct SystemReserved {
    /// Host memory in GiB (finite, `>= 0`).
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "ser_gib")]
    pub ram: Option<f64>,
    /// GPU memory in GiB (finite, `>= 0`).
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "ser_gib")]
    pub vram: Option<f64>,
}

/// Parses and validates worker configuration YAML.
///
/// Empty text, `null` and `{}` give the default (all unset) configuration. A YAML syntax error is
/// reported as one document-level issue with its line and column; otherwise every key is
/// validated and all problems are returned together. YAML merge keys (`<<: *anchor`) are applied
/// before validation.
pub fn parse_yaml(text: &str) -> Result<WorkerConfig, ConfigErrors> {
    let mut value: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(text).map_err(|e| ConfigErrors::from_yaml_error(&e, text))?;
    value
        .apply_merge()
        .map_err(|e| ConfigErrors::from_yaml_error(&e, text))?;
    let node = Node::from_yaml(&value, NODE_DEPTH);
    validate(&node).map_err(|problems| {
        let locator = Locator::new(text);
        ConfigErrors::from_problems(problems, Some(&locator))
    })
}

/// Validates a worker configuration given as a JSON object (API clients may send an object
/// instead of YAML text). `null` gives the default configuration; any other non-object is one
/// document-level issue. The rules are exactly those of [`parse_yaml`].
pub fn from_json(value: &serde_json::Value) -> Result<WorkerConfig, ConfigErrors> {
    validate(&Node::from_json(value, NODE_DEPTH))
        .map_err(|problems| ConfigErrors::from_problems(problems, None))
}

/// Accepts the two shapes an API field may take: a JSON string holding YAML text
/// ([`parse_yaml`]) or a JSON object / `null` ([`from_json`]).
pub fn from_api_value(value: &serde_json::Value) -> Result<WorkerConfig, ConfigErrors> {
    match value {
        serde_json::Value::String(text) => parse_yaml(text),
        other => from_json(other),
    }
}

impl WorkerConfig {
    /// The values a standalone worker uses when no layer sets an option.
    ///
    /// Only options whose default is fixed by the product are set; paths, image names, the tools
    /// mirror, the token and `system_reserved` stay unset because the worker derives them from
    /// its data directory, version and hardware.
    pub fn builtin_defaults() -> WorkerConfig {
        WorkerConfig {
            debug: Some(false),
            worker_port: Some(DEFAULT_WORKER_PORT),
            worker_metrics_port: Some(DEFAULT_WORKER_METRICS_PORT),
            disable_worker_metrics: Some(false),
            service_port_range: Some(PortRange {
                start: 40000,
                end: 40063,
            }),
            ray_port_range: Some(PortRange {
                start: 41000,
                end: 41999,
            }),
            proxy_mode: Some(ProxyMode::Worker),
            enable_hf_transfer: Some(false),
            insecure_tls: Some(false),
            ..WorkerConfig::default()
        }
    }

    /// Returns `self` with every option that `higher` sets replaced by `higher`'s value.
    ///
    /// Options are replaced whole: `system_reserved` from `higher` replaces the lower mapping
    /// entirely, as setting the option in a file or flag does on a worker.
    pub fn overlay(&self, higher: &WorkerConfig) -> WorkerConfig {
        // Destructuring (rather than `higher.field`) makes adding a field without overlaying it a
        // compile error.
        let WorkerConfig {
            debug,
            tools_download_base_url,
            pipx_path,
            cache_dir,
            log_dir,
            bin_dir,
            image_name_override,
            image_repo,
            worker_ifname,
            worker_port,
            worker_metrics_port,
            disable_worker_metrics,
            service_port_range,
            ray_port_range,
            proxy_mode,
            system_reserved,
            huggingface_token,
            enable_hf_transfer,
            insecure_tls,
        } = higher;
        WorkerConfig {
            debug: pick(&self.debug, debug),
            tools_download_base_url: pick(&self.tools_download_base_url, tools_download_base_url),
            pipx_path: pick(&self.pipx_path, pipx_path),
            cache_dir: pick(&self.cache_dir, cache_dir),
            log_dir: pick(&self.log_dir, log_dir),
            bin_dir: pick(&self.bin_dir, bin_dir),
            image_name_override: pick(&self.image_name_override, image_name_override),
            image_repo: pick(&self.image_repo, image_repo),
            worker_ifname: pick(&self.worker_ifname, worker_ifname),
            worker_port: pick(&self.worker_port, worker_port),
            worker_metrics_port: pick(&self.worker_metrics_port, worker_metrics_port),
            disable_worker_metrics: pick(&self.disable_worker_metrics, disable_worker_metrics),
            service_port_range: pick(&self.service_port_range, service_port_range),
            ray_port_range: pick(&self.ray_port_range, ray_port_range),
            proxy_mode: pick(&self.proxy_mode, proxy_mode),
            system_reserved: pick(&self.system_reserved, system_reserved),
            huggingface_token: pick(&self.huggingface_token, huggingface_token),
            enable_hf_transfer: pick(&self.enable_hf_transfer, enable_hf_transfer),
            insecure_tls: pick(&self.insecure_tls, insecure_tls),
        }
    }

    /// The configuration as YAML text, unset options omitted (`{}` when nothing is set).
    /// [`parse_yaml`] reads it back to an equal value.
    pub fn to_yaml(&self) -> String {
        // Serializing plain strings, integers, booleans and finite floats cannot fail.
        serde_yaml_ng::to_string(self).unwrap_or_default()
    }

    /// The configuration as a JSON object, unset options omitted.
    pub fn to_json(&self) -> serde_json::Value {
        // Serializing a struct with string keys cannot fail.
        serde_json::to_value(self)
            .unwrap_or_else(|_| serde_json::Value::Object(serde_json::Map::new()))
    }
}

fn pick<T: Clone>(lower: &Option<T>, higher: &Option<T>) -> Option<T> {
    higher.as_ref().or(lower.as_ref()).cloned()
}

impl TryFrom<serde_json::Value> for WorkerConfig {
    type Error = ConfigErrors;

    fn try_from(value: serde_json::Value) -> Result<Self, Self::Error> {
        from_json(&value)
    }
}

/// Writes whole GiB amounts as integers (`ram: 2`, not `ram: 2.0`) so that stored documents look
/// like the ones operators write.
fn ser_gib<S: Serializer>(value: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match value {
        Some(v) if v.fract() == 0.0 && (0.0..=9_007_199_254_740_992.0).contains(v) => {
            // Exactly representable integer (<= 2^53), so the cast is lossless.
            s.serialize_u64(*v as u64)
        }
        Some(v) => s.serialize_f64(*v),
        None => s.serialize_none(),
    }
}
