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

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use control_client::model::{DEFAULT_WORKER_METRICS_PORT, DEFAULT_WORKER_PORT, ProxyMode};

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

/// An inclusive port range, written `"start-end"` (e.g. `"40000-40063"`).
///
/// Invariant (enforced by [`PortRange::new`] and parsing): `1 <= start <= end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PortRange {
    pub start: u16,
    pub end: u16,
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

/// All problems found in a worker configuration document.
#[derive(Clone, Debug, PartialEq, Serialize, thiserror::Error)]
pub struct ConfigErrors {
    pub issues: Vec<ConfigIssue>,
}

/// One problem in a worker configuration document.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ConfigIssue {
    /// Dotted path of the offending key (`"system_reserved.ram"`); `""` for the whole document.
    pub key: String,
    /// What is wrong, in words an operator can act on.
    pub message: String,
    /// 1-based line in the YAML text, when known (never for JSON input).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<usize>,
    /// 1-based column in the YAML text, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub column: Option<usize>,
}

// ---------------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// PortRange and SystemReserved
// ---------------------------------------------------------------------------------------------

impl PortRange {
    /// A range, or why it is invalid (port 0, or start after end).
    pub fn new(start: u16, end: u16) -> Result<PortRange, String> {
        if start == 0 || end == 0 {
            return Err(format!(
                "ports must be between 1 and 65535, got {start}-{end}"
            ));
        }
        if start > end {
            return Err(format!("start {start} is greater than end {end}"));
        }
        Ok(PortRange { start, end })
    }

    /// Number of ports in the range.
    pub fn len(&self) -> usize {
        usize::from(self.end.saturating_sub(self.start)) + 1
    }

    /// Always false: a valid range holds at least one port.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether `port` lies in the range.
    pub fn contains(&self, port: u16) -> bool {
        (self.start..=self.end).contains(&port)
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.start, self.end)
    }
}

impl FromStr for PortRange {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let shape_error =
            || format!("expected \"start-end\" such as \"40000-40063\", got {text:?}");
        let (start, end) = text.trim().split_once('-').ok_or_else(shape_error)?;
        let start = parse_port_number(start).ok_or_else(shape_error)?;
        let end = parse_port_number(end).ok_or_else(shape_error)?;
        if !(1..=65535).contains(&start) || !(1..=65535).contains(&end) {
            return Err(format!(
                "ports must be between 1 and 65535, got {start}-{end}"
            ));
        }
        // Both are in 1..=65535, so the conversions succeed.
        let start = u16::try_from(start).map_err(|_| shape_error())?;
        let end = u16::try_from(end).map_err(|_| shape_error())?;
        PortRange::new(start, end)
    }
}

/// ASCII digits only (no sign, no spaces inside); large values saturate so that `"99999"` is
/// reported as out of range rather than as a malformed range.
fn parse_port_number(text: &str) -> Option<u32> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(text.parse::<u32>().unwrap_or(u32::MAX))
}

impl Serialize for PortRange {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PortRange {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
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

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

impl fmt::Display for ConfigErrors {
    /// One line naming every key: `invalid worker configuration: worker_port: ...; foo: ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("invalid worker configuration: ")?;
        for (i, issue) in self.issues.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            if issue.key.is_empty() {
                f.write_str("(document)")?;
            } else {
                write!(f, "{}", issue.key.escape_debug())?;
            }
            write!(f, ": {}", issue.message)?;
        }
        Ok(())
    }
}

impl ConfigErrors {
    /// A single document-level issue.
    fn document(message: String, line: Option<usize>, column: Option<usize>) -> ConfigErrors {
        ConfigErrors {
            issues: vec![ConfigIssue {
                key: String::new(),
                message: one_line(&message),
                line,
                column,
            }],
        }
    }

    /// A YAML syntax error at the parser's position. libyaml reports errors at the end of input
    /// one line past the last one; such positions are moved to the end of the last line so that
    /// they always lie inside the text.
    fn from_yaml_error(error: &serde_yaml_ng::Error, text: &str) -> ConfigErrors {
        let position = error
            .location()
            .map(|l| clamp_to_text(text, l.line(), l.column()));
        ConfigErrors::document(
            format!("invalid YAML: {error}"),
            position.map(|p| p.0),
            position.map(|p| p.1),
        )
    }

    fn from_problems(problems: Vec<Problem>, locator: Option<&Locator>) -> ConfigErrors {
        let issues = problems
            .into_iter()
            .map(|problem| {
                let position =
                    locator.and_then(|l| l.locate(&problem.path, problem.at == Target::Value));
                ConfigIssue {
                    key: problem.path.join("."),
                    message: one_line(&problem.message),
                    line: position.map(|p| p.0),
                    column: position.map(|p| p.1),
                }
            })
            .collect();
        ConfigErrors { issues }
    }
}

/// `(line, column)` limited to the lines of `text` (split at `\n`; 1-based).
fn clamp_to_text(text: &str, line: usize, column: usize) -> (usize, usize) {
    let last_line = text.split('\n').count();
    if line <= last_line {
        return (line.max(1), column.max(1));
    }
    let last_len = text.rsplit('\n').next().map_or(0, |l| l.chars().count());
    (last_line, last_len + 1)
}

/// Keeps messages (which may quote library errors) on one line for logs and the summary.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

// ---------------------------------------------------------------------------------------------
// Intermediate representation shared by YAML and JSON input
// ---------------------------------------------------------------------------------------------

/// A parsed document reduced to what validation needs. Both input formats convert to this, so the
/// rules live in one place.
#[derive(Debug)]
enum Node {
    Null,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Seq,
    /// Entries in document order; non-string YAML keys are rendered as text (they are never
    /// known keys, so they are reported as unknown).
    Map(Vec<(String, Node)>),
    /// A YAML value with a custom tag (`!foo 1`): never a valid option value.
    Tagged(String),
}

/// How deep [`Node`] conversion looks into mappings: options are at depth 1 and
/// `system_reserved.ram` at depth 2. Deeper mappings are only ever reported as "a mapping", so
/// their contents are not converted (which also bounds recursion on hostile input).
const NODE_DEPTH: usize = 2;

impl Node {
    fn from_yaml(value: &serde_yaml_ng::Value, depth: usize) -> Node {
        use serde_yaml_ng::Value;
        match value {
            Value::Null => Node::Null,
            Value::Bool(b) => Node::Bool(*b),
            Value::Number(n) => Node::number(n.as_u64(), n.as_i64(), n.as_f64()),
            Value::String(s) => Node::Str(s.clone()),
            Value::Sequence(_) => Node::Seq,
            Value::Mapping(_) if depth == 0 => Node::Map(Vec::new()),
            Value::Mapping(map) => Node::Map(
                map.iter()
                    .map(|(k, v)| (yaml_key_text(k), Node::from_yaml(v, depth - 1)))
                    .collect(),
            ),
            Value::Tagged(tagged) => Node::Tagged(tagged.tag.to_string()),
        }
    }

    fn from_json(value: &serde_json::Value, depth: usize) -> Node {
        use serde_json::Value;
        match value {
            Value::Null => Node::Null,
            Value::Bool(b) => Node::Bool(*b),
            Value::Number(n) => Node::number(n.as_u64(), n.as_i64(), n.as_f64()),
            Value::String(s) => Node::Str(s.clone()),
            Value::Array(_) => Node::Seq,
            Value::Object(_) if depth == 0 => Node::Map(Vec::new()),
            Value::Object(map) => Node::Map(
                map.iter()
                    .map(|(k, v)| (k.clone(), Node::from_json(v, depth - 1)))
                    .collect(),
            ),
        }
    }

    /// Integers stay exact (ports must not be rounded); everything else is a float.
    fn number(unsigned: Option<u64>, signed: Option<i64>, float: Option<f64>) -> Node {
        match (unsigned, signed, float) {
            (Some(u), _, _) => Node::Int(i128::from(u)),
            (None, Some(i), _) => Node::Int(i128::from(i)),
            (None, None, f) => Node::Float(f.unwrap_or(f64::NAN)),
        }
    }

    /// How the value reads in an error message: `string "yes"`, `integer 0`, `a list`, ...
    fn describe(&self) -> String {
        match self {
            Node::Null => "null".to_owned(),
            Node::Bool(b) => format!("boolean {b}"),
            Node::Int(i) => format!("integer {i}"),
            Node::Float(f) => format!("number {f}"),
            Node::Str(s) => format!("string {:?}", truncate(s, 40)),
            Node::Seq => "a list".to_owned(),
            Node::Map(_) => "a mapping".to_owned(),
            Node::Tagged(tag) => format!("a value tagged {tag}"),
        }
    }

    /// Hint appended to "expected a string" errors for unquoted scalars YAML typed otherwise.
    fn quote_hint(&self) -> &'static str {
        match self {
            Node::Bool(_) | Node::Int(_) | Node::Float(_) => " (quote it to make it a string)",
            _ => "",
        }
    }
}

fn yaml_key_text(key: &serde_yaml_ng::Value) -> String {
    use serde_yaml_ng::Value;
    match key {
        Value::String(s) => s.clone(),
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::Sequence(_) => "<list>".to_owned(),
        Value::Mapping(_) => "<mapping>".to_owned(),
        Value::Tagged(t) => format!("{} {}", t.tag, yaml_key_text(&t.value)),
    }
}

fn truncate(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max_chars).collect();
    cut.push('…');
    cut
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

/// A problem found by validation, before it is positioned in the source text.
#[derive(Debug)]
struct Problem {
    /// Key segments (kept apart because unknown keys may themselves contain dots).
    path: Vec<String>,
    message: String,
    at: Target,
}

/// Whether a problem is about the key itself (unknown key) or about its value.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Target {
    Key,
    Value,
}

/// Validates a whole document, collecting every problem.
fn validate(root: &Node) -> Result<WorkerConfig, Vec<Problem>> {
    let entries = match root {
        Node::Null => return Ok(WorkerConfig::default()),
        Node::Map(entries) => entries,
        other => {
            return Err(vec![Problem {
                path: Vec::new(),
                message: format!(
                    "the worker configuration must be a mapping of options, got {}",
                    other.describe()
                ),
                at: Target::Value,
            }]);
        }
    };
    let mut config = WorkerConfig::default();
    let mut problems = Vec::new();
    for (key, value) in entries {
        apply_option(&mut config, key, value, &mut problems);
    }
    if problems.is_empty() {
        Ok(config)
    } else {
        Err(problems)
    }
}

/// The result of reading one option's value: `Ok(None)` when it is `null` (unset).
type Parsed<T> = Result<Option<T>, String>;

/// Validates one top-level entry and stores its value in `config`.
fn apply_option(config: &mut WorkerConfig, key: &str, value: &Node, problems: &mut Vec<Problem>) {
    let mut sink = Sink { key, problems };
    match key {
        "debug" => sink.set(&mut config.debug, boolean(value)),
        "tools_download_base_url" => sink.set(&mut config.tools_download_base_url, url(value)),
        "pipx_path" => sink.set(&mut config.pipx_path, text(value)),
        "cache_dir" => sink.set(&mut config.cache_dir, text(value)),
        "log_dir" => sink.set(&mut config.log_dir, text(value)),
        "bin_dir" => sink.set(&mut config.bin_dir, text(value)),
        "image_name_override" => sink.set(&mut config.image_name_override, text(value)),
        "image_repo" => sink.set(&mut config.image_repo, text(value)),
        "worker_ifname" => sink.set(&mut config.worker_ifname, text(value)),
        "worker_port" => sink.set(&mut config.worker_port, port(value)),
        "worker_metrics_port" => sink.set(&mut config.worker_metrics_port, port(value)),
        "disable_worker_metrics" => sink.set(&mut config.disable_worker_metrics, boolean(value)),
        "service_port_range" => sink.set(&mut config.service_port_range, port_range(value)),
        "ray_port_range" => sink.set(&mut config.ray_port_range, port_range(value)),
        "proxy_mode" => sink.set(&mut config.proxy_mode, proxy_mode(value)),
        "system_reserved" => config.system_reserved = system_reserved(value, problems),
        "huggingface_token" => sink.set(&mut config.huggingface_token, text(value)),
        "enable_hf_transfer" => sink.set(&mut config.enable_hf_transfer, boolean(value)),
        "insecure_tls" => sink.set(&mut config.insecure_tls, boolean(value)),
        _ => problems.push(unknown_key(Vec::new(), key, KNOWN_KEYS)),
    }
}

/// Stores a parsed value, or records why it could not be parsed.
struct Sink<'a> {
    key: &'a str,
    problems: &'a mut Vec<Problem>,
}

impl Sink<'_> {
    fn set<T>(&mut self, slot: &mut Option<T>, parsed: Parsed<T>) {
        match parsed {
            Ok(value) => *slot = value,
            Err(message) => self.problems.push(Problem {
                path: vec![self.key.to_owned()],
                message,
                at: Target::Value,
            }),
        }
    }
}

fn unknown_key(parent: Vec<String>, key: &str, known: &[&str]) -> Problem {
    let message = match closest_known(key, known) {
        Some(similar) => format!("unknown option; did you mean {similar:?}?"),
        None => format!("unknown option; known options: {}", known.join(", ")),
    };
    let mut path = parent;
    path.push(key.to_owned());
    Problem {
        path,
        message,
        at: Target::Key,
    }
}

fn boolean(node: &Node) -> Parsed<bool> {
    match node {
        Node::Null => Ok(None),
        Node::Bool(b) => Ok(Some(*b)),
        other => Err(format!("expected true or false, got {}", other.describe())),
    }
}

fn text(node: &Node) -> Parsed<String> {
    match node {
        Node::Null => Ok(None),
        Node::Str(s) => Ok(Some(s.clone())),
        other => Err(format!(
            "expected a string, got {}{}",
            other.describe(),
            other.quote_hint()
        )),
    }
}

/// The tools mirror must be an HTTP(S) URL with something after the scheme.
fn url(node: &Node) -> Parsed<String> {
    let Some(value) = text(node)? else {
        return Ok(None);
    };
    let lower = value.to_ascii_lowercase();
    let rest = lower
        .strip_prefix("https://")
        .or_else(|| lower.strip_prefix("http://"));
    match rest {
        Some(rest) if !rest.is_empty() && !rest.chars().any(char::is_whitespace) => Ok(Some(value)),
        Some(_) => Err(format!(
            "expected an http:// or https:// URL with a host, got {:?}",
            truncate(&value, 40)
        )),
        None => Err(format!(
            "URL must start with http:// or https://, got {:?}",
            truncate(&value, 40)
        )),
    }
}

fn port(node: &Node) -> Parsed<u16> {
    match node {
        Node::Null => Ok(None),
        Node::Int(i) => match u16::try_from(*i) {
            Ok(p) if p != 0 => Ok(Some(p)),
            _ => Err(format!("port must be between 1 and 65535, got {i}")),
        },
        other => Err(format!(
            "expected a port number (1-65535), got {}",
            other.describe()
        )),
    }
}

fn port_range(node: &Node) -> Parsed<PortRange> {
    match node {
        Node::Null => Ok(None),
        Node::Str(s) => s.parse().map(Some),
        other => Err(format!(
            "expected a port range string such as \"40000-40063\", got {}",
            other.describe()
        )),
    }
}

fn proxy_mode(node: &Node) -> Parsed<ProxyMode> {
    let expected = || {
        ProxyMode::ALL
            .iter()
            .map(|m| m.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match node {
        Node::Null => Ok(None),
        Node::Str(s) => ProxyMode::parse(s).map(Some).ok_or_else(|| {
            format!(
                "unknown proxy mode {:?}, expected one of: {}",
                truncate(s, 40),
                expected()
            )
        }),
        other => Err(format!(
            "expected one of: {}, got {}",
            expected(),
            other.describe()
        )),
    }
}

/// Reads `system_reserved`, recording problems under `system_reserved.<key>` so that a bad `ram`
/// and an unknown sibling are both reported.
fn system_reserved(node: &Node, problems: &mut Vec<Problem>) -> Option<SystemReserved> {
    const KEY: &str = "system_reserved";
    let entries = match node {
        Node::Null => return None,
        Node::Map(entries) => entries,
        other => {
            problems.push(Problem {
                path: vec![KEY.to_owned()],
                message: format!(
                    "expected a mapping with ram and/or vram (GiB), got {}",
                    other.describe()
                ),
                at: Target::Value,
            });
            return None;
        }
    };
    let mut reserved = SystemReserved::default();
    for (key, value) in entries {
        let slot = match key.as_str() {
            "ram" => &mut reserved.ram,
            "vram" => &mut reserved.vram,
            _ => {
                problems.push(unknown_key(vec![KEY.to_owned()], key, SYSTEM_RESERVED_KEYS));
                continue;
            }
        };
        match gibibytes(value) {
            Ok(amount) => *slot = amount,
            Err(message) => problems.push(Problem {
                path: vec![KEY.to_owned(), key.clone()],
                message,
                at: Target::Value,
            }),
        }
    }
    Some(reserved)
}

/// A non-negative, finite amount of GiB; integers and floats are both accepted.
fn gibibytes(node: &Node) -> Parsed<f64> {
    let amount = match node {
        Node::Null => return Ok(None),
        // Precision loss above 2^53 GiB is irrelevant.
        Node::Int(i) => *i as f64,
        Node::Float(f) => *f,
        other => {
            return Err(format!(
                "expected a number of GiB (0 or more), got {}",
                other.describe()
            ));
        }
    };
    if !amount.is_finite() {
        return Err(format!("expected a finite number of GiB, got {amount}"));
    }
    if amount < 0.0 {
        return Err(format!("must not be negative, got {amount}"));
    }
    // `-0.0 + 0.0` is `0.0`: never store (and later print) a negative zero.
    Ok(Some(amount + 0.0))
}

// ---------------------------------------------------------------------------------------------
// "Did you mean" suggestions
// ---------------------------------------------------------------------------------------------

/// The known key closest to `key`, if it is a plausible typo (edit distance at most 2 after
/// folding case and `-` to `_`).
fn closest_known<'k>(key: &str, known: &[&'k str]) -> Option<&'k str> {
    let folded: String = key
        .chars()
        .take(64)
        .map(|c| {
            if c == '-' {
                '_'
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect();
    known
        .iter()
        .map(|candidate| (edit_distance(&folded, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= 2 && *distance < candidate.len())
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

/// Levenshtein distance over chars (inputs are short: keys are capped at 64 chars above).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = Vec::with_capacity(b.len() + 1);
        current.push(i + 1);
        for (j, cb) in b.iter().enumerate() {
            let substitute = previous[j] + usize::from(ca != *cb);
            let delete = previous[j + 1] + 1;
            let insert = current[j] + 1;
            current.push(substitute.min(delete).min(insert));
        }
        previous = current;
    }
    previous[b.len()]
}

// ---------------------------------------------------------------------------------------------
// Positions in YAML text
// ---------------------------------------------------------------------------------------------

/// Finds the line and column of keys in block-style YAML text.
///
/// `serde_yaml_ng::Value` keeps no source positions, so after a successful parse this scans the
/// text itself. It understands block mappings (plain, single- and double-quoted keys) nested by
/// indentation, which is how these documents are written; for flow style (`{ram: -1}`) it falls
/// back to the nearest enclosing key it can find, and otherwise reports no position. A wrong guess
/// can only cost precision of the position, never correctness of the validation.
struct Locator {
    lines: Vec<KeyLine>,
    /// First line index of each top-level key.
    root: HashMap<String, usize>,
}

/// A content line (not blank, not a comment, not a `---` marker or directive).
#[derive(Debug)]
struct KeyLine {
    /// 1-based line number.
    line: usize,
    /// Leading spaces.
    indent: usize,
    /// The mapping key the line starts with, if any.
    key: Option<String>,
    /// 1-based column where the value starts, when it is on the same line.
    value_column: Option<usize>,
}

impl Locator {
    fn new(text: &str) -> Locator {
        let lines: Vec<KeyLine> = text
            .lines()
            .enumerate()
            .filter_map(|(i, line)| scan_line(i + 1, line))
            .collect();
        let mut root = HashMap::new();
        if let Some(root_indent) = lines.first().map(|l| l.indent) {
            for (index, line) in lines.iter().enumerate() {
                if let (true, Some(key)) = (line.indent == root_indent, &line.key) {
                    root.entry(key.clone()).or_insert(index);
                }
            }
        }
        Locator { lines, root }
    }

    /// `(line, column)` of the value at `path` (when `want_value` and it is on the key's line) or
    /// of its key; of the deepest enclosing key found when the full path is not.
    fn locate(&self, path: &[String], want_value: bool) -> Option<(usize, usize)> {
        let (first, rest) = path.split_first()?;
        let mut index = *self.root.get(first)?;
        let mut complete = true;
        for segment in rest {
            match self.child(index, segment) {
                Some(child) => index = child,
                None => {
                    complete = false;
                    break;
                }
            }
        }
        let found = self.lines.get(index)?;
        let column = match (complete && want_value, found.value_column) {
            (true, Some(value_column)) => value_column,
            _ => found.indent + 1,
        };
        Some((found.line, column))
    }

    /// Index of the line holding `key` directly inside the block that starts after `parent`.
    fn child(&self, parent: usize, key: &str) -> Option<usize> {
        let parent_indent = self.lines.get(parent)?.indent;
        let block = self
            .lines
            .iter()
            .enumerate()
            .skip(parent + 1)
            .take_while(|(_, l)| l.indent > parent_indent);
        let mut child_indent = None;
        for (index, line) in block {
            let indent = *child_indent.get_or_insert(line.indent);
            if line.indent == indent && line.key.as_deref() == Some(key) {
                return Some(index);
            }
        }
        None
    }
}

/// Classifies one line of text; `None` for lines that hold no content.
fn scan_line(number: usize, raw: &str) -> Option<KeyLine> {
    let raw = raw.strip_prefix('\u{feff}').unwrap_or(raw);
    let body = raw.trim_start_matches(' ');
    let indent = raw.len() - body.len();
    let is_marker = indent == 0
        && (body.starts_with("---") || body.starts_with("...") || body.starts_with('%'));
    if body.trim().is_empty() || body.starts_with('#') || is_marker {
        return None;
    }
    let (key, value_column) = match split_key(body) {
        Some((key, consumed)) => {
            let after = &body[consumed..];
            let value = after.trim_start_matches([' ', '\t']);
            let column = (!value.is_empty() && !value.starts_with('#')).then(|| {
                indent + body[..consumed].chars().count() + (after.len() - value.len()) + 1
            });
            (Some(key), column)
        }
        None => (None, None),
    };
    Some(KeyLine {
        line: number,
        indent,
        key,
        value_column,
    })
}

/// Splits `key: value` at the key's colon: the key text and the byte length up to and including
/// the colon.
fn split_key(body: &str) -> Option<(String, usize)> {
    let (key, after_key) = match body.chars().next()? {
        '"' => quoted_key(body, '"')?,
        '\'' => quoted_key(body, '\'')?,
        c if "{[#&*!|>%@`".contains(c) => {
            // Flow collections, anchors, tags, block scalars, reserved indicators: not a plain
            // `key:` line.
            return None;
        }
        '-' | '?' if ends_key(&body[1..]) => {
            // A sequence entry (`- x`) or a complex key (`? x`).
            return None;
        }
        _ => {
            let colon = colon_position(body)?;
            let key = body[..colon].trim_end();
            if key.is_empty() || key.contains(" #") {
                return None;
            }
            return Some((key.to_owned(), colon + 1));
        }
    };
    let rest = &body[after_key..];
    let spaces = rest.len() - rest.trim_start_matches([' ', '\t']).len();
    let colon = after_key + spaces;
    if body[colon..].starts_with(':') && ends_key(&body[colon + 1..]) {
        Some((key, colon + 1))
    } else {
        None
    }
}

/// Byte index of the first `:` that ends a plain key (followed by a space, a tab or the end).
fn colon_position(body: &str) -> Option<usize> {
    body.char_indices()
        .find(|(i, c)| *c == ':' && ends_key(&body[i + 1..]))
        .map(|(i, _)| i)
}

fn ends_key(after_colon: &str) -> bool {
    after_colon.is_empty() || after_colon.starts_with([' ', '\t'])
}

/// A quoted key starting at `body[0]`: its unescaped text and the byte index after the closing
/// quote. Only the escapes that can appear in option names are decoded.
fn quoted_key(body: &str, quote: char) -> Option<(String, usize)> {
    let mut key = String::new();
    let mut chars = body.char_indices().skip(1).peekable();
    while let Some((i, c)) = chars.next() {
        match (quote, c) {
            ('"', '\\') => key.push(chars.next()?.1),
            ('\'', '\'') if chars.peek().map(|(_, n)| *n) == Some('\'') => {
                chars.next();
                key.push('\'');
            }
            (q, c) if c == q => return Some((key, i + c.len_utf8())),
            (_, c) => key.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// The example from the product documentation, verbatim.
    const EXAMPLE: &str = r#"debug: false
tools_download_base_url: https://mirror.your_company.com
pipx_path: "/usr/local/bin/pipx"
cache_dir: "/var/lib/gpustack/cache"
log_dir: "/var/lib/gpustack/log"
bin_dir: "/var/lib/gpustack/bin"
image_name_override: "gpustack/gpustack:main"
image_repo: "gpustack/gpustack"
worker_ifname: en0
worker_port: 10150
worker_metrics_port: 10151
disable_worker_metrics: false
service_port_range: "40000-40063"
ray_port_range: "41000-41999"
proxy_mode: worker
system_reserved:
  ram: 0
  vram: 0
huggingface_token: xxxxxx
enable_hf_transfer: false
insecure_tls: false
"#;

    fn errors(text: &str) -> ConfigErrors {
        match parse_yaml(text) {
            Ok(config) => panic!("expected errors for {text:?}, got {config:?}"),
            Err(e) => e,
        }
    }

    fn only_issue(text: &str) -> ConfigIssue {
        let mut e = errors(text);
        assert_eq!(e.issues.len(), 1, "{e:?}");
        e.issues.remove(0)
    }

    fn keys(e: &ConfigErrors) -> Vec<&str> {
        e.issues.iter().map(|i| i.key.as_str()).collect()
    }

    #[test]
    fn documented_example_parses_every_option() {
        let config = parse_yaml(EXAMPLE).unwrap();
        let expected = WorkerConfig {
            debug: Some(false),
            tools_download_base_url: Some("https://mirror.your_company.com".into()),
            pipx_path: Some("/usr/local/bin/pipx".into()),
            cache_dir: Some("/var/lib/gpustack/cache".into()),
            log_dir: Some("/var/lib/gpustack/log".into()),
            bin_dir: Some("/var/lib/gpustack/bin".into()),
            image_name_override: Some("gpustack/gpustack:main".into()),
            image_repo: Some("gpustack/gpustack".into()),
            worker_ifname: Some("en0".into()),
            worker_port: Some(10150),
            worker_metrics_port: Some(10151),
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
            system_reserved: Some(SystemReserved {
                ram: Some(0.0),
                vram: Some(0.0),
            }),
            huggingface_token: Some("xxxxxx".into()),
            enable_hf_transfer: Some(false),
            insecure_tls: Some(false),
        };
        assert_eq!(config, expected);
        // Every documented key is known, and every known key is in the example.
        let documented: Vec<&str> = EXAMPLE
            .lines()
            .filter(|l| !l.starts_with(' '))
            .filter_map(|l| l.split(':').next())
            .collect();
        assert_eq!(documented, KNOWN_KEYS);
    }

    #[test]
    fn empty_documents_are_the_default_config() {
        for text in [
            "",
            "  \n",
            "# nothing here\n",
            "null",
            "~",
            "{}",
            "---\n",
            "---\n{}\n",
        ] {
            assert_eq!(
                parse_yaml(text).unwrap(),
                WorkerConfig::default(),
                "{text:?}"
            );
        }
    }

    #[test]
    fn null_values_mean_unset() {
        let config = parse_yaml("cache_dir:\nworker_port: null\nsystem_reserved: ~\n").unwrap();
        assert_eq!(config, WorkerConfig::default());
    }

    #[test]
    fn syntax_error_reports_line_and_column() {
        let issue = only_issue("debug: false\nworker_port: [1, 2\nproxy_mode: worker\n");
        assert_eq!(issue.key, "");
        assert!(issue.message.starts_with("invalid YAML"), "{issue:?}");
        assert!(issue.line.is_some() && issue.column.is_some(), "{issue:?}");
        assert!(!issue.message.contains('\n'));

        let issue = only_issue("debug: false\n  bad: indent\n");
        assert_eq!(issue.line, Some(2), "{issue:?}");

        // End of input is reported inside the text, at the end of the last line.
        let issue = only_issue("debug: true\nworker_port");
        assert_eq!((issue.line, issue.column), (Some(2), Some(12)), "{issue:?}");
    }

    #[test]
    fn duplicate_keys_are_rejected() {
        let issue = only_issue("debug: true\ndebug: false\n");
        assert!(issue.message.contains("duplicate"), "{issue:?}");
    }

    #[test]
    fn three_distinct_problems_give_three_issues() {
        let e = errors("worker_port: 0\nproxy_mode: sideways\nwokrer_ifname: en0\ndebug: true\n");
        assert_eq!(keys(&e), ["worker_port", "proxy_mode", "wokrer_ifname"]);
        let lines: Vec<_> = e.issues.iter().map(|i| i.line).collect();
        assert_eq!(lines, [Some(1), Some(2), Some(3)]);
        assert!(e.issues[2].message.contains("\"worker_ifname\""), "{e:?}");
    }

    #[test]
    fn top_level_must_be_a_mapping() {
        for text in ["- debug\n- true\n", "42", "\"debug\"", "!tag {}"] {
            let issue = only_issue(text);
            assert_eq!(issue.key, "", "{text:?}");
            assert!(issue.message.contains("must be a mapping"), "{issue:?}");
        }
    }

    #[test]
    fn ports_must_be_integers_in_range() {
        for ok in [1, 10150, 65535] {
            let config = parse_yaml(&format!("worker_port: {ok}")).unwrap();
            assert_eq!(config.worker_port, Some(ok));
        }
        for bad in [
            "0",
            "65536",
            "-1",
            "1.5",
            "\"10150\"",
            "[1]",
            "{a: 1}",
            "true",
        ] {
            let issue = only_issue(&format!("worker_metrics_port: {bad}"));
            assert_eq!(issue.key, "worker_metrics_port", "{bad}");
            assert!(issue.message.contains("port"), "{issue:?}");
        }
    }

    #[test]
    fn port_ranges_parse_and_validate() {
        let ok = [
            ("40000-40063", (40000, 40063)),
            (" 1 - 2 ", (1, 2)),
            ("5-5", (5, 5)),
            ("1-65535", (1, 65535)),
        ];
        for (text, (start, end)) in ok {
            assert_eq!(
                text.parse::<PortRange>(),
                Ok(PortRange { start, end }),
                "{text}"
            );
        }
        let bad = [
            "2-1",
            "0-10",
            "1-70000",
            "99999999999-1",
            "abc",
            "1-",
            "-5",
            "+1-2",
            "1-2-3",
            "1 2",
            "",
        ];
        for text in bad {
            assert!(text.parse::<PortRange>().is_err(), "{text:?}");
            let issue = only_issue(&format!("ray_port_range: {text:?}"));
            assert_eq!(issue.key, "ray_port_range");
        }
        let issue = only_issue("service_port_range: 40000");
        assert!(issue.message.contains("\"40000-40063\""), "{issue:?}");
        assert_eq!(
            PortRange::new(3, 2),
            Err("start 3 is greater than end 2".into())
        );
        let range = PortRange::new(10, 12).unwrap();
        assert_eq!(
            (range.len(), range.contains(11), range.contains(13)),
            (3, true, false)
        );
    }

    #[test]
    fn proxy_mode_is_case_insensitive_and_checked() {
        assert_eq!(
            parse_yaml("proxy_mode: Tunnel").unwrap().proxy_mode,
            Some(ProxyMode::Tunnel)
        );
        let issue = only_issue("proxy_mode: sideways");
        assert!(
            issue.message.contains("direct, worker, tunnel"),
            "{issue:?}"
        );
        assert_eq!(only_issue("proxy_mode: 3").key, "proxy_mode");
    }

    #[test]
    fn system_reserved_checks_each_entry() {
        let config = parse_yaml("system_reserved:\n  ram: 2\n  vram: 1.5\n").unwrap();
        let expected = SystemReserved {
            ram: Some(2.0),
            vram: Some(1.5),
        };
        assert_eq!(config.system_reserved, Some(expected));
        let partial = parse_yaml("system_reserved: {vram: 4}").unwrap();
        assert_eq!(partial.system_reserved.unwrap().ram, None);

        let e = errors("system_reserved:\n  ram: -1\n  vram: .nan\n  gpu: 1\n");
        assert_eq!(
            keys(&e),
            [
                "system_reserved.ram",
                "system_reserved.vram",
                "system_reserved.gpu"
            ]
        );
        assert!(e.issues[0].message.contains("negative"), "{e:?}");
        assert!(e.issues[2].message.contains("unknown"), "{e:?}");

        assert_eq!(only_issue("system_reserved: 5").key, "system_reserved");
        assert_eq!(
            only_issue("system_reserved: {ram: 2Gi}").key,
            "system_reserved.ram"
        );
        let zero = parse_yaml("system_reserved: {ram: -0.0}").unwrap();
        assert!(
            zero.system_reserved
                .unwrap()
                .ram
                .unwrap()
                .is_sign_positive()
        );
    }

    #[test]
    fn tools_url_needs_http_scheme_and_host() {
        for ok in [
            "https://mirror.example.com",
            "http://10.0.0.1:8080/tools",
            "HTTPS://X",
        ] {
            let config = parse_yaml(&format!("tools_download_base_url: {ok}")).unwrap();
            assert_eq!(config.tools_download_base_url.as_deref(), Some(ok));
        }
        for bad in [
            "ftp://mirror",
            "mirror.example.com",
            "https://",
            "\"https://a b\"",
            "1",
        ] {
            let issue = only_issue(&format!("tools_download_base_url: {bad}"));
            assert_eq!(issue.key, "tools_download_base_url", "{bad}");
        }
    }

    #[test]
    fn wrong_types_say_what_was_found() {
        let issue = only_issue("debug: yes");
        assert_eq!(issue.message, "expected true or false, got string \"yes\"");
        let issue = only_issue("huggingface_token: 12345");
        assert!(issue.message.contains("quote it"), "{issue:?}");
        let issue = only_issue("cache_dir: !custom /tmp");
        assert!(issue.message.contains("!custom"), "{issue:?}");
    }

    #[test]
    fn unknown_keys_suggest_the_closest_option() {
        let issue = only_issue("worker-port: 10150");
        assert_eq!(issue.key, "worker-port");
        assert_eq!(
            issue.message,
            "unknown option; did you mean \"worker_port\"?"
        );
        let issue = only_issue("Debug: true");
        assert!(issue.message.contains("\"debug\""), "{issue:?}");
        let issue = only_issue("completely_unrelated: 1");
        assert!(issue.message.contains("known options: debug,"), "{issue:?}");
        let issue = only_issue("system_reserved: {rma: 1}");
        assert!(issue.message.contains("\"ram\""), "{issue:?}");
        let issue = only_issue("1: x");
        assert_eq!(issue.key, "1");
    }

    #[test]
    fn positions_point_at_values_and_nested_keys() {
        let issue = only_issue("debug: false\nworker_port:   0   # comment\n");
        assert_eq!((issue.line, issue.column), (Some(2), Some(16)));

        let e = errors("# header\n\nsystem_reserved:\n  ram: -1\n  # note\n  gpu: 1\n");
        let positions: Vec<_> = e.issues.iter().map(|i| (i.line, i.column)).collect();
        assert_eq!(positions, [(Some(4), Some(8)), (Some(6), Some(3))]);

        // Flow style: the nearest enclosing key.
        let issue = only_issue("debug: true\nsystem_reserved: {ram: -1}\n");
        assert_eq!((issue.line, issue.column), (Some(2), Some(1)));

        // Quoted keys and a value on the next line (position of the key).
        let issue = only_issue("\"worker_port\": 0\n");
        assert_eq!((issue.line, issue.column), (Some(1), Some(16)));
        let issue = only_issue("'debug':\n  - 1\n");
        assert_eq!((issue.line, issue.column), (Some(1), Some(1)));

        // A whole document indented: still found.
        let issue = only_issue("  debug: true\n  bogus: 1\n");
        assert_eq!((issue.line, issue.column), (Some(2), Some(3)));

        // Block scalar contents that look like keys are not mistaken for them.
        let text = "huggingface_token: |\n  bogus: 1\nbogus: 2\n";
        let issue = only_issue(text);
        assert_eq!(issue.line, Some(3));
    }

    #[test]
    fn merge_keys_are_applied() {
        let config = parse_yaml("<<: {debug: true, worker_port: 1}\nworker_port: 2\n").unwrap();
        assert_eq!((config.debug, config.worker_port), (Some(true), Some(2)));
        assert_eq!(only_issue("<<: 5").key, "");
    }

    #[test]
    fn json_objects_follow_the_same_rules() {
        let e = from_json(&json!({
            "worker_port": 0,
            "proxy_mode": "x",
            "bogus": 1,
            "system_reserved": {"ram": -2}
        }))
        .unwrap_err();
        let mut found = keys(&e);
        found.sort_unstable();
        assert_eq!(
            found,
            ["bogus", "proxy_mode", "system_reserved.ram", "worker_port"]
        );
        assert!(
            e.issues
                .iter()
                .all(|i| i.line.is_none() && i.column.is_none())
        );

        assert_eq!(from_json(&json!(null)).unwrap(), WorkerConfig::default());
        assert_eq!(from_json(&json!([1])).unwrap_err().issues[0].key, "");
        let yaml = parse_yaml(EXAMPLE).unwrap();
        assert_eq!(from_json(&yaml.to_json()).unwrap(), yaml);
        let ram = from_json(&json!({"system_reserved": {"ram": 1.25}})).unwrap();
        assert_eq!(ram.system_reserved.unwrap().ram, Some(1.25));
    }

    #[test]
    fn api_values_may_be_yaml_text_or_an_object() {
        let from_text = from_api_value(&json!("worker_port: 1\n")).unwrap();
        let from_object = from_api_value(&json!({"worker_port": 1})).unwrap();
        assert_eq!(from_text, from_object);
        assert!(from_api_value(&json!("worker_port: 0")).is_err());
    }

    #[test]
    fn display_is_one_line_naming_every_key() {
        let e = errors("worker_port: 0\nsystem_reserved: {ram: -1}\n\"a\\nb\": 1\n");
        let text = e.to_string();
        assert!(!text.contains('\n'), "{text}");
        for key in ["worker_port", "system_reserved.ram", "a\\nb"] {
            assert!(text.contains(key), "{key} missing from {text}");
        }
        assert!(errors("[").to_string().contains("(document)"));
    }

    #[test]
    fn issues_serialize_without_unknown_positions() {
        let e = from_json(&json!({"bogus": true})).unwrap_err();
        let value = serde_json::to_value(&e).unwrap();
        assert_eq!(value["issues"][0]["key"], "bogus");
        assert!(value["issues"][0].get("line").is_none());
        let e = errors("bogus: true");
        let value = serde_json::to_value(&e).unwrap();
        assert_eq!(
            (
                value["issues"][0]["line"].clone(),
                value["issues"][0]["column"].clone()
            ),
            (json!(1), json!(1))
        );
    }

    #[test]
    fn serialized_forms_match_what_operators_write() {
        let config = parse_yaml(EXAMPLE).unwrap();
        let value = config.to_json();
        assert_eq!(value["service_port_range"], "40000-40063");
        assert_eq!(value["system_reserved"], json!({"ram": 0, "vram": 0}));
        assert_eq!(value["proxy_mode"], "worker");
        let yaml = config.to_yaml();
        assert!(yaml.contains("service_port_range: 40000-40063\n"), "{yaml}");
        assert!(yaml.contains("  ram: 0\n"), "{yaml}");
        assert_eq!(parse_yaml(&yaml).unwrap(), config);
        assert_eq!(WorkerConfig::default().to_json(), json!({}));
        assert_eq!(
            parse_yaml(&WorkerConfig::default().to_yaml()).unwrap(),
            WorkerConfig::default()
        );
    }

    #[test]
    fn deserialize_runs_validation() {
        let ok: WorkerConfig = serde_yaml_ng::from_str(EXAMPLE).unwrap();
        assert_eq!(ok, parse_yaml(EXAMPLE).unwrap());
        let err = serde_json::from_value::<WorkerConfig>(json!({"worker_port": 0})).unwrap_err();
        assert!(err.to_string().contains("worker_port"), "{err}");
        let range: PortRange = serde_json::from_value(json!("1-2")).unwrap();
        assert_eq!(range, PortRange { start: 1, end: 2 });
    }

    #[test]
    fn overlay_prefers_the_higher_layer() {
        let cluster =
            parse_yaml("worker_port: 1\ndebug: true\nsystem_reserved: {ram: 1, vram: 1}").unwrap();
        let local = parse_yaml("worker_port: 2\nsystem_reserved: {ram: 4}").unwrap();
        let flags = WorkerConfig {
            proxy_mode: Some(ProxyMode::Tunnel),
            ..WorkerConfig::default()
        };
        let effective = WorkerConfig::builtin_defaults()
            .overlay(&cluster)
            .overlay(&local)
            .overlay(&flags);
        assert_eq!(effective.worker_port, Some(2));
        assert_eq!(effective.debug, Some(true));
        assert_eq!(effective.proxy_mode, Some(ProxyMode::Tunnel));
        assert_eq!(
            effective.worker_metrics_port,
            Some(DEFAULT_WORKER_METRICS_PORT)
        );
        // Options replace whole: vram is not inherited from the cluster's mapping.
        assert_eq!(
            effective.system_reserved,
            Some(SystemReserved {
                ram: Some(4.0),
                vram: None
            })
        );
    }

    #[test]
    fn builtin_defaults_are_a_valid_document() {
        let defaults = WorkerConfig::builtin_defaults();
        assert_eq!(parse_yaml(&defaults.to_yaml()).unwrap(), defaults);
    }

    #[test]
    fn deep_values_are_reported_not_walked() {
        let mut deep = json!(1);
        for _ in 0..1000 {
            deep = json!({ "x": deep });
        }
        let e = from_json(&json!({"system_reserved": {"ram": deep.clone()}, "debug": deep}))
            .unwrap_err();
        assert_eq!(keys(&e), ["debug", "system_reserved.ram"]);
        assert!(
            e.issues
                .iter()
                .all(|i| i.message.ends_with("got a mapping")),
            "{e:?}"
        );
    }

    #[test]
    fn keys_starting_with_indicator_characters_are_located() {
        let issue = only_issue("debug: true\n-odd: 1\n");
        assert_eq!((issue.key.as_str(), issue.line), ("-odd", Some(2)));
    }

    #[test]
    fn edit_distance_basics() {
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("ram", "ram"), 0);
        assert_eq!(closest_known("vrma", SYSTEM_RESERVED_KEYS), Some("vram"));
        assert_eq!(closest_known("xy", SYSTEM_RESERVED_KEYS), None);
    }

    // ------------------------------------------------------------------ property tests

    fn arb_text() -> impl Strategy<Value = String> {
        let fragment = prop_oneof![
            prop::sample::select(KNOWN_KEYS).prop_map(str::to_owned),
            prop::sample::select(vec![
                ": ",
                ":",
                "\n",
                "\n  ",
                "- ",
                "{",
                "}",
                "[",
                "]",
                ",",
                "\"",
                "'",
                "#",
                "&a ",
                "*a",
                "!t ",
                "<<: ",
                "|\n",
                ">\n",
                "---\n",
                "~",
                "null",
                "0",
                "-1",
                "1.5",
                "40000-40063",
                "ram",
                "vram",
                "\t",
                "\\",
                "\u{feff}",
                "é",
            ])
            .prop_map(str::to_owned),
            "\\PC{0,6}",
        ];
        prop::collection::vec(fragment, 0..40).prop_map(|parts| parts.concat())
    }

    fn arb_scalar() -> impl Strategy<Value = serde_json::Value> {
        prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            (-70_000i64..70_000).prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            (-1e6f64..1e6).prop_map(serde_json::Value::from),
            prop::sample::select(vec![
                "40000-40063",
                "2-1",
                "worker",
                "TUNNEL",
                "https://m.example",
                "ftp://x",
                "",
            ])
            .prop_map(serde_json::Value::from),
            "\\PC{0,12}".prop_map(serde_json::Value::from),
        ]
    }

    fn arb_value() -> impl Strategy<Value = serde_json::Value> {
        prop_oneof![
            4 => arb_scalar(),
            1 => prop::collection::vec(arb_scalar(), 0..3).prop_map(serde_json::Value::from),
            1 => prop::collection::btree_map(arb_key(), arb_scalar(), 0..4)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    }

    fn arb_key() -> impl Strategy<Value = String> {
        prop_oneof![
            prop::sample::select(KNOWN_KEYS).prop_map(str::to_owned),
            prop::sample::select(SYSTEM_RESERVED_KEYS).prop_map(str::to_owned),
            "[a-z_]{1,16}",
            "[a-z_.-]{1,16}",
            // `<<` is YAML's merge key, resolved by the parser before validation.
            "\\PC{1,8}".prop_filter("the merge key is not an option", |k| k != "<<"),
        ]
    }

    fn arb_port_range() -> impl Strategy<Value = PortRange> {
        (1u16..=65535, 1u16..=65535).prop_map(|(a, b)| PortRange {
            start: a.min(b),
            end: a.max(b),
        })
    }

    fn arb_gib() -> impl Strategy<Value = f64> {
        prop_oneof![(0u32..4096).prop_map(f64::from), 0.0f64..1e9]
    }

    fn arb_config() -> impl Strategy<Value = WorkerConfig> {
        let text = || proptest::option::of(".{0,30}");
        let port = || proptest::option::of(1u16..=65535);
        let flag = || proptest::option::of(any::<bool>());
        let url = proptest::option::of("https?://[a-z0-9.:/_-]{1,20}");
        let reserved = proptest::option::of(
            (
                proptest::option::of(arb_gib()),
                proptest::option::of(arb_gib()),
            )
                .prop_map(|(ram, vram)| SystemReserved { ram, vram }),
        );
        let mode = proptest::option::of(prop::sample::select(ProxyMode::ALL));
        (
            (flag(), url, text(), text(), text(), text(), text()),
            (text(), text(), port(), port(), flag()),
            (
                proptest::option::of(arb_port_range()),
                proptest::option::of(arb_port_range()),
            ),
            (mode, reserved, text(), flag(), flag()),
        )
            .prop_map(|(a, b, c, d)| WorkerConfig {
                debug: a.0,
                tools_download_base_url: a.1,
                pipx_path: a.2,
                cache_dir: a.3,
                log_dir: a.4,
                bin_dir: a.5,
                image_name_override: a.6,
                image_repo: b.0,
                worker_ifname: b.1,
                worker_port: b.2,
                worker_metrics_port: b.3,
                disable_worker_metrics: b.4,
                service_port_range: c.0,
                ray_port_range: c.1,
                proxy_mode: d.0,
                system_reserved: d.1,
                huggingface_token: d.2,
                enable_hf_transfer: d.3,
                insecure_tls: d.4,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn arbitrary_text_never_panics(text in arb_text()) {
            match parse_yaml(&text) {
                Ok(config) => prop_assert_eq!(parse_yaml(&config.to_yaml()).ok(), Some(config)),
                Err(e) => {
                    prop_assert!(!e.issues.is_empty());
                    let line_count = text.split('\n').count();
                    for issue in &e.issues {
                        prop_assert!(issue.line.is_none_or(|l| (1..=line_count).contains(&l)));
                        prop_assert!(issue.column.is_none_or(|c| c >= 1));
                    }
                    prop_assert!(!e.to_string().contains('\n'));
                }
            }
        }

        #[test]
        fn arbitrary_unicode_never_panics(text in any::<String>()) {
            let _ = parse_yaml(&text);
            let _ = from_api_value(&serde_json::Value::String(text));
        }

        #[test]
        fn every_unknown_key_is_named(
            entries in prop::collection::btree_map(arb_key(), arb_value(), 0..12)
        ) {
            let object = serde_json::Value::Object(entries.clone().into_iter().collect());
            let text = serde_yaml_ng::to_string(&object).unwrap();
            let unknown: Vec<&String> =
                entries.keys().filter(|k| !KNOWN_KEYS.contains(&k.as_str())).collect();
            for result in [parse_yaml(&text), from_json(&object)] {
                match result {
                    Ok(_) => prop_assert!(unknown.is_empty(), "accepted {:?}", unknown),
                    Err(e) => {
                        for key in &unknown {
                            let issue = e.issues.iter().find(|i| &&i.key == key);
                            prop_assert!(issue.is_some(), "{:?} not reported in {:?}", key, e);
                        }
                    }
                }
            }
            // Plain keys written by the serializer are located on their own line.
            if let Err(e) = parse_yaml(&text) {
                let lines: Vec<&str> = text.lines().collect();
                for issue in e.issues.iter().filter(|i| unknown.contains(&&i.key)) {
                    if issue.key.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                        let line = issue.line.unwrap_or(0);
                        prop_assert!(line >= 1, "{:?} in {}", issue, text);
                        prop_assert!(lines[line - 1].contains(&issue.key), "{:?} in {}", issue, text);
                    }
                }
            }
        }

        #[test]
        fn valid_configs_round_trip(config in arb_config()) {
            let yaml = config.to_yaml();
            prop_assert_eq!(parse_yaml(&yaml), Ok(config.clone()), "yaml:\n{}", yaml);
            prop_assert_eq!(from_json(&config.to_json()), Ok(config.clone()));
            prop_assert_eq!(from_api_value(&serde_json::Value::String(yaml)), Ok(config));
        }

        #[test]
        fn overlay_is_per_option_precedence(lower in arb_config(), higher in arb_config()) {
            let merged = lower.overlay(&higher).to_json();
            let mut expected = lower.to_json();
            if let (Some(target), Some(source)) =
                (expected.as_object_mut(), higher.to_json().as_object())
            {
                for (key, value) in source {
                    target.insert(key.clone(), value.clone());
                }
            }
            prop_assert_eq!(merged, expected);
            prop_assert_eq!(lower.overlay(&WorkerConfig::default()), lower.clone());
            prop_assert_eq!(WorkerConfig::default().overlay(&lower), lower);
        }
    }
}
