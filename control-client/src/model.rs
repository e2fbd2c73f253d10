//! Wire types of the management API.
//!
//! Field names follow GPUStack's `/v2` API so that the same types read objects served by a real
//! GPUStack server (see `shared/gpustack-samples/`). Read types are therefore lenient: unknown
//! fields are ignored and enums carry an `Other` variant for states faden does not drive. The
//! API's input types (in `api::*`) are strict instead: they reject unknown fields.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Default worker reverse-proxy port (GPUStack's `worker_port`).
pub const DEFAULT_WORKER_PORT: u16 = 10150;
/// Default worker metrics port (GPUStack's `worker_metrics_port`).
pub const DEFAULT_WORKER_METRICS_PORT: u16 = 10151;

/// A UTC timestamp that also reads GPUStack's timestamps without a zone suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub DateTime<Utc>);

impl Timestamp {
    /// The current time.
    pub fn now() -> Self {
        Self(Utc::now())
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        parse_timestamp(&text)
            .map(Timestamp)
            .ok_or_else(|| serde::de::Error::custom(format!("invalid timestamp {text:?}")))
    }
}

fn parse_timestamp(text: &str) -> Option<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Some(t.with_timezone(&Utc));
    }
    // GPUStack sometimes sends naive timestamps (no `Z`); they are UTC.
    for fmt in ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%d %H:%M:%S%.f"] {
        if let Ok(t) = NaiveDateTime::parse_from_str(text, fmt) {
            return Some(t.and_utc());
        }
    }
    None
}

macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The wire spelling.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text,)+ }
            }

            /// Parses the wire spelling, ignoring ASCII case (GPUStack capitalises some values).
            pub fn parse(text: &str) -> Option<Self> {
                $(if text.eq_ignore_ascii_case($text) { return Some($name::$variant); })+
                None
            }

            fn expected() -> String {
                [$($text),+].join(", ")
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                $name::parse(&text).ok_or_else(|| {
                    serde::de::Error::custom(format!(
                        "unknown value {text:?}, expected one of: {}",
                        $name::expected()
                    ))
                })
            }
        }
    };
}

string_enum! {
    /// Where a cluster's workers come from.
    Provider {
        Docker = "docker",
        Kubernetes = "kubernetes",
        DigitalOcean = "digitalocean",
        /// SHUIHUA FUTURE cloud: workers behind NAT, registry must not be Docker Hub.
        Shuihua = "shuihua",
    }
}

string_enum! {
    /// How the data plane reaches a worker's instances (`proxy_mode`).
    ProxyMode {
        /// Straight to `<advertise_address|ip>:<instance port>`.
        Direct = "direct",
        /// Through the worker's reverse proxy on its worker port.
        Worker = "worker",
        /// Through the server's proxy port and the worker's outbound tunnel.
        Tunnel = "tunnel",
    }
}

string_enum! {
    /// How the gateway picks among a model's instances (`route_policy`; see the gateway's
    /// `policy` module).
    RoutePolicy {
        /// The instance holding the longest prefix of the prompt while its load stays under a
        /// bound; otherwise where the request waits least.
        CacheAware = "cache_aware",
        /// Power of two choices on requests in flight.
        LeastLoaded = "least_loaded",
    }
}

string_enum! {
    /// Scope of an API key.
    Scope {
        /// OpenAI-compatible inference only.
        Inference = "inference",
        /// The management API only.
        Management = "management",
        /// Inference and management.
        All = "all",
        /// Data-plane components (gateways, proxy port): read routing state and key digests.
        DataPlane = "data_plane",
    }
}

impl Scope {
    /// Whether this scope may call the inference API.
    pub fn allows_inference(self) -> bool {
        matches!(self, Scope::Inference | Scope::All)
    }

    /// Whether this scope may use the management API as an administrator.
    pub fn is_admin(self) -> bool {
        matches!(self, Scope::Management | Scope::All)
    }
}

/// Reads a scope as faden writes it (`"inference"`) or as GPUStack does (`["*"]`).
fn deserialize_scope<'de, D: Deserializer<'de>>(d: D) -> Result<Scope, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        One(String),
        Many(Vec<String>),
    }
    let parse = |s: &str| match s {
        "*" => Some(Scope::All),
        other => Scope::parse(other),
    };
    match Raw::deserialize(d)? {
        Raw::One(s) => parse(&s),
        // GPUStack lists permissions; a wildcard or several entries mean the widest scope.
        Raw::Many(list) if list.len() == 1 => parse(&list[0]),
        Raw::Many(list) if list.is_empty() => Some(Scope::Inference),
        Raw::Many(_) => Some(Scope::All),
    }
    .ok_or_else(|| serde::de::Error::custom("unknown API key scope"))
}

macro_rules! state_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant,)+
            /// A state faden does not drive (GPUStack has more).
            #[serde(other, rename = "unknown")]
            Other,
        }

        impl $name {
            /// The wire spelling.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text,)+ $name::Other => "unknown" }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

state_enum! {
    /// Liveness of a worker.
    WorkerState {
        NotReady = "not_ready",
        Ready = "ready",
        Unreachable = "unreachable",
    }
}

state_enum! {
    /// Lifecycle of a model instance. Only `running` instances receive traffic.
    InstanceState {
        Pending = "pending",
        /// GPUStack's scheduler and worker states before `starting`.
        Analyzing = "analyzing",
        Scheduled = "scheduled",
        Initializing = "initializing",
        Downloading = "downloading",
        Starting = "starting",
        Running = "running",
        /// Finishing in-flight requests; takes no new ones.
        Draining = "draining",
        Error = "error",
        Unreachable = "unreachable",
    }
}

/// Options for Kubernetes clusters. `helmValues` is merged over the derived chart values.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct K8sOptions {
    /// Chart value overrides, merged per key over what the server derives.
    #[serde(
        rename = "helmValues",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub helm_values: Option<serde_json::Value>,
    /// Every other option, kept as given.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

/// A cluster: a group of workers with a shared configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub id: i64,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default = "default_provider")]
    pub provider: Provider,
    #[serde(default = "default_cluster_state")]
    pub state: String,
    /// Only shown to administrators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registration_token: Option<String>,
    /// The validated worker configuration, as an object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_config: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_container_registry: Option<String>,
    #[serde(
        rename = "k8sOptions",
        alias = "k8s_options",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub k8s_options: Option<K8sOptions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Timestamp>,
}

fn default_provider() -> Provider {
    Provider::Docker
}

fn default_cluster_state() -> String {
    "ready".to_owned()
}

/// A machine that runs model instances.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Worker {
    pub id: i64,
    pub name: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    pub cluster_id: i64,
    #[serde(default)]
    pub hostname: String,
    #[serde(default)]
    pub ip: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ifname: Option<String>,
    #[serde(default)]
    pub advertise_address: Option<String>,
    #[serde(default = "default_worker_port")]
    pub port: u16,
    #[serde(default)]
    pub metrics_port: MetricsPort,
    #[serde(default)]
    pub worker_uuid: String,
    pub state: WorkerState,
    #[serde(default)]
    pub state_message: Option<String>,
    #[serde(default)]
    pub heartbeat_time: Option<Timestamp>,
    #[serde(default = "default_proxy_mode")]
    pub proxy_mode: ProxyMode,
    /// Set by the tunnel server while this worker's tunnel is up.
    #[serde(default)]
    pub proxy_address: Option<String>,
    /// GPUStack's maintenance mode, which faden's drain sets: while enabled, gateways send
    /// new requests to this worker's instances only for models no other worker serves. Read
    /// leniently: a shape faden does not know is no maintenance, never an unreadable worker.
    #[serde(default, deserialize_with = "lenient_maintenance")]
    pub maintenance: Option<Box<Maintenance>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Timestamp>,
}

/// A worker's maintenance (GPUStack 2.3's `maintenance`: `enabled` and `message`), with what
/// faden's drain adds to it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Maintenance {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default)]
    pub message: Option<String>,
    /// Who started the drain: `worker` (a worker stopping itself, ended when it starts
    /// again) or `admin` (`POST /v2/workers/{id}/drain`, ended only by an administrator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_by: Option<String>,
    /// When the drain started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Timestamp>,
    /// When a drain that has not finished reports what did not move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Timestamp>,
    /// Requests (or relayed connections) the worker last reported in flight while draining.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<u64>,
}

fn lenient_maintenance<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Box<Maintenance>>, D::Error> {
    let value = Option::<serde_json::Value>::deserialize(d)?;
    Ok(value.and_then(|v| serde_json::from_value(v).ok()))
}

/// [`Maintenance::requested_by`] of a worker that drains itself as it stops.
pub const DRAIN_BY_WORKER: &str = "worker";
/// [`Maintenance::requested_by`] of a drain asked through the API.
pub const DRAIN_BY_ADMIN: &str = "admin";

impl Worker {
    /// Whether the worker is draining (in maintenance): its instances take new requests only
    /// where no other instance of their model is routable.
    pub fn is_draining(&self) -> bool {
        self.maintenance.as_ref().is_some_and(|m| m.enabled)
    }

    /// The address the data plane dials: `advertise_address` when set, else `ip`.
    pub fn address(&self) -> &str {
        match self.advertise_address.as_deref() {
            Some(a) if !a.is_empty() => a,
            _ => &self.ip,
        }
    }
}

fn default_worker_port() -> u16 {
    DEFAULT_WORKER_PORT
}

fn default_proxy_mode() -> ProxyMode {
    ProxyMode::Worker
}

/// A worker's metrics port, as GPUStack writes it: the port, or `-1` when the worker serves no
/// metrics (`--disable-worker-metrics`). `null` reads as the default port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricsPort {
    /// Metrics are served on this port.
    Port(u16),
    /// The worker serves no metrics.
    Disabled,
}

impl Default for MetricsPort {
    fn default() -> Self {
        Self::Port(DEFAULT_WORKER_METRICS_PORT)
    }
}

impl Serialize for MetricsPort {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Port(p) => s.serialize_u16(*p),
            Self::Disabled => s.serialize_i8(-1),
        }
    }
}

impl<'de> Deserialize<'de> for MetricsPort {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Option::<i64>::deserialize(d)? {
            None => Ok(Self::default()),
            Some(-1) => Ok(Self::Disabled),
            Some(p) => match u16::try_from(p) {
                Ok(p) if p != 0 => Ok(Self::Port(p)),
                _ => Err(serde::de::Error::custom(format!(
                    "metrics_port {p} is neither a port (1-65535) nor -1 (no metrics)"
                ))),
            },
        }
    }
}

/// A model: the name clients send as `model`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Model {
    pub id: i64,
    pub name: String,
    #[serde(default)]
    pub cluster_id: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<u32>,
    /// How gateways route its requests; unset: the gateway's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route_policy: Option<RoutePolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Timestamp>,
}

/// One running copy of a model on a worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelInstance {
    pub id: i64,
    #[serde(default)]
    pub name: String,
    pub model_id: i64,
    #[serde(default)]
    pub model_name: Option<String>,
    #[serde(default)]
    pub worker_id: Option<i64>,
    #[serde(default)]
    pub port: Option<u16>,
    pub state: InstanceState,
    #[serde(default)]
    pub state_message: Option<String>,
    #[serde(default)]
    pub cluster_id: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Timestamp>,
}

/// An API key as listed: never the secret.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ApiKey {
    pub id: i64,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(deserialize_with = "deserialize_scope")]
    pub scope: Scope,
    #[serde(default)]
    pub expires_at: Option<Timestamp>,
    /// The public part of the key (`<prefix>_<access-id>_…`).
    #[serde(default)]
    pub access_id: Option<String>,
    /// The whole key: present only in the answer that created it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Timestamp>,
}

/// What a data-plane component needs to verify a key locally: never the secret itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credential {
    /// The API key's id.
    pub id: i64,
    /// The key's public access id.
    pub access_id: String,
    /// Lower-case hex SHA-256 of the key's secret part.
    pub secret_digest: String,
    pub scope: Scope,
    #[serde(default)]
    pub expires_at: Option<Timestamp>,
}

/// `pagination` of a list answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pagination {
    pub page: i64,
    pub per_page: i64,
    pub total: u64,
    pub total_page: u64,
}

/// A list answer: `{"items": [...], "pagination": {...}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ListResponse<T> {
    pub items: Vec<T>,
    pub pagination: Pagination,
}

/// Kind of change in a watch event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventType {
    Created,
    Updated,
    Deleted,
}

impl EventType {
    /// GPUStack's numeric code.
    pub fn code(self) -> u8 {
        match self {
            EventType::Created => 1,
            EventType::Updated => 2,
            EventType::Deleted => 3,
        }
    }

    /// From GPUStack's numeric code.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(EventType::Created),
            2 => Some(EventType::Updated),
            3 => Some(EventType::Deleted),
            _ => None,
        }
    }
}

impl Serialize for EventType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(self.code())
    }
}

impl<'de> Deserialize<'de> for EventType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let code = u8::deserialize(d)?;
        EventType::from_code(code)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown event type {code}")))
    }
}

/// One watch event. `revision` is faden's addition (absent from GPUStack's streams).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WatchEvent<T> {
    #[serde(rename = "type")]
    pub kind: EventType,
    pub data: T,
    /// The object's id.
    #[serde(default)]
    pub id: Option<i64>,
    /// Store revision that produced this event (monotonic across all resources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed_fields: Option<serde_json::Value>,
}

/// Response header carrying the store revision of a list answer, for `?watch=true&since=`.
pub const REVISION_HEADER: &str = "x-faden-revision";
/// Response header of a watch stream: `resumed` when `since` was honoured, `snapshot` when the
/// stream starts with a full snapshot (the client must drop what it had).
pub const WATCH_MODE_HEADER: &str = "x-faden-watch";
