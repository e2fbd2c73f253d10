//! The rules: every option of a document checked, every problem collected.

use super::node::{Node, truncate};
use super::port_range::PortRange;
use super::suggest::closest_known;
use super::{KNOWN_KEYS, SYSTEM_RESERVED_KEYS, SystemReserved, WorkerConfig};
use control_client::model::ProxyMode;

/// A problem found by validation, before it is positioned in the source text.
#[derive(Debug)]
pub(super) struct Problem {
    /// Key segments (kept apart because unknown keys may themselves contain dots).
    pub(super) path: Vec<String>,
    pub(super) message: String,
    pub(super) at: Target,
}

/// Whether a problem is about the key itself (unknown key) or about its value.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub(super) enum Target {
    Key,
    Value,
}

/// Validates a whole document, collecting every problem.
pub(super) fn validate(root: &Node) -> Result<WorkerConfig, Vec<Problem>> {
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
