//! faden gateway: the OpenAI-compatible front of the data plane.
//!
//! It reads routing from [`RoutingSnapshot`]s published by `control_client::sync` (or in-process by the
//! server), authenticates keys against the snapshot's digests, picks an instance (P2C on
//! outstanding requests with passive ejection), and streams the upstream answer back untouched.
//!
//! - The listener, the native HTTP/1 codecs, the upstream pool and TLS settings are the `net`
//!   crate's; [`upstream_tls`]: mutual TLS to upstreams.
//! - [`handler`]: the request path as explicit phases.
//! - [`route`]: path table and `model` extraction; [`auth`]: key checks.
//! - [`balance`]: instance selection and ejection; [`upstream`]: paths per `proxy_mode`.
//! - [`body`] and [`sse`]: streaming with timeouts and explicit mid-stream failure.
//! - [`metrics`]: Prometheus text; [`error`]: typed errors in the OpenAI shape; [`usage`]: the
//!   token usage answers report, read as they stream past.
//! - [`telemetry`]: OpenTelemetry spans exported over OTLP.
//! - [`trace_context`]: W3C `traceparent` from the client (or a new trace) to the engine.
//! - [`tunnel_upstream`]: `tunnel` endpoints in process, over the tunnel registry;
//!   [`proxy_port_upstream`]: `tunnel` endpoints through a server's proxy port.
#![forbid(unsafe_code)]

pub mod auth;
pub mod balance;
pub mod body;
pub mod config;
pub mod cores;
pub mod error;
pub mod handler;
pub mod metrics;
pub mod policy;
pub mod prefix_index;
pub mod prompt;
pub mod proxy_port_upstream;
pub mod route;
pub mod sse;
pub mod telemetry;
pub mod trace_context;
pub mod tunnel_upstream;
pub mod upstream;
pub mod upstream_tls;
pub mod usage;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use control_client::engine_load::EngineLoads;
use control_client::routing::RoutingSnapshot;
use control_client::sync::SyncHandle;
use http::HeaderValue;
use net::{listener, tls};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use crate::config::{
    EjectionConfig, GatewayConfig, ListenerConfig, ServerTlsConfig, Timeouts, UpstreamTls,
    UpstreamTlsConfig,
};
pub use crate::cores::GatewayGroup;
pub use crate::error::{ErrorKind, GatewayError};
pub use crate::proxy_port_upstream::ProxyPortUpstream;
pub use crate::tunnel_upstream::TunnelUpstream;
pub use crate::upstream::{Route, Upstream, UpstreamRequest};
pub use net::tls::TlsConfigError;

/// Where the gateway reads the current routing snapshot on every request. The newest value is
/// read each time, so a published snapshot (say, with a revoked key) applies to the very next
/// request.
#[derive(Clone, Debug)]
pub enum SnapshotSource {
    /// The sync client: its swap cell, read without a lock ([`SyncHandle::current`]); its
    /// channel only wakes the balancer's pruner.
    Sync(SyncHandle),
    /// A channel filled by the caller (tests, tools): a read takes the channel's lock.
    Watch(watch::Receiver<Arc<RoutingSnapshot>>),
    /// A shared swap cell filled by the caller.
    Swap(Arc<ArcSwap<RoutingSnapshot>>),
}

impl SnapshotSource {
    /// The current snapshot.
    pub fn load(&self) -> Arc<RoutingSnapshot> {
        match self {
            SnapshotSource::Sync(sync) => sync.current(),
            SnapshotSource::Watch(rx) => rx.borrow().clone(),
            SnapshotSource::Swap(cell) => cell.load_full(),
        }
    }
}

impl From<SyncHandle> for SnapshotSource {
    fn from(sync: SyncHandle) -> Self {
        SnapshotSource::Sync(sync)
    }
}

impl From<watch::Receiver<Arc<RoutingSnapshot>>> for SnapshotSource {
    fn from(rx: watch::Receiver<Arc<RoutingSnapshot>>) -> Self {
        SnapshotSource::Watch(rx)
    }
}

impl From<Arc<ArcSwap<RoutingSnapshot>>> for SnapshotSource {
    fn from(cell: Arc<ArcSwap<RoutingSnapshot>>) -> Self {
        SnapshotSource::Swap(cell)
    }
}

/// How old the routing snapshot is (time since the last successful sync), for `/readyz`.
pub type StalenessProbe = Arc<dyn Fn() -> Duration + Send + Sync>;

/// Keys the routing snapshot does not hold, judged by the management server per model
/// (GPUStack's `/token-auth`), through a cache of its verdicts.
#[derive(Clone)]
pub struct RemoteKeys {
    pub check: control_client::key_check::KeyCheck,
    /// Whether keys go to `check` now: `faden gateway` learns from the sync whether its server
    /// publishes key digests (faden) or not (GPUStack).
    pub active: control_client::sync::Probe,
}

impl std::fmt::Debug for RemoteKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteKeys")
            .field("check", &self.check)
            .field("active", &(self.active)())
            .finish()
    }
}

/// The worker credential per endpoint, when it is not one for all workers: GPUStack's worker
/// proxies take their cluster's registration token.
pub type WorkerCredentials =
    Arc<dyn Fn(&control_client::routing::Endpoint) -> Option<HeaderValue> + Send + Sync>;

/// The gateway. Cheap to clone; clones share state.
#[derive(Clone)]
pub struct Gateway {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub(crate) config: GatewayConfig,
    pub(crate) snapshots: SnapshotSource,
    pub(crate) balancer: balance::Balancer,
    pub(crate) metrics: Arc<metrics::Metrics>,
    pub(crate) pool: upstream::HttpUpstream,
    pub(crate) tunnel: Option<Arc<dyn Upstream>>,
    pub(crate) worker_authorization: Option<HeaderValue>,
    pub(crate) worker_credentials: Option<WorkerCredentials>,
    pub(crate) remote_keys: Option<RemoteKeys>,
    /// Shared by the gateway's cores.
    pub(crate) draining: Arc<AtomicBool>,
    pub(crate) staleness: Option<StalenessProbe>,
    pub(crate) tls: Option<tokio_rustls::TlsAcceptor>,
    /// Failed key checks per source address, shared by the gateway's cores.
    pub(crate) auth_limiter: Arc<net::admission::AuthLimiter>,
    /// The engines' own load readings, when something keeps them current.
    pub(crate) engine_loads: Option<Arc<EngineLoads>>,
    /// The span exporter, when spans are exported (checked first on every request).
    pub(crate) telemetry: Option<telemetry::Telemetry>,
    /// Every core of this gateway (itself alone unless built as a [`GatewayGroup`]): `/metrics`
    /// on any core shows them all.
    pub(crate) cores: Arc<std::sync::OnceLock<Vec<std::sync::Weak<Inner>>>>,
}

/// Builds a [`Gateway`] with optional parts.
pub struct GatewayBuilder {
    config: GatewayConfig,
    snapshots: SnapshotSource,
    tunnel: Option<TunnelFactory>,
    staleness: Option<StalenessProbe>,
    remote_keys: Option<RemoteKeys>,
    worker_credentials: Option<WorkerCredentials>,
    engine_loads: Option<Arc<EngineLoads>>,
    telemetry: Option<telemetry::Telemetry>,
}

impl std::fmt::Debug for GatewayBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayBuilder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Invalid gateway settings.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("the worker credential is not a valid header value")]
    WorkerCredential,
    /// A TLS file cannot be used (the error names it).
    #[error(transparent)]
    Tls(#[from] TlsConfigError),
}

impl GatewayBuilder {
    /// The transport for `tunnel` workers (without one they get 502), one for all cores.
    pub fn tunnel(mut self, upstream: Arc<dyn Upstream>) -> Self {
        self.tunnel = Some(Arc::new(move || upstream.clone()));
        self
    }

    /// The transport for `tunnel` workers, made once per core (each core pools its own
    /// streams).
    pub fn tunnel_per_core(mut self, make: TunnelFactory) -> Self {
        self.tunnel = Some(make);
        self
    }

    /// Leaves keys the snapshot does not hold to the management server.
    pub fn remote_keys(mut self, keys: RemoteKeys) -> Self {
        self.remote_keys = Some(keys);
        self
    }

    /// The worker credential per endpoint; `config.worker_credential`, when set, is used for
    /// the endpoints this gives none.
    pub fn worker_credentials(mut self, credentials: WorkerCredentials) -> Self {
        self.worker_credentials = Some(credentials);
        self
    }

    /// The engines' load readings the routing policy goes by (kept current by the server, or
    /// by a subscription to it); without them it goes by this gateway's own accounting.
    pub fn engine_loads(mut self, loads: Arc<EngineLoads>) -> Self {
        self.engine_loads = Some(loads);
        self
    }

    /// Exports a span per inference request through `telemetry` (one for all cores).
    pub fn telemetry(mut self, telemetry: telemetry::Telemetry) -> Self {
        self.telemetry = Some(telemetry);
        self
    }

    /// Reports the snapshot's age; `/readyz` fails beyond `max_snapshot_staleness`.
    pub fn staleness_probe(mut self, probe: StalenessProbe) -> Self {
        self.staleness = Some(probe);
        self
    }

    pub fn build(self) -> Result<Gateway, ConfigError> {
        let parts = self.shared_parts()?;
        let snapshots = self.snapshots.clone();
        self.core(&parts, snapshots, Arc::default())
    }

    /// A gateway of `cores` cores ([`GatewayGroup`]): each its own balancer, pool and counts,
    /// and its own copy of each routing snapshot; health, keys and load readings shared.
    pub fn build_group(self, cores: usize) -> Result<GatewayGroup, ConfigError> {
        let parts = self.shared_parts()?;
        let health = Arc::new(balance::HealthTable::default());
        let mut gateways = Vec::new();
        let mut cells = Vec::new();
        for _ in 0..cores.max(1) {
            let cell = Arc::new(ArcSwap::from(self.snapshots.load()));
            gateways.push(self.core(&parts, SnapshotSource::Swap(cell.clone()), health.clone())?);
            cells.push(cell);
        }
        let _ = parts
            .cores
            .set(gateways.iter().map(|g| Arc::downgrade(&g.inner)).collect());
        Ok(GatewayGroup::new(
            gateways,
            cells,
            self.snapshots,
            net::listener::SharedCaps::new(&self.config.listener),
        ))
    }

    fn shared_parts(&self) -> Result<SharedParts, ConfigError> {
        let worker_authorization = match &self.config.worker_credential {
            Some(secret) => {
                let mut v = HeaderValue::from_str(&format!("Bearer {secret}"))
                    .map_err(|_| ConfigError::WorkerCredential)?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let tls = match &self.config.tls {
            Some(settings) => Some(tokio_rustls::TlsAcceptor::from(tls::server_config(
                settings,
            )?)),
            None => None,
        };
        Ok(SharedParts {
            cores: Arc::default(),
            worker_authorization,
            tls,
            auth_limiter: Arc::new(net::admission::AuthLimiter::new(self.config.listener.auth)),
            draining: Arc::new(AtomicBool::new(false)),
        })
    }

    /// One core's gateway.
    fn core(
        &self,
        parts: &SharedParts,
        snapshots: SnapshotSource,
        health: Arc<balance::HealthTable>,
    ) -> Result<Gateway, ConfigError> {
        Ok(Gateway {
            inner: Arc::new(Inner {
                balancer: balance::Balancer::with_health(self.config.ejection.clone(), health),
                metrics: Arc::new(metrics::Metrics::default()),
                pool: upstream::HttpUpstream::with_tls(&self.config)?,
                tls: parts.tls.clone(),
                auth_limiter: parts.auth_limiter.clone(),
                tunnel: self.tunnel.as_ref().map(|make| make()),
                worker_authorization: parts.worker_authorization.clone(),
                worker_credentials: self.worker_credentials.clone(),
                remote_keys: self.remote_keys.clone(),
                engine_loads: self.engine_loads.clone(),
                telemetry: self.telemetry.clone(),
                draining: parts.draining.clone(),
                cores: parts.cores.clone(),
                staleness: self.staleness.clone(),
                snapshots,
                config: self.config.clone(),
            }),
        })
    }
}

/// What every core of a gateway shares, made once.
struct SharedParts {
    cores: Arc<std::sync::OnceLock<Vec<std::sync::Weak<Inner>>>>,
    worker_authorization: Option<HeaderValue>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    auth_limiter: Arc<net::admission::AuthLimiter>,
    draining: Arc<AtomicBool>,
}

/// Makes a core's transport for `tunnel` workers.
pub type TunnelFactory = Arc<dyn Fn() -> Arc<dyn Upstream> + Send + Sync>;

impl Gateway {
    /// A gateway with no tunnel transport and no staleness probe.
    pub fn new(
        config: GatewayConfig,
        snapshots: impl Into<SnapshotSource>,
    ) -> Result<Self, ConfigError> {
        Self::builder(config, snapshots).build()
    }

    pub fn builder(config: GatewayConfig, snapshots: impl Into<SnapshotSource>) -> GatewayBuilder {
        GatewayBuilder {
            config,
            snapshots: snapshots.into(),
            tunnel: None,
            staleness: None,
            remote_keys: None,
            worker_credentials: None,
            engine_loads: None,
            telemetry: None,
        }
    }

    /// Serves until `shutdown` fires, then drains (see [`listener::serve`]) and returns. With
    /// `config.tls`, the listener speaks TLS only.
    pub async fn serve(&self, listener: TcpListener, shutdown: CancellationToken) {
        self.serve_with_caps(listener, shutdown, None).await;
    }

    /// [`Gateway::serve`] with connection caps shared with the other cores' sockets.
    pub(crate) async fn serve_with_caps(
        &self,
        listener: TcpListener,
        shutdown: CancellationToken,
        shared: Option<listener::SharedCaps>,
    ) {
        let pruner = self.spawn_pruner(shutdown.clone());
        let gateway = self.clone();
        let handler = move |req, peer| gateway.clone().handle_owned(req, peer);
        let options = listener::ServeOptions {
            tls: self.inner.tls.clone(),
            events: Some(self.inner.metrics.clone()),
            shared,
            ..Default::default()
        };
        listener::serve_native(
            listener,
            &self.inner.config.listener,
            options,
            handler,
            shutdown,
            || self.set_draining(true),
        )
        .await;
        if let Some(p) = pruner {
            p.abort();
        }
    }

    /// Marks the gateway draining (`/readyz` 503) without stopping it: lets a load balancer
    /// take it out of rotation before shutdown.
    pub fn set_draining(&self, draining: bool) {
        self.inner.draining.store(draining, Ordering::Relaxed);
    }

    /// Whether `/readyz` answers 200 now.
    pub fn is_ready(&self) -> bool {
        if self.inner.draining.load(Ordering::Relaxed) {
            return false;
        }
        match (
            &self.inner.staleness,
            self.inner.config.max_snapshot_staleness,
        ) {
            (Some(probe), Some(max)) => probe() <= max,
            _ => true,
        }
    }

    /// The Prometheus text exposition, with the routing snapshot's age when a staleness probe
    /// is set (`faden_gateway_snapshot_age_seconds`, `+Inf` before the first sync).
    pub fn metrics_text(&self) -> String {
        match self.inner.cores.get() {
            Some(cores) => {
                let all: Vec<Gateway> = cores
                    .iter()
                    .filter_map(|c| c.upgrade().map(|inner| Gateway { inner }))
                    .collect();
                cores::metrics_of(&all)
            }
            None => cores::metrics_of(std::slice::from_ref(self)),
        }
    }

    /// The metrics, for embedding in another registry.
    pub fn metrics(&self) -> &Arc<metrics::Metrics> {
        &self.inner.metrics
    }

    /// Forgets balancer state of instances gone from new snapshots (watch sources only).
    fn spawn_pruner(&self, shutdown: CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        let mut rx = match &self.inner.snapshots {
            SnapshotSource::Sync(sync) => sync.snapshots(),
            SnapshotSource::Watch(rx) => rx.clone(),
            SnapshotSource::Swap(_) => return None,
        };
        let inner = self.inner.clone();
        // Ends at `shutdown`; the caller keeps the handle.
        Some(net::task::spawn(async move {
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    changed = rx.changed() => {
                        if changed.is_err() {
                            break;
                        }
                        let snapshot = rx.borrow_and_update().clone();
                        inner.balancer.prune(&snapshot);
                    }
                }
            }
        }))
    }
}
