//! The server end: the `GET /connect` handler on the management API port, and the registry of
//! connected tunnels (one per worker).
//!
//! The handshake is done here, not in an accept loop: it is bounded in time
//! ([`TunnelServerConfig::handshake_timeout`], covering authentication and the upgrade) and in
//! number (pending handshakes in total and per source address, counted by the same
//! [`net::admission::Admission`] every listener uses), so junk traffic cannot degrade the
//! tunnels already up. Refused worker tokens count as failed authentications of the source
//! address, in the listener's [`AuthLimiter`] when the request carries one (the management API
//! port puts its own in every request, so `/connect` and `/v2` share one table), else in the
//! tunnel server's own; a blocked source gets 429 with `Retry-After` before its token is
//! checked. A worker's new tunnel replaces its old one, which is closed, even if the
//! old one has not been noticed dead yet. Up/down changes reach the `on_change` callback in
//! order, one at a time.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use net::admission::{Admission, AuthLimiter, AuthLimits, Blocked, PendingLimits};
use net::relay::ListenerSocket;
use parking_lot::{Mutex, RwLock};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

use crate::error::TunnelError;
use crate::gpustack_link::{GpuStackLink, GpuStackLinkConfig, GpuStackStream, parse_cidrs};
use crate::http::BoxFuture;
use crate::mux::{self, MuxConfig, MuxHandle, Role, TunnelStream};
use crate::protocol::{SUBPROTOCOL, SUPPORTED, X_FADEN_TUNNEL_PROTOCOLS};
use crate::ws_io::{Endpoint, Liveness, MoveSignal, WsIo};

mod moves;

/// Who a worker token belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WorkerIdentity {
    pub worker_id: i64,
    pub cluster_id: i64,
}

/// Where a worker says it is: its advertised address (or IP) and its worker port. The proxy
/// port relays `CONNECT`/absolute-form requests only to exactly these.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorkerAddress {
    /// An IP address (any form `IpAddr` parses; kept canonical) or a host name (kept lowercase).
    pub host: String,
    pub port: u16,
}

impl WorkerAddress {
    pub fn new(host: &str, port: u16) -> Self {
        Self {
            host: canonical_host(host),
            port,
        }
    }
}

/// The canonical form of a host: an IP in `IpAddr`'s display form (no brackets), else lowercase.
pub(crate) fn canonical_host(host: &str) -> String {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    match bare.parse::<IpAddr>() {
        Ok(ip) => ip.to_string(),
        Err(_) => bare.to_ascii_lowercase(),
    }
}

/// A tunnel that came up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TunnelUp {
    pub worker_id: i64,
    pub cluster_id: i64,
    /// Increases with every tunnel this server accepts.
    pub session: u64,
    /// The worker's source address, when the listener reports it.
    pub peer: Option<SocketAddr>,
}

/// Checks a worker token: `Some` for a valid, unexpired, unrevoked worker token.
pub type Authenticator = Arc<dyn Fn(String) -> BoxFuture<Option<WorkerIdentity>> + Send + Sync>;
/// Finds a worker's advertised address and worker port.
pub type AddressLookup = Arc<dyn Fn(i64) -> BoxFuture<Option<WorkerAddress>> + Send + Sync>;
/// Told when a worker's tunnel goes up (`Some`) or down (`None`); called in order, one at a time.
pub type OnChange = Arc<dyn Fn(i64, Option<TunnelUp>) -> BoxFuture<()> + Send + Sync>;

/// Server settings.
#[derive(Clone, Debug)]
pub struct TunnelServerConfig {
    /// From the `/connect` request to a running tunnel (authentication and upgrade).
    pub handshake_timeout: Duration,
    /// Handshakes in progress at once, at most; more get 503.
    pub max_pending_handshakes: usize,
    /// Handshakes in progress at once from one source address, at most; more get 429. 0: no
    /// per-source cap.
    pub max_pending_per_ip: usize,
    /// Failed worker-token checks per source, when the listener provides no table of its own.
    pub auth: AuthLimits,
    pub liveness: Liveness,
    pub mux: MuxConfig,
    /// Limits of GPUStack workers' tunnels (their own dialect).
    pub gpustack: GpuStackLinkConfig,
    /// Opening a stream may take this long (the worker must acknowledge it).
    pub open_timeout: Duration,
    /// The address lookup may take this long; without an answer the worker has no address.
    pub lookup_timeout: Duration,
}

impl Default for TunnelServerConfig {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(5),
            max_pending_handshakes: 256,
            max_pending_per_ip: 64,
            auth: AuthLimits::default(),
            liveness: Liveness::default(),
            mux: MuxConfig::default(),
            gpustack: GpuStackLinkConfig::default(),
            open_timeout: Duration::from_secs(5),
            lookup_timeout: Duration::from_secs(5),
        }
    }
}

/// The registry of connected tunnels and the `/connect` handler. Cheap to clone.
#[derive(Clone)]
pub struct TunnelServer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TunnelServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelServer")
            .field("connected", &self.inner.sessions.read().len())
            .finish_non_exhaustive()
    }
}

struct Session {
    id: u64,
    up: TunnelUp,
    link: Link,
    address: Option<WorkerAddress>,
    /// Asks the worker to move its tunnel to another server (faden's dialect).
    moves: Option<MoveSignal>,
}

/// The tunnel's dialect, and its handle.
#[derive(Clone, Debug)]
enum Link {
    /// `faden-tunnel.v1`: yamux streams to the worker's proxy.
    Mux(MuxHandle),
    /// GPUStack's tunnel client: sessions to addresses in the worker's ranges.
    GpuStack(GpuStackLink),
}

impl Link {
    fn close(&self) {
        match self {
            Link::Mux(handle) => handle.close(),
            Link::GpuStack(link) => link.close(),
        }
    }

    async fn closed(&self) {
        match self {
            Link::Mux(handle) => handle.closed().await,
            Link::GpuStack(link) => link.closed().await,
        }
    }
}

/// Which protocol a worker's tunnel speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// faden's own (`faden-tunnel.v1`).
    Faden,
    /// GPUStack 2.3's (`gpustack.websocket_proxy`): no subprotocol, `x-client-id` and
    /// `x-cidrs` headers, [`crate::gpustack_message`] messages.
    GpuStack,
}

struct Inner {
    config: TunnelServerConfig,
    authenticate: Authenticator,
    lookup: Option<AddressLookup>,
    sessions: RwLock<HashMap<i64, Session>>,
    pending: Admission,
    auth_limiter: Arc<AuthLimiter>,
    next_session: AtomicU64,
    events: mpsc::UnboundedSender<(i64, Option<TunnelUp>)>,
    shutdown: CancellationToken,
    /// Workers are being asked to move: no new tunnel is taken (see `moves`).
    moving: CancellationToken,
    /// Tunnels are taken (see [`TunnelServerBuilder::starting`]).
    ready: std::sync::atomic::AtomicBool,
    /// Notified whenever a session leaves the registry.
    ended: tokio::sync::Notify,
    sessions_done: CancellationToken,
    tasks: TaskTracker,
    notifier: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Builds a [`TunnelServer`].
pub struct TunnelServerBuilder {
    ready: bool,
    config: TunnelServerConfig,
    authenticate: Authenticator,
    lookup: Option<AddressLookup>,
    on_change: Option<OnChange>,
}

impl std::fmt::Debug for TunnelServerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelServerBuilder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl TunnelServerBuilder {
    /// Answers tunnel handshakes 503 (`starting`: the worker retries soon) until
    /// [`TunnelServer::set_ready`]: for a server whose `/connect` is reachable before what
    /// checks tokens is (a refused token would send workers into their long backoff).
    pub fn starting(mut self) -> Self {
        self.ready = false;
        self
    }

    /// Called (in order, one at a time) when a worker's tunnel goes up or down; a replaced
    /// tunnel reports only the new one's `Some`.
    pub fn on_change<F, Fut>(mut self, f: F) -> Self
    where
        F: Fn(i64, Option<TunnelUp>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.on_change = Some(Arc::new(move |w, up| Box::pin(f(w, up))));
        self
    }

    /// Looks up a worker's advertised address and worker port when its tunnel comes up (the
    /// proxy port relays `CONNECT` and absolute-form requests only to these).
    pub fn address_lookup<F, Fut>(mut self, f: F) -> Self
    where
        F: Fn(i64) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Option<WorkerAddress>> + Send + 'static,
    {
        self.lookup = Some(Arc::new(move |w| Box::pin(f(w))));
        self
    }

    /// Builds the server; must run inside a tokio runtime (it starts the notifier task).
    pub fn build(self) -> TunnelServer {
        let (events, mut rx) = mpsc::unbounded_channel::<(i64, Option<TunnelUp>)>();
        let sessions_done = CancellationToken::new();
        let done = sessions_done.clone();
        let on_change = self.on_change;
        // Ends once every session is done (`sessions_done`); `shutdown` awaits it.
        let notifier = net::task::spawn(async move {
            loop {
                let event = tokio::select! {
                    biased;
                    event = rx.recv() => event,
                    () = done.cancelled() => rx.try_recv().ok(),
                };
                let Some((worker, up)) = event else { break };
                if let Some(f) = &on_change {
                    f(worker, up).await;
                }
            }
        });
        TunnelServer {
            inner: Arc::new(Inner {
                pending: Admission::new(PendingLimits {
                    max_pending: self.config.max_pending_handshakes,
                    max_pending_per_source: self.config.max_pending_per_ip,
                }),
                auth_limiter: Arc::new(AuthLimiter::new(self.config.auth)),
                config: self.config,
                authenticate: self.authenticate,
                lookup: self.lookup,
                sessions: RwLock::new(HashMap::new()),
                next_session: AtomicU64::new(1),
                events,
                shutdown: CancellationToken::new(),
                moving: CancellationToken::new(),
                ready: std::sync::atomic::AtomicBool::new(self.ready),
                ended: tokio::sync::Notify::new(),
                sessions_done,
                tasks: TaskTracker::new(),
                notifier: Mutex::new(Some(notifier)),
            }),
        }
    }
}

type Reply = Response<Full<Bytes>>;

/// A JSON error in the OpenAI shape, like every other faden error.
pub(crate) fn json_error(status: StatusCode, message: &str, code: &str) -> Reply {
    let error_type = match status {
        StatusCode::UNAUTHORIZED | StatusCode::PROXY_AUTHENTICATION_REQUIRED => {
            "authentication_error"
        }
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        s if s.is_server_error() => "server_error",
        _ => "invalid_request_error",
    };
    let mut resp = Response::new(Full::new(net::error_body(message, error_type, code)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// 429 for a source blocked after too many failed authentications.
pub(crate) fn blocked_reply(blocked: Blocked) -> Reply {
    let mut resp = json_error(
        StatusCode::TOO_MANY_REQUESTS,
        &blocked.to_string(),
        Blocked::CODE,
    );
    resp.headers_mut()
        .insert(header::RETRY_AFTER, blocked.retry_after_header());
    resp
}

/// Why the headers of a `/connect` request are refused, before any token is checked.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandshakeRejection {
    /// Not `Connection: upgrade` + `Upgrade: websocket`.
    NotUpgrade,
    /// `Sec-WebSocket-Version` is not 13.
    Version,
    MissingKey,
    /// `Sec-WebSocket-Protocol` does not offer [`SUBPROTOCOL`], and the request is not
    /// GPUStack's (no subprotocol at all, an `x-client-id`).
    Protocol,
    /// A GPUStack handshake whose `x-cidrs` is not a list of address ranges.
    Cidrs,
    /// No `Authorization: Bearer <token>`.
    MissingToken,
}

impl HandshakeRejection {
    fn reply(self) -> Reply {
        match self {
            HandshakeRejection::NotUpgrade => {
                let mut resp = json_error(
                    StatusCode::UPGRADE_REQUIRED,
                    "the tunnel endpoint needs a WebSocket upgrade (Connection: upgrade, Upgrade: websocket)",
                    "upgrade_required",
                );
                resp.headers_mut()
                    .insert(header::UPGRADE, HeaderValue::from_static("websocket"));
                resp
            }
            HandshakeRejection::Version => {
                let mut resp = json_error(
                    StatusCode::UPGRADE_REQUIRED,
                    "unsupported WebSocket version (13 is required)",
                    "upgrade_required",
                );
                resp.headers_mut().insert(
                    header::SEC_WEBSOCKET_VERSION,
                    HeaderValue::from_static("13"),
                );
                resp
            }
            HandshakeRejection::MissingKey => json_error(
                StatusCode::BAD_REQUEST,
                "missing Sec-WebSocket-Key",
                "bad_request",
            ),
            HandshakeRejection::Protocol => {
                let mut resp = json_error(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "unsupported tunnel protocol: send Sec-WebSocket-Protocol: {}",
                        SUPPORTED.join(", ")
                    ),
                    "unsupported_tunnel_protocol",
                );
                if let Ok(v) = HeaderValue::from_str(&SUPPORTED.join(", ")) {
                    resp.headers_mut().insert(X_FADEN_TUNNEL_PROTOCOLS, v);
                }
                resp
            }
            HandshakeRejection::Cidrs => json_error(
                StatusCode::BAD_REQUEST,
                "x-cidrs must list the address ranges the worker reaches, e.g. 10.0.0.2/32",
                "bad_request",
            ),
            HandshakeRejection::MissingToken => json_error(
                StatusCode::UNAUTHORIZED,
                "missing worker token: send Authorization: Bearer <worker token>",
                "invalid_worker_token",
            ),
        }
    }
}

/// What a `/connect` request's headers carry once they pass [`check_handshake_headers`].
#[doc(hidden)]
#[derive(Clone, Debug)]
pub struct HandshakeHeaders {
    /// `Sec-WebSocket-Key`, for the accept key.
    pub key: HeaderValue,
    /// The worker token of `Authorization: Bearer`, not yet checked.
    pub token: String,
    pub dialect: Dialect,
    /// A GPUStack worker's address ranges (`x-cidrs`); empty for faden's dialect.
    pub cidrs: Vec<ipnet::IpNet>,
}

/// The header checks of a `/connect` request, in the order their refusals are answered: a
/// WebSocket upgrade, version 13, a key, the tunnel subprotocol offered, a bearer token. Pure,
/// so it can be fuzzed; the token is authenticated afterwards.
#[doc(hidden)]
pub fn check_handshake_headers(
    headers: &HeaderMap,
) -> Result<HandshakeHeaders, HandshakeRejection> {
    let is_upgrade = header_has_token(headers, header::CONNECTION, "upgrade")
        && header_has_token(headers, header::UPGRADE, "websocket");
    if !is_upgrade {
        return Err(HandshakeRejection::NotUpgrade);
    }
    if headers
        .get(header::SEC_WEBSOCKET_VERSION)
        .is_none_or(|v| v.as_bytes() != b"13")
    {
        return Err(HandshakeRejection::Version);
    }
    let key = headers
        .get(header::SEC_WEBSOCKET_KEY)
        .cloned()
        .ok_or(HandshakeRejection::MissingKey)?;
    let dialect = if header_has_token(headers, header::SEC_WEBSOCKET_PROTOCOL, SUBPROTOCOL) {
        Dialect::Faden
    } else if !headers.contains_key(header::SEC_WEBSOCKET_PROTOCOL)
        && headers.contains_key(X_CLIENT_ID)
    {
        Dialect::GpuStack
    } else {
        return Err(HandshakeRejection::Protocol);
    };
    let cidrs = match dialect {
        Dialect::Faden => Vec::new(),
        Dialect::GpuStack => headers
            .get(X_CIDRS)
            .and_then(|v| v.to_str().ok())
            .map(parse_cidrs)
            .and_then(Result::ok)
            .filter(|c| !c.is_empty())
            .ok_or(HandshakeRejection::Cidrs)?,
    };
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(net::headers::bearer)
        .map(str::to_owned)
        .ok_or(HandshakeRejection::MissingToken)?;
    Ok(HandshakeHeaders {
        key,
        token,
        dialect,
        cidrs,
    })
}

/// GPUStack's tunnel handshake headers: the worker's uuid and the address ranges it reaches.
const X_CLIENT_ID: &str = "x-client-id";
const X_CIDRS: &str = "x-cidrs";

fn header_has_token(headers: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

impl TunnelServer {
    /// A server that checks worker tokens with `authenticate`.
    pub fn builder<F, Fut>(config: TunnelServerConfig, authenticate: F) -> TunnelServerBuilder
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Option<WorkerIdentity>> + Send + 'static,
    {
        TunnelServerBuilder {
            ready: true,
            config,
            authenticate: Arc::new(move |t| Box::pin(authenticate(t))),
            lookup: None,
            on_change: None,
        }
    }

    /// Answers one `/connect` request (any body type). `peer` is the
    /// source address, used for the per-IP handshake limit.
    pub async fn handle_connect<B>(&self, mut req: Request<B>, peer: Option<SocketAddr>) -> Reply {
        let deadline = Instant::now() + self.inner.config.handshake_timeout;
        if !self.inner.ready.load(Ordering::Acquire) {
            return json_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is starting",
                "starting",
            );
        }
        if self.inner.shutdown.is_cancelled() || self.inner.moving.is_cancelled() {
            return json_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
                "shutting_down",
            );
        }
        let limiter = req
            .extensions()
            .get::<Arc<AuthLimiter>>()
            .cloned()
            .unwrap_or_else(|| self.inner.auth_limiter.clone());
        let source = peer.map(|p| p.ip());
        let HandshakeHeaders {
            key,
            token,
            dialect,
            cidrs,
        } = match check_handshake_headers(req.headers()) {
            Ok(h) => h,
            Err(rejection) => return rejection.reply(),
        };
        let slot = match self.inner.pending.try_admit(source, deadline) {
            Ok(slot) => slot,
            Err(refusal) => {
                return json_error(
                    refusal.status(),
                    match refusal {
                        net::admission::Refusal::Total => {
                            "too many tunnel handshakes in progress; retry later"
                        }
                        net::admission::Refusal::PerSource => {
                            "too many tunnel handshakes in progress from this address; retry later"
                        }
                    },
                    "too_many_handshakes",
                );
            }
        };
        let identity =
            match tokio::time::timeout_at(deadline, (self.inner.authenticate)(token)).await {
                Ok(Some(identity)) => identity,
                Ok(None) => {
                    if let Some(Err(blocked)) = source.map(|ip| limiter.failed(ip)) {
                        return blocked_reply(blocked);
                    }
                    return json_error(
                        StatusCode::UNAUTHORIZED,
                        "invalid, expired or revoked worker token",
                        "invalid_worker_token",
                    );
                }
                Err(_) => {
                    return json_error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "authentication timed out",
                        "handshake_timeout",
                    );
                }
            };
        let Some(on_upgrade) = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>() else {
            return json_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "this listener does not support connection upgrades",
                "upgrade_unsupported",
            );
        };
        let session = self.inner.next_session.fetch_add(1, Ordering::Relaxed);
        let up = TunnelUp {
            worker_id: identity.worker_id,
            cluster_id: identity.cluster_id,
            session,
            peer,
        };
        let server = self.clone();
        let span = tracing::info_span!("tunnel", worker = identity.worker_id, session, ?peer);
        self.inner.tasks.spawn(
            async move {
                let upgraded = match tokio::time::timeout_at(deadline, on_upgrade).await {
                    Ok(Ok(upgraded)) => upgraded,
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "tunnel upgrade failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!("tunnel upgrade timed out");
                        return;
                    }
                };
                slot.release();
                server.run_session(up, upgraded, dialect, cidrs).await;
            }
            .instrument(span),
        );

        let mut resp = Response::new(Full::new(Bytes::new()));
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let h = resp.headers_mut();
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        // GPUStack's client offered no subprotocol: none is chosen.
        if dialect == Dialect::Faden {
            h.insert(
                header::SEC_WEBSOCKET_PROTOCOL,
                HeaderValue::from_static(SUBPROTOCOL),
            );
        }
        if let Ok(accept) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) {
            h.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
        }
        resp
    }

    async fn run_session(
        &self,
        up: TunnelUp,
        upgraded: hyper::upgrade::Upgraded,
        dialect: Dialect,
        cidrs: Vec<ipnet::IpNet>,
    ) {
        let (transport, read_ahead) = take_transport(upgraded);
        let (link, task, moves) = match dialect {
            Dialect::Faden => {
                let moves = MoveSignal::default();
                let io = WsIo::new(
                    transport,
                    Endpoint::Server,
                    self.inner.config.liveness,
                    read_ahead,
                )
                .with_moves(moves.clone());
                let mux = mux::spawn(
                    io,
                    Role::Opener,
                    &self.inner.config.mux,
                    tracing::Span::current(),
                );
                (
                    Link::Mux(mux.handle.clone()),
                    SessionTask::Mux(mux),
                    Some(moves),
                )
            }
            Dialect::GpuStack => {
                let config = self.inner.config.gpustack.clone();
                let ws_config = WebSocketConfig::default()
                    .max_message_size(Some(config.max_message))
                    .max_frame_size(Some(config.max_message));
                let ws = WebSocketStream::from_partially_read(
                    transport,
                    read_ahead.to_vec(),
                    tokio_tungstenite::tungstenite::protocol::Role::Server,
                    Some(ws_config),
                )
                .await;
                let (link, drive) = GpuStackLink::start(ws, cidrs, config);
                // Ends with the tunnel; awaited below.
                let task = net::task::spawn(drive.instrument(tracing::Span::current()));
                (Link::GpuStack(link), SessionTask::GpuStack(task), None)
            }
        };
        let address = match &self.inner.lookup {
            Some(lookup) => {
                tokio::time::timeout(self.inner.config.lookup_timeout, lookup(up.worker_id))
                    .await
                    .ok()
                    .flatten()
            }
            None => None,
        };
        let worker = up.worker_id;
        let replaced = self.inner.sessions.write().insert(
            worker,
            Session {
                id: up.session,
                up: up.clone(),
                link: link.clone(),
                address,
                moves: moves.clone(),
            },
        );
        if self.inner.moving.is_cancelled()
            && let Some(moves) = &moves
        {
            // Up while this server asks every worker to leave (the handshake was under way).
            moves.request();
        }
        if let Some(old) = replaced {
            tracing::info!(
                old = old.id,
                "tunnel replaced by a new one of the same worker"
            );
            old.link.close();
        }
        tracing::info!("tunnel up");
        let _ = self.inner.events.send((worker, Some(up.clone())));

        tokio::select! {
            () = link.closed() => {}
            () = self.inner.shutdown.cancelled() => link.close(),
        }
        let ended = match task {
            SessionTask::Mux(mux) => mux.task.await,
            SessionTask::GpuStack(task) => task.await,
        };
        match ended {
            Ok(Ok(())) | Err(_) => {}
            Ok(Err(e)) => tracing::info!(error = %e, "tunnel connection failed"),
        }
        let removed = {
            let mut sessions = self.inner.sessions.write();
            match sessions.get(&worker) {
                Some(s) if s.id == up.session => sessions.remove(&worker).is_some(),
                _ => false,
            }
        };
        tracing::info!("tunnel down");
        self.inner.ended.notify_waiters();
        if removed {
            let _ = self.inner.events.send((worker, None));
        }
    }

    /// Opens a stream to `worker_id`'s worker proxy through its tunnel (faden's dialect; a
    /// GPUStack worker's tunnel is [`TunnelError::NotConnected`] here: see
    /// [`open_session`](Self::open_session)).
    pub async fn open_stream(&self, worker_id: i64) -> Result<TunnelStream, TunnelError> {
        let handle = match self.link(worker_id) {
            Some(Link::Mux(handle)) => handle,
            _ => return Err(TunnelError::NotConnected(worker_id)),
        };
        tokio::time::timeout(self.inner.config.open_timeout, handle.open_stream())
            .await
            .map_err(|_| TunnelError::OpenTimeout)?
    }

    /// Asks a GPUStack worker's tunnel client to connect to `ip:port` (one of its instances)
    /// and returns the session.
    pub async fn open_session(
        &self,
        worker_id: i64,
        ip: std::net::IpAddr,
        port: u16,
    ) -> Result<GpuStackStream, TunnelError> {
        match self.link(worker_id) {
            Some(Link::GpuStack(link)) => link.open(ip, port).await,
            _ => Err(TunnelError::NotConnected(worker_id)),
        }
    }

    /// The dialect of `worker_id`'s tunnel, when one is up.
    pub fn dialect(&self, worker_id: i64) -> Option<Dialect> {
        self.link(worker_id).map(|link| match link {
            Link::Mux(_) => Dialect::Faden,
            Link::GpuStack(_) => Dialect::GpuStack,
        })
    }

    fn link(&self, worker_id: i64) -> Option<Link> {
        self.inner
            .sessions
            .read()
            .get(&worker_id)
            .map(|s| s.link.clone())
    }

    /// Whether `worker_id` has a tunnel up.
    pub fn is_connected(&self, worker_id: i64) -> bool {
        self.inner.sessions.read().contains_key(&worker_id)
    }

    /// The tunnels up now.
    pub fn connected(&self) -> Vec<TunnelUp> {
        self.inner
            .sessions
            .read()
            .values()
            .map(|s| s.up.clone())
            .collect()
    }

    /// Tunnel tasks still running: tunnels up, ones being torn down (a replaced one until its
    /// connection has ended) and upgrades past authentication.
    pub fn running_tasks(&self) -> usize {
        self.inner.tasks.len()
    }

    /// A connected worker's registered address.
    pub fn address(&self, worker_id: i64) -> Option<WorkerAddress> {
        self.inner
            .sessions
            .read()
            .get(&worker_id)
            .and_then(|s| s.address.clone())
    }

    /// Updates a connected worker's registered address (say, after the worker re-registered
    /// with a new IP). Returns false when the worker has no tunnel.
    pub fn set_address(&self, worker_id: i64, address: Option<WorkerAddress>) -> bool {
        match self.inner.sessions.write().get_mut(&worker_id) {
            Some(s) => {
                s.address = address;
                true
            }
            None => false,
        }
    }

    /// The connected worker registered at exactly `host:port` (host compared canonically).
    pub fn worker_at(&self, host: &str, port: u16) -> Option<i64> {
        let wanted = WorkerAddress::new(host, port);
        self.inner
            .sessions
            .read()
            .iter()
            .find(|(_, s)| s.address.as_ref() == Some(&wanted))
            .map(|(&w, _)| w)
    }

    /// The connected worker of GPUStack's dialect registered at `host` (compared canonically),
    /// whatever its worker port: GPUStack's proxy port names such a worker by its instances'
    /// addresses, `<worker ip>:<instance port>`.
    pub fn gpustack_worker_at(&self, host: &str) -> Option<i64> {
        let wanted = canonical_host(host);
        self.inner
            .sessions
            .read()
            .iter()
            .find(|(_, s)| {
                matches!(s.link, Link::GpuStack(_))
                    && s.address.as_ref().is_some_and(|a| a.host == wanted)
            })
            .map(|(&w, _)| w)
    }

    /// Closes one worker's tunnel (the worker will reconnect).
    pub fn disconnect(&self, worker_id: i64) -> bool {
        match self.inner.sessions.read().get(&worker_id) {
            Some(s) => {
                s.link.close();
                true
            }
            None => false,
        }
    }

    /// Takes tunnels from now on (see [`TunnelServerBuilder::starting`]).
    pub fn set_ready(&self) {
        self.inner.ready.store(true, Ordering::Release);
    }

    /// Refuses new tunnels, closes every tunnel, and returns once their tasks ended and every
    /// down change was delivered.
    pub async fn shutdown(&self) {
        self.inner.shutdown.cancel();
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
        self.inner.sessions_done.cancel();
        let notifier = self.inner.notifier.lock().take();
        if let Some(notifier) = notifier {
            let _ = notifier.await;
        }
    }
}

/// The task driving a tunnel, by dialect.
enum SessionTask {
    Mux(mux::Mux),
    GpuStack(tokio::task::JoinHandle<Result<(), TunnelError>>),
}

/// The socket under a server-side tunnel: the connection itself, plain or TLS, when the API
/// listener served it with HTTP/1 (`net::listener` does); `Upgraded` otherwise.
type Transport = Either<ListenerSocket, TokioIo<Upgraded>>;

/// `upgraded` as a [`Transport`], and the bytes hyper read past the upgrade request (the start
/// of the first frames).
fn take_transport(upgraded: Upgraded) -> (Transport, BytesMut) {
    match net::relay::take_socket(upgraded) {
        Ok((socket, read_ahead)) => (Either::Left(socket), BytesMut::from(read_ahead)),
        // hyper serves any bytes read past the request from inside `Upgraded`.
        Err(upgraded) => (Either::Right(TokioIo::new(upgraded)), BytesMut::new()),
    }
}

#[cfg(test)]
mod tests;
