//! `faden gateway` and the gateway options shared with `faden server` and `faden up`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use control_client::engine_load::EngineLoads;
use control_client::sync::{self, SyncConfig, SyncHandle};
use std::collections::HashMap;
use std::path::PathBuf;

use gateway::{
    Gateway, GatewayConfig, ListenerConfig, ServerTlsConfig, Timeouts, UpstreamTls,
    UpstreamTlsConfig,
};
use tokio_util::sync::CancellationToken;

/// Default gateway port: unprivileged (GPUStack's gateway uses 80).
pub const DEFAULT_GATEWAY_PORT: u16 = 8080;

/// Options of the OpenAI-compatible gateway.
#[derive(Debug, Args, Clone)]
pub struct GatewayArgs {
    /// Gateway port (OpenAI-compatible API). 0 picks a free port.
    #[arg(long = "port", env = "FADEN_PORT", default_value_t = DEFAULT_GATEWAY_PORT)]
    pub port: u16,
    /// Largest request body accepted by the gateway (larger: 413).
    #[arg(long, env = "FADEN_MAX_BODY_SIZE", default_value = "64MiB", value_parser = parse_size)]
    pub max_body_size: usize,
    /// Upstream TCP connect timeout.
    #[arg(long, env = "FADEN_CONNECT_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub connect_timeout: Duration,
    /// Time from sending a request upstream to the first body byte (a non-streamed answer is
    /// the whole generation, so keep it long).
    #[arg(long, env = "FADEN_FIRST_BYTE_TIMEOUT", default_value = "1800s", value_parser = humantime::parse_duration)]
    pub first_byte_timeout: Duration,
    /// Longest pause between two chunks of an upstream answer.
    #[arg(long, env = "FADEN_IDLE_TIMEOUT", default_value = "300s", value_parser = humantime::parse_duration)]
    pub idle_timeout: Duration,
    /// Longest total request time (GPUStack: 1800 s).
    #[arg(long, env = "FADEN_REQUEST_TIMEOUT", default_value = "1800s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
    /// Time a client has to send its request head.
    #[arg(long, env = "FADEN_HEADER_READ_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub header_read_timeout: Duration,
    /// A client that reads nothing of its answer for this long (its socket stays full) is
    /// disconnected, which cancels its upstream request and frees the engine's slot.
    #[arg(long, env = "FADEN_CLIENT_WRITE_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub client_write_timeout: Duration,
    /// Most client connections to the gateway at once.
    #[arg(long, env = "FADEN_GATEWAY_MAX_CONNECTIONS", default_value_t = 16_384)]
    pub gateway_max_connections: usize,
    /// `/readyz` fails when the routing snapshot is older than this.
    #[arg(long, env = "FADEN_MAX_STALENESS", default_value = "60s", value_parser = humantime::parse_duration)]
    pub max_staleness: Duration,
    /// Credential presented to worker reverse proxies (`worker` and `tunnel` paths).
    #[arg(long, env = "FADEN_WORKER_CREDENTIAL", hide_env_values = true)]
    pub worker_credential: Option<String>,
    /// Serve the gateway over TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "FADEN_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "FADEN_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates chaining to this CA bundle (PEM); needs --tls-cert.
    #[arg(long, env = "FADEN_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Upstream (mutual) TLS per cluster and worker: a YAML file with `default`, `clusters`
    /// and `workers` entries of `{ca_bundle, client_cert, client_key, server_name}`
    /// (see docs/security.md).
    #[arg(long, env = "FADEN_UPSTREAM_TLS_CONFIG")]
    pub upstream_tls_config: Option<PathBuf>,
    #[command(flatten)]
    pub limits: crate::limits::LimitArgs,
    /// Add `stream_options.include_usage` to streamed chat and text completion requests that
    /// set no `stream_options`, so that `faden_tokens_total` counts their tokens too (clients
    /// then also receive the engine's usage-only last chunk). Usage that answers carry anyway is
    /// always counted.
    #[arg(long, env = "FADEN_COUNT_TOKENS")]
    pub count_tokens: bool,
    /// How an instance of a model is chosen, for models that set no `route_policy`:
    /// `cache-aware` (the instance holding the longest prefix of the prompt while its load
    /// stays under the bound, else where the request waits least; see docs/routing.md) or
    /// `least-loaded` (power of two choices on requests in flight).
    #[arg(long, env = "FADEN_ROUTE_POLICY", default_value = "cache-aware", value_parser = parse_route_policy)]
    pub route_policy: control_client::model::RoutePolicy,
    /// `cache-aware`: an instance takes new requests while its requests in flight stay below
    /// this many times the mean over the model's instances (or --route-load-slack above the
    /// mean, whichever is more), plus one.
    #[arg(long, env = "FADEN_ROUTE_LOAD_FACTOR", default_value_t = 1.5)]
    pub route_load_factor: f64,
    /// `cache-aware`: requests in flight an instance may have above the mean before it stops
    /// taking new ones, whatever --route-load-factor allows (the bound is the larger of the
    /// two, plus one).
    #[arg(long, env = "FADEN_ROUTE_LOAD_SLACK", default_value_t = 8.0)]
    pub route_load_slack: f64,
    /// Export a span per inference request over OTLP (http/protobuf) to this collector, e.g.
    /// http://collector:4318 (`/v1/traces` is appended). Without it, the standard
    /// OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT turns exporting on
    /// (see docs/observability.md).
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

/// Longest wait at shutdown for the last spans to reach the collector.
const SPAN_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// A routing policy as the API spells it (`cache_aware`) or with dashes.
fn parse_route_policy(text: &str) -> Result<control_client::model::RoutePolicy, String> {
    control_client::model::RoutePolicy::parse(&text.replace('-', "_"))
        .ok_or_else(|| format!("unknown routing policy {text:?}: use cache-aware or least-loaded"))
}

/// The `--upstream-tls-config` file.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct UpstreamTlsFile {
    #[serde(default)]
    default: Option<UpstreamTlsEntry>,
    #[serde(default)]
    clusters: HashMap<i64, UpstreamTlsEntry>,
    #[serde(default)]
    workers: HashMap<i64, UpstreamTlsEntry>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct UpstreamTlsEntry {
    ca_bundle: PathBuf,
    #[serde(default)]
    client_cert: Option<PathBuf>,
    #[serde(default)]
    client_key: Option<PathBuf>,
    #[serde(default)]
    server_name: Option<String>,
}

impl From<UpstreamTlsEntry> for UpstreamTls {
    fn from(e: UpstreamTlsEntry) -> Self {
        UpstreamTls {
            ca_bundle: e.ca_bundle,
            client_cert: e.client_cert,
            client_key: e.client_key,
            server_name: e.server_name,
        }
    }
}

fn read_upstream_tls(path: &std::path::Path) -> anyhow::Result<UpstreamTlsConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file: UpstreamTlsFile = serde_yaml_ng::from_str(&text)
        .with_context(|| format!("{}: invalid upstream TLS configuration", path.display()))?;
    Ok(UpstreamTlsConfig {
        default: file.default.map(Into::into),
        by_cluster: file
            .clusters
            .into_iter()
            .map(|(k, v)| (k, v.into()))
            .collect(),
        by_worker: file
            .workers
            .into_iter()
            .map(|(k, v)| (k, v.into()))
            .collect(),
    })
}

impl GatewayArgs {
    /// The span exporter, when --otlp-endpoint or the OTEL_* variables ask for one (started on
    /// the current runtime).
    pub fn telemetry(&self) -> anyhow::Result<Option<gateway::telemetry::Telemetry>> {
        gateway::telemetry::TelemetryConfig::from_env(self.otlp_endpoint.clone())
            .map(gateway::telemetry::Telemetry::start)
            .transpose()
            .context("OpenTelemetry exporter")
    }

    /// The gateway configuration, with every problem reported at once.
    pub fn to_config(&self, drain: Duration) -> anyhow::Result<GatewayConfig> {
        bail_on(self.problems())?;
        self.build(drain)
    }

    /// What is wrong with the flags, one line per problem.
    fn problems(&self) -> Vec<String> {
        let mut problems = zero_durations([
            ("--connect-timeout", self.connect_timeout),
            ("--first-byte-timeout", self.first_byte_timeout),
            ("--idle-timeout", self.idle_timeout),
            ("--request-timeout", self.request_timeout),
            ("--header-read-timeout", self.header_read_timeout),
            ("--client-write-timeout", self.client_write_timeout),
        ]);
        if self.max_body_size == 0 {
            problems.push("--max-body-size must be more than 0".to_owned());
        }
        if self.gateway_max_connections == 0 {
            problems.push("--gateway-max-connections must be at least 1".to_owned());
        }
        problems.extend(self.limits.problems());
        if !(self.route_load_factor.is_finite() && self.route_load_factor >= 1.0) {
            problems.push(format!(
                "--route-load-factor must be at least 1 (got {})",
                self.route_load_factor
            ));
        }
        if !(self.route_load_slack.is_finite() && self.route_load_slack >= 0.0) {
            problems.push(format!(
                "--route-load-slack must be 0 or more (got {})",
                self.route_load_slack
            ));
        }
        if self
            .worker_credential
            .as_deref()
            .is_some_and(|c| c.trim().is_empty())
        {
            problems.push("--worker-credential must not be empty".to_owned());
        }
        problems
    }

    /// The configuration from flags that passed [`GatewayArgs::problems`].
    fn build(&self, drain: Duration) -> anyhow::Result<GatewayConfig> {
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(ServerTlsConfig {
                cert_chain: cert.clone(),
                private_key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            }),
            _ => None,
        };
        let upstream_tls = match &self.upstream_tls_config {
            Some(path) => read_upstream_tls(path)?,
            None => UpstreamTlsConfig::default(),
        };
        Ok(GatewayConfig {
            listener: ListenerConfig {
                header_read_timeout: self.header_read_timeout,
                write_stall_timeout: Some(self.client_write_timeout),
                max_connections: self.gateway_max_connections,
                drain_timeout: drain,
                pending: self.limits.pending(),
                auth: self.limits.auth(),
                ..ListenerConfig::default()
            },
            timeouts: Timeouts {
                connect: self.connect_timeout,
                first_byte: self.first_byte_timeout,
                idle: self.idle_timeout,
                total: self.request_timeout,
                ..Timeouts::default()
            },
            max_body_bytes: self.max_body_size,
            worker_credential: self.worker_credential.clone(),
            max_snapshot_staleness: Some(self.max_staleness),
            tls,
            upstream_tls,
            count_tokens: self.count_tokens,
            routing: gateway::policy::PolicyConfig {
                default: self.route_policy,
                load_factor: self.route_load_factor,
                load_slack: self.route_load_slack,
            },
            ..GatewayConfig::default()
        })
    }
}

/// Parses sizes like `64MiB`, `512KiB`, `1000000`.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 64MiB"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("unknown size unit {other:?} (use KiB, MiB or GiB)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// "`flag` must be more than 0" for each of `flags` whose duration is zero.
fn zero_durations<const N: usize>(flags: [(&str, Duration); N]) -> Vec<String> {
    flags
        .into_iter()
        .filter(|(_, d)| d.is_zero())
        .map(|(flag, _)| format!("{flag} must be more than 0"))
        .collect()
}

/// Fails with every problem listed, if there is any.
fn bail_on(problems: Vec<String>) -> anyhow::Result<()> {
    if !problems.is_empty() {
        anyhow::bail!(
            "invalid gateway configuration:\n  {}",
            problems.join("\n  ")
        );
    }
    Ok(())
}

/// What kind of management server `faden gateway` syncs from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ServerKind {
    /// Told by the server's answers: a faden server publishes key digests
    /// (`/v2/credentials`), a GPUStack server answers 404 there.
    Auto,
    /// A `faden server`: keys are checked against the digests it publishes.
    Faden,
    /// A GPUStack 2.3 server: keys are checked with its `/token-auth`, worker proxies are
    /// called with their cluster's registration token.
    Gpustack,
}

/// Options of `faden gateway`.
#[derive(Debug, Args)]
pub struct GatewayCmdArgs {
    /// Management API to sync routing from: a `faden server` or a GPUStack 2.3 server, e.g.
    /// http://server:30080 or https://server:30080. Several `faden server`s sharing one
    /// database: a comma-separated list, tried in turn (the sync moves to the next one when a
    /// server cannot be reached or its streams end). One URL behind a load balancer works too.
    #[arg(long = "server-url", env = "FADEN_SERVER_URL", value_name = "URL", required = true, value_delimiter = ',', value_parser = crate::server_tls::parse_server_url)]
    pub server_urls: Vec<String>,
    /// The kind of server at --server-url. With a GPUStack server, clients' GPUStack API keys
    /// are checked with the server (per model, cached: see --key-allowed-ttl) and never
    /// forwarded; `worker`-mode workers are called with their cluster's registration token.
    #[arg(long, env = "FADEN_SERVER_KIND", value_enum, default_value_t = ServerKind::Auto)]
    pub server_kind: ServerKind,
    /// GPUStack: how long the server's "yes" for a (key, model) is reused before it is asked
    /// again; the longest a key revoked or expired in GPUStack keeps working.
    #[arg(long, env = "FADEN_KEY_ALLOWED_TTL", default_value = "5s", value_parser = humantime::parse_duration)]
    pub key_allowed_ttl: Duration,
    /// GPUStack: how long the server's "no" for a (key, model) is reused; a key created in
    /// GPUStack works at most this long after a client first tried it.
    #[arg(long, env = "FADEN_KEY_REFUSED_TTL", default_value = "1s", value_parser = humantime::parse_duration)]
    pub key_refused_ttl: Duration,
    /// GPUStack: while the server cannot be reached, a (key, model) it allowed at most this
    /// long ago keeps working; any other key gets 503 (never 401).
    #[arg(long, env = "FADEN_KEY_OUTAGE_GRACE", default_value = "5m", value_parser = humantime::parse_duration)]
    pub key_outage_grace: Duration,
    /// GPUStack: longest wait for the server's answer on a key.
    #[arg(long, env = "FADEN_KEY_CHECK_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub key_check_timeout: Duration,
    /// GPUStack: most (key, model) verdicts kept.
    #[arg(long, env = "FADEN_KEY_CACHE_ENTRIES", default_value_t = 65_536)]
    pub key_cache_entries: usize,
    /// CA bundle (PEM) that the servers' certificates must chain to, for https --server-url
    /// URLs [default: the platform's root certificates].
    #[arg(long, env = "FADEN_SERVER_CA")]
    pub server_ca: Option<PathBuf>,
    /// API key for the management API: a faden key of scope `data_plane` (or an admin key);
    /// for GPUStack, an API key of an admin user with scope `all` or `management` (it lists
    /// workers, models and instances, reads registration tokens, and is the credential at
    /// GPUStack's proxy port).
    #[arg(long, env = "FADEN_TOKEN", hide_env_values = true)]
    pub token: String,
    /// Address to listen on.
    #[arg(long, env = "FADEN_HOST", default_value = "0.0.0.0")]
    pub host: IpAddr,
    #[command(flatten)]
    pub gateway: GatewayArgs,
    /// On SIGTERM/SIGINT, how long in-flight requests and streams may still run.
    #[arg(long, env = "FADEN_DRAIN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// Longest wait before trying the management API again after a failure. Each wait is
    /// drawn at random below a cap that starts at --sync-retry-min and doubles with every
    /// failure in a row, up to this; a stream that delivered data starts over. The gateway
    /// keeps serving from its last snapshot meanwhile.
    #[arg(long, env = "FADEN_SYNC_RETRY_MAX", default_value = "10s", value_parser = humantime::parse_duration)]
    pub sync_retry_max: Duration,
    /// Cap of the first wait before trying the management API again (see --sync-retry-max).
    #[arg(long, env = "FADEN_SYNC_RETRY_MIN", default_value = "100ms", value_parser = humantime::parse_duration)]
    pub sync_retry_min: Duration,
    /// A watch stream of the management API that stays silent this long (not even a
    /// heartbeat; GPUStack sends one every 15 s) is dropped and opened again.
    #[arg(long, env = "FADEN_SYNC_IDLE_TIMEOUT", default_value = "45s", value_parser = humantime::parse_duration)]
    pub sync_idle_timeout: Duration,
}

impl GatewayCmdArgs {
    /// The gateway's and the sync client's configurations, with every problem of either
    /// reported at once.
    fn configs(&self) -> anyhow::Result<(GatewayConfig, SyncConfig)> {
        let mut problems = self.gateway.problems();
        problems.extend(zero_durations([
            ("--sync-retry-min", self.sync_retry_min),
            ("--sync-idle-timeout", self.sync_idle_timeout),
            ("--key-allowed-ttl", self.key_allowed_ttl),
            ("--key-check-timeout", self.key_check_timeout),
        ]));
        if self.key_cache_entries == 0 {
            problems.push("--key-cache-entries must be at least 1".to_owned());
        }
        if self.sync_retry_max < self.sync_retry_min {
            problems.push(format!(
                "--sync-retry-max ({}) must not be below --sync-retry-min ({})",
                humantime::format_duration(self.sync_retry_max),
                humantime::format_duration(self.sync_retry_min)
            ));
        }
        bail_on(problems)?;
        let gateway = self.gateway.build(self.drain_timeout)?;
        let mut sync = SyncConfig::with_urls(self.server_urls.iter().cloned(), &self.token);
        sync.backoff_min = self.sync_retry_min;
        sync.backoff_max = self.sync_retry_max;
        sync.idle_timeout = self.sync_idle_timeout;
        sync.tls = crate::server_tls::server_tls(&self.server_urls, self.server_ca.as_deref())?;
        Ok((gateway, sync))
    }
}

/// A running gateway task.
pub struct RunningGateway {
    pub addr: SocketAddr,
    pub task: tokio::task::JoinHandle<()>,
}

impl GatewayCmdArgs {
    /// Whether the server `faden gateway` syncs from is a GPUStack server, now.
    fn gpustack_probe(&self, sync: &SyncHandle) -> control_client::sync::Probe {
        match self.server_kind {
            ServerKind::Faden => Arc::new(|| false),
            ServerKind::Gpustack => Arc::new(|| true),
            ServerKind::Auto => {
                let sync = sync.clone();
                Arc::new(move || sync.offers_credentials() == Some(false))
            }
        }
    }

    /// GPUStack's keys, checked with its `/token-auth` (unused with a faden server).
    fn remote_keys(
        &self,
        sync: &SyncConfig,
        gpustack: &control_client::sync::Probe,
    ) -> anyhow::Result<Option<gateway::RemoteKeys>> {
        if self.server_kind == ServerKind::Faden {
            return Ok(None);
        }
        // A GPUStack server is one server: its keys are checked with the first URL.
        let first = sync.base_urls.first().map_or("", String::as_str);
        let authority = control_client::key_check::TokenAuth::new(
            first,
            sync.tls.clone(),
            self.key_check_timeout,
        )
        .context("management API settings")?;
        let config = control_client::key_check::KeyCheckConfig {
            allowed_ttl: self.key_allowed_ttl,
            refused_ttl: self.key_refused_ttl,
            outage_grace: self.key_outage_grace,
            max_entries: self.key_cache_entries,
        };
        Ok(Some(gateway::RemoteKeys {
            check: control_client::key_check::KeyCheck::new(Arc::new(authority), config),
            active: Arc::clone(gpustack),
        }))
    }

    /// `worker`-mode workers get their cluster's worker proxy credential (a faden server) or
    /// registration token (GPUStack's worker proxies take nothing else that can be read);
    /// `tunnel` workers are reached through the proxy port straight at the instance, which gets
    /// no credential. `--worker-credential`, when set, is used instead.
    fn worker_credentials(
        &self,
        sync_config: &SyncConfig,
        sync: &SyncHandle,
        gpustack: &control_client::sync::Probe,
        cancel: &CancellationToken,
    ) -> anyhow::Result<Option<gateway::WorkerCredentials>> {
        use control_client::cluster_tokens::ClusterSecret;
        if self.gateway.worker_credential.is_some() {
            return Ok(None);
        }
        let gpustack = Arc::clone(gpustack);
        let tokens = control_client::cluster_tokens::spawn(
            sync_config,
            sync.clone(),
            Arc::new(move || {
                if gpustack() {
                    ClusterSecret::RegistrationToken
                } else {
                    ClusterSecret::ProxyCredential
                }
            }),
            cancel.clone(),
        )
        .context("management API settings")?;
        Ok(Some(Arc::new(
            move |endpoint: &control_client::routing::Endpoint| {
                (endpoint.proxy_mode == control_client::model::ProxyMode::Worker)
                    .then(|| tokens.authorization(endpoint.cluster_id))
                    .flatten()
            },
        )))
    }
}

impl GatewayCmdArgs {
    /// The engines' load, followed from a faden server's `/v2/worker-load` stream; none from a
    /// GPUStack server, whose workers report none (with `--server-kind auto` the stream is
    /// asked for and a 404 leaves it alone for ten minutes at a time).
    fn engine_loads(
        &self,
        sync: &SyncConfig,
        cancel: &CancellationToken,
    ) -> anyhow::Result<Option<Arc<EngineLoads>>> {
        if self.server_kind == ServerKind::Gpustack {
            return Ok(None);
        }
        let loads = EngineLoads::new();
        // Ends at `cancel` (the sync's, cancelled at shutdown).
        let _follow =
            control_client::engine_load::follow::follow(sync, loads.clone(), cancel.clone())
                .context("management API settings")?;
        Ok(Some(loads))
    }
}

/// Optional parts of a gateway fed by a sync client.
#[derive(Default)]
pub struct GatewayExtras {
    pub remote_keys: Option<gateway::RemoteKeys>,
    pub worker_credentials: Option<gateway::WorkerCredentials>,
    /// The engines' load, for the routing policy.
    pub engine_loads: Option<Arc<EngineLoads>>,
    /// The span exporter, flushed once the gateway drained.
    pub telemetry: Option<gateway::telemetry::Telemetry>,
}

/// Binds and starts a gateway fed by `sync`, with the optional parts: one listening socket and
/// one gateway per serving core ([`crate::runtime`]), `tunnel` made once per core.
pub async fn start_gateway(
    config: GatewayConfig,
    addr: SocketAddr,
    sync: SyncHandle,
    tunnel: gateway::TunnelFactory,
    extras: GatewayExtras,
    shutdown: CancellationToken,
) -> anyhow::Result<RunningGateway> {
    let cores = crate::runtime::cores();
    let listeners = net::cores::bind_reuseport(addr, cores.len())
        .with_context(|| format!("gateway cannot listen on {addr}"))?;
    let addr = listeners
        .first()
        .context("no listening socket")?
        .local_addr()?;
    let probe_sync = sync.clone();
    let mut builder = Gateway::builder(config, sync.clone())
        .staleness_probe(Arc::new(move || {
            probe_sync.staleness().unwrap_or(Duration::MAX)
        }))
        .tunnel_per_core(tunnel);
    if let Some(keys) = extras.remote_keys {
        builder = builder.remote_keys(keys);
    }
    if let Some(credentials) = extras.worker_credentials {
        builder = builder.worker_credentials(credentials);
    }
    if let Some(loads) = extras.engine_loads {
        builder = builder.engine_loads(loads);
    }
    if let Some(telemetry) = &extras.telemetry {
        builder = builder.telemetry(telemetry.clone());
    }
    let telemetry = extras.telemetry;
    let group = builder
        .build_group(cores.len())
        .context("gateway configuration")?;
    // Ends at `shutdown`, once every core drained and the last spans left; `RunningGateway`
    // keeps the handle.
    let task = net::task::spawn(async move {
        group.serve(listeners, cores, shutdown).await;
        if let Some(telemetry) = telemetry {
            telemetry.shutdown(SPAN_FLUSH_TIMEOUT).await;
        }
    });
    tracing::info!(%addr, cores = cores.len(), "gateway listening");
    Ok(RunningGateway { addr, task })
}

pub async fn run(args: GatewayCmdArgs) -> anyhow::Result<()> {
    let (config, sync_config) = args.configs()?;
    let shutdown = CancellationToken::new();
    let sync_cancel = CancellationToken::new();
    let sync =
        sync::spawn(sync_config.clone(), sync_cancel.clone()).context("management API settings")?;
    let addr = SocketAddr::new(args.host, args.gateway.port);
    // Tunnel workers are reached through the server's proxy port, with this gateway's key (a
    // pool of connections to it per core).
    let relay = gateway::ProxyPortUpstream::new(&args.token, &config)
        .context("--token is not a valid header value")?;
    let relay: gateway::TunnelFactory = {
        let config = config.clone();
        Arc::new(move || Arc::new(relay.with_own_pool(&config)) as Arc<dyn gateway::Upstream>)
    };
    let gpustack = args.gpustack_probe(&sync);
    let extras = GatewayExtras {
        remote_keys: args.remote_keys(&sync_config, &gpustack)?,
        worker_credentials: args.worker_credentials(
            &sync_config,
            &sync,
            &gpustack,
            &sync_cancel,
        )?,
        engine_loads: args.engine_loads(&sync_config, &sync_cancel)?,
        telemetry: args.gateway.telemetry()?,
    };
    let gw = start_gateway(config, addr, sync, relay, extras, shutdown.clone()).await?;
    tracing::info!(gateway = %gw.addr, servers = ?args.server_urls, kind = ?args.server_kind, "faden gateway ready");
    crate::shutdown::shutdown_signal().await;
    tracing::info!(drain = ?args.drain_timeout, "draining");
    shutdown.cancel();
    let _ = gw.task.await;
    sync_cancel.cancel();
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use clap::Parser as _;

    use super::*;

    /// The flags of `faden gateway` alone.
    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: GatewayCmdArgs,
    }

    fn args(extra: &[&str]) -> GatewayCmdArgs {
        let base = [
            "faden-gateway",
            "--server-url",
            "http://127.0.0.1:1",
            "--token",
            "t",
        ];
        Cli::try_parse_from(base.iter().chain(extra)).unwrap().args
    }

    #[test]
    fn sync_flags_reach_the_sync_client() {
        // The flags' defaults are the sync client's own.
        let (_, sync) = args(&[]).configs().unwrap();
        let defaults = SyncConfig::new("http://127.0.0.1:1", "t");
        assert_eq!(sync.backoff_min, defaults.backoff_min);
        assert_eq!(sync.backoff_max, defaults.backoff_max);
        assert_eq!(sync.idle_timeout, defaults.idle_timeout);
        assert_eq!(sync.backoff_max, Duration::from_secs(10));
        let (_, sync) = args(&[
            "--sync-retry-min",
            "50ms",
            "--sync-retry-max",
            "2s",
            "--sync-idle-timeout",
            "20s",
        ])
        .configs()
        .unwrap();
        assert_eq!(sync.backoff_min, Duration::from_millis(50));
        assert_eq!(sync.backoff_max, Duration::from_secs(2));
        assert_eq!(sync.idle_timeout, Duration::from_secs(20));
        assert_eq!(sync.token, "t");
    }

    #[test]
    fn server_urls_are_a_checked_list() {
        let parse = |urls: &str| {
            Cli::try_parse_from(["faden-gateway", "--server-url", urls, "--token", "t"])
                .map(|cli| cli.args)
        };
        let args = parse("http://a:1,https://b:2/").unwrap();
        assert_eq!(args.server_urls, ["http://a:1", "https://b:2/"]);
        let error = parse("http://a:1,ftp://b:2").unwrap_err().to_string();
        assert!(
            error.contains("invalid value 'ftp://b:2' for '--server-url <URL>'"),
            "{error}"
        );
        assert!(Cli::try_parse_from(["faden-gateway", "--token", "t"]).is_err());

        let (_, sync) = parse("http://a:1,http://b:2").unwrap().configs().unwrap();
        assert_eq!(sync.base_urls, ["http://a:1", "http://b:2"]);
        assert!(sync.tls.is_none());
    }

    #[test]
    fn every_bad_flag_of_gateway_and_sync_is_reported_at_once() {
        let error = args(&[
            "--sync-retry-min",
            "0s",
            "--sync-idle-timeout",
            "0s",
            "--connect-timeout",
            "0s",
        ])
        .configs()
        .unwrap_err()
        .to_string();
        for expected in [
            "--sync-retry-min must be more than 0",
            "--sync-idle-timeout must be more than 0",
            "--connect-timeout must be more than 0",
        ] {
            assert!(error.contains(expected), "{error}");
        }
        let error = args(&["--sync-retry-max", "50ms"])
            .configs()
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--sync-retry-max (50ms) must not be below --sync-retry-min (100ms)"),
            "{error}"
        );
    }
}
