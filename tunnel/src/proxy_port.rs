//! The proxy port (GPUStack's `--proxy-port`, default 30079): an HTTP/1.1 proxy that relays to
//! tunnel workers, for gateways outside this process.
//!
//! Four request shapes, each relayed over a yamux stream to one connected worker's proxy:
//! - origin-form with `X-GPUStack-Model-Instance: model-<m>-<instance>.static`: the instance's
//!   worker (from the caller's instance lookup) must have a tunnel up;
//! - absolute-form `http://<worker host>:<worker port>/...`;
//! - `CONNECT <worker host>:<worker port>`: 200, then bytes are copied both ways over a stream,
//!   each direction's end (FIN) passed on separately;
//! - `CONNECT model-<m>-<instance>.static:0`: the same `CONNECT` goes on to the instance's
//!   worker over a stream (with the worker credential), and the worker relays to the instance
//!   itself; its answer comes back as it is (200, then bytes both ways with the engine; or its
//!   404/502).
//!
//! A GPUStack worker's tunnel (its own dialect) takes every shape, with instances as targets:
//! origin-form and `CONNECT model-…` as above, and absolute-form or `CONNECT` to `<worker
//! ip>:<instance port>` (what GPUStack's own proxy port takes) when that port is one of the
//! worker's routable instances. The proxy asks the worker's tunnel client for a session to the
//! instance and speaks HTTP/1.1 to the engine over it, or relays the `CONNECT`'s bytes over it;
//! neither the caller's key nor the worker credential goes to the engine.
//!
//! It is never an open relay: it dials nothing itself. Every relay goes through a worker's
//! tunnel, and `CONNECT`/absolute-form targets must equal a connected worker's registered
//! address and worker port (or, for GPUStack's dialect, a routable instance's port) exactly
//! (hosts compared canonically; loopback, private, link-local
//! and metadata addresses, host names, IPv6 forms and percent-encoded hosts match nothing
//! unless a connected worker registered exactly that). Callers authenticate with
//! `Proxy-Authorization: Bearer <key>` (or `Authorization`), else 407; a source address that
//! presented refused keys too often gets 429 with `Retry-After` before its key is checked.
//!
//! Connections are accepted by the gateway's listener ([`net::listener`]), HTTP/1 only and
//! with upgrades for `CONNECT`: the same pending-connection caps and head deadline as every
//! other listener, and the same refusal of requests carrying both `Content-Length` and
//! `Transfer-Encoding`.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use crate::target::{parse_instance_id, parse_relay_target};
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use net::admission::AuthLimiter;
use net::config::ListenerConfig;
use net::headers::{X_GPUSTACK_MODEL_INSTANCE, strip_hop_by_hop};
use net::relay::{Relays, with_read_ahead};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::gpustack_link::GpuStackStream;
use crate::http::Relayed;
use crate::http::to_origin_form;
use crate::server::{Dialect, TunnelServer, canonical_host, json_error};

/// The default proxy port.
pub const DEFAULT_PROXY_PORT: u16 = 30079;

/// Checks a presented key (data-plane scope).
pub type KeyCheck = Arc<dyn Fn(&str) -> bool + Send + Sync>;
/// Finds the worker that hosts a model instance, and the instance's port: `(worker id, port)`.
pub type InstanceLookup = Arc<dyn Fn(i64) -> Option<(i64, u16)> + Send + Sync>;
/// Whether a worker hosts a routable instance on a port: `(worker id, port)`.
pub type InstancePortCheck = Arc<dyn Fn(i64, u16) -> bool + Send + Sync>;

/// Proxy port settings.
#[derive(Clone)]
pub struct ProxyPortConfig {
    /// Verifies `Proxy-Authorization`/`Authorization` bearer keys.
    pub authorize: KeyCheck,
    /// Instance id → (worker id, instance port), for origin-form requests and instance
    /// `CONNECT`s.
    pub instance_worker: InstanceLookup,
    /// For `CONNECT`/absolute-form targets `<worker ip>:<instance port>` of GPUStack-dialect
    /// workers (the form GPUStack's own proxy port takes): only a routable instance's port
    /// passes. Default: none does.
    pub instance_on_port: InstancePortCheck,
    /// When set, relayed requests carry this `Authorization` (the credential worker proxies
    /// accept) instead of the caller's.
    pub worker_authorization: Option<HeaderValue>,
    /// Head deadline, header size, connection and pending caps, failed-authentication limits;
    /// `drain_timeout` also bounds open `CONNECT` relays after shutdown starts.
    pub listener: ListenerConfig,
}

impl std::fmt::Debug for ProxyPortConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyPortConfig")
            .field("listener", &self.listener)
            .finish_non_exhaustive()
    }
}

impl ProxyPortConfig {
    pub fn new(authorize: KeyCheck, instance_worker: InstanceLookup) -> Self {
        Self {
            authorize,
            instance_worker,
            instance_on_port: Arc::new(|_, _| false),
            worker_authorization: None,
            listener: ListenerConfig::default(),
        }
    }
}

/// Where a `CONNECT`/absolute-form target leads.
enum Relay {
    /// A faden worker's reverse proxy, over a stream of its tunnel.
    WorkerProxy(i64),
    /// One instance of a GPUStack worker, over a session of its tunnel.
    Instance { worker: i64, port: u16 },
}

/// Response bodies: a local answer, or the worker's streamed one.
pub type ProxyBody = Either<Full<Bytes>, Incoming>;

/// The proxy. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ProxyPort {
    server: TunnelServer,
    config: Arc<ProxyPortConfig>,
    auth_limiter: Arc<AuthLimiter>,
    relays: Relays,
}

fn local(resp: Response<Full<Bytes>>) -> Response<ProxyBody> {
    resp.map(Either::Left)
}

fn refuse(status: StatusCode, message: &str, code: &str) -> Response<ProxyBody> {
    local(json_error(status, message, code))
}

/// A `CONNECT`/absolute-form target, strictly parsed: an IPv4 address, a bracketed IPv6
/// address (no zone) or a plain DNS name, and a port. Anything else (userinfo, percent
/// signs, empty parts) is refused before any lookup. The host comes back canonical (an IP in
/// `IpAddr`'s display form, a name in lowercase). Public only for fuzzing.
#[doc(hidden)]
pub fn parse_target(authority: &str, default_port: Option<u16>) -> Option<(String, u16)> {
    if authority.is_empty() || authority.contains(['@', '%', '\\', '/', ' ']) {
        return None;
    }
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        let ip: Ipv6Addr = v6.parse().ok()?;
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p),
            None if after.is_empty() => None,
            None => return None,
        };
        (IpAddr::V6(ip).to_string(), port)
    } else {
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        };
        let valid_name = !host.is_empty()
            && host.len() <= 253
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
        if !valid_name {
            return None;
        }
        (canonical_host(host), port)
    };
    let port = match port {
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => p.parse().ok()?,
        Some(_) => return None,
        None => default_port?,
    };
    (port != 0).then_some((host, port))
}

/// The key presented in `Proxy-Authorization`, else `Authorization` (bearer).
fn presented(req: &Request<Incoming>) -> Option<&str> {
    let bearer = |name| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(net::headers::bearer)
    };
    bearer(header::PROXY_AUTHORIZATION).or_else(|| bearer(header::AUTHORIZATION))
}

impl ProxyPort {
    pub fn new(server: TunnelServer, config: ProxyPortConfig) -> Self {
        Self {
            server,
            auth_limiter: Arc::new(AuthLimiter::new(config.listener.auth)),
            config: Arc::new(config),
            relays: Relays::new(),
        }
    }

    /// Serves until `shutdown` fires, then drains for up to `drain_timeout` and returns.
    pub async fn serve(&self, listener: TcpListener, shutdown: CancellationToken) {
        let proxy = self.clone();
        let handler = move |req, peer| {
            let proxy = proxy.clone();
            async move { proxy.handle(req, peer).await }
        };
        let options = net::listener::ServeOptions {
            http1_only: true,
            upgrades: true,
            ..Default::default()
        };
        net::listener::serve_with(
            listener,
            &self.config.listener,
            options,
            handler,
            shutdown,
            || {},
        )
        .await;
        // Upgraded (`CONNECT`) connections left hyper: their relays drain here.
        self.relays
            .drain(self.config.listener.drain_timeout, "proxy port")
            .await;
    }

    fn authorized(&self, req: &Request<Incoming>) -> bool {
        presented(req).is_some_and(|k| (self.config.authorize)(k))
    }

    /// Answers one request from `peer`.
    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
        if !self.authorized(&req) {
            if presented(&req).is_some()
                && let Err(blocked) = self.auth_limiter.failed(peer.ip())
            {
                return local(crate::server::blocked_reply(blocked));
            }
            let mut resp = refuse(
                StatusCode::PROXY_AUTHENTICATION_REQUIRED,
                "missing or invalid key: send Proxy-Authorization: Bearer <key>",
                "invalid_api_key",
            );
            resp.headers_mut().insert(
                header::PROXY_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            );
            return resp;
        }
        if req.method() == Method::CONNECT {
            return self.connect(req).await;
        }
        let worker = if req.uri().scheme().is_some() || req.uri().authority().is_some() {
            if req.uri().scheme_str() != Some("http") {
                return refuse(
                    StatusCode::BAD_REQUEST,
                    "only http:// targets can be relayed",
                    "bad_request",
                );
            }
            match self.target(req.uri().authority().map(|a| a.as_str()), Some(80)) {
                Ok(Relay::WorkerProxy(w)) => w,
                Ok(Relay::Instance { worker, port }) => {
                    return self.forward_session(worker, port, req).await;
                }
                Err(resp) => return resp,
            }
        } else {
            let instance = req
                .headers()
                .get(X_GPUSTACK_MODEL_INSTANCE)
                .and_then(|v| v.to_str().ok())
                .and_then(parse_instance_id);
            let Some(instance) = instance else {
                return refuse(
                    StatusCode::BAD_REQUEST,
                    "origin-form requests need X-GPUStack-Model-Instance: model-<model id>-<instance id>.static",
                    "bad_request",
                );
            };
            match self.instance_worker(instance) {
                Ok((w, port)) if self.server.dialect(w) == Some(Dialect::GpuStack) => {
                    return self.forward_session(w, port, req).await;
                }
                Ok((w, _)) => w,
                Err(resp) => return resp,
            }
        };
        self.forward(worker, req).await
    }

    /// A session of a GPUStack worker's tunnel to its instance on `port`.
    async fn session(&self, worker: i64, port: u16) -> Result<GpuStackStream, Response<ProxyBody>> {
        let ip = self
            .server
            .address(worker)
            .and_then(|a| a.host.parse::<IpAddr>().ok());
        let Some(ip) = ip else {
            return Err(refuse(
                StatusCode::BAD_GATEWAY,
                "the worker's address is not an IP: its GPUStack tunnel cannot dial it",
                "tunnel_unavailable",
            ));
        };
        self.server
            .open_session(worker, ip, port)
            .await
            .map_err(|e| {
                tracing::debug!(worker, error = %e, "proxy port: no GPUStack session");
                refuse(
                    StatusCode::BAD_GATEWAY,
                    "the worker's tunnel did not connect to the instance",
                    "tunnel_unavailable",
                )
            })
    }

    /// Origin-form to a GPUStack worker's instance: HTTP/1.1 to the engine over a session.
    async fn forward_session(
        &self,
        worker: i64,
        port: u16,
        mut req: Request<Incoming>,
    ) -> Response<ProxyBody> {
        strip_hop_by_hop(req.headers_mut());
        req.headers_mut().remove(header::AUTHORIZATION);
        req.headers_mut().remove(X_GPUSTACK_MODEL_INSTANCE);
        if to_origin_form(&mut req, None).is_err() {
            return refuse(
                StatusCode::BAD_REQUEST,
                "invalid request target",
                "bad_request",
            );
        }
        req.headers_mut().remove(X_GPUSTACK_MODEL_INSTANCE);
        let session = match self.session(worker, port).await {
            Ok(s) => s,
            Err(resp) => return resp,
        };
        let sent = async {
            crate::http::handshake_io(TokioIo::new(session))
                .await?
                .send_request(req)
                .await
        };
        match sent.await {
            Ok(resp) => {
                let (mut head, body) = resp.into_parts();
                strip_hop_by_hop(&mut head.headers);
                Response::from_parts(head, Either::Right(body))
            }
            Err(e) => {
                tracing::debug!(worker, error = %e, "proxy port: session failed");
                refuse(
                    StatusCode::BAD_GATEWAY,
                    "the model instance failed before answering (through the tunnel)",
                    "upstream_protocol",
                )
            }
        }
    }

    /// Maps a `CONNECT`/absolute-form authority to what it may reach, or refuses.
    #[allow(clippy::result_large_err)]
    fn target(
        &self,
        authority: Option<&str>,
        default_port: Option<u16>,
    ) -> Result<Relay, Response<ProxyBody>> {
        let Some((host, port)) = authority.and_then(|a| parse_target(a, default_port)) else {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "invalid target: expected <worker ip>:<worker port>",
                "invalid_target",
            ));
        };
        let faden = self
            .server
            .worker_at(&host, port)
            .filter(|&w| self.server.dialect(w) == Some(Dialect::Faden));
        if let Some(worker) = faden {
            return Ok(Relay::WorkerProxy(worker));
        }
        let gpustack = self
            .server
            .gpustack_worker_at(&host)
            .filter(|&w| (self.config.instance_on_port)(w, port));
        if let Some(worker) = gpustack {
            return Ok(Relay::Instance { worker, port });
        }
        Err(refuse(
            StatusCode::FORBIDDEN,
            "target is not a connected tunnel worker: this proxy relays only to the worker port of workers whose tunnel is up, or to a running instance of a GPUStack worker whose tunnel is up",
            "target_not_allowed",
        ))
    }

    async fn forward(&self, worker: i64, mut req: Request<Incoming>) -> Response<ProxyBody> {
        let from_proxy_header = req.headers().contains_key(header::PROXY_AUTHORIZATION);
        strip_hop_by_hop(req.headers_mut());
        match &self.config.worker_authorization {
            Some(v) => {
                req.headers_mut().insert(header::AUTHORIZATION, v.clone());
            }
            // The key authenticated this hop: it does not go further.
            None if !from_proxy_header => {
                req.headers_mut().remove(header::AUTHORIZATION);
            }
            None => {}
        }
        if to_origin_form(&mut req, None).is_err() {
            return refuse(
                StatusCode::BAD_REQUEST,
                "invalid request target",
                "bad_request",
            );
        }
        let stream = match self.open(worker).await {
            Ok(s) => s,
            Err(resp) => return resp,
        };
        match crate::http::send_request(stream, req).await {
            Ok(resp) => {
                let (mut head, body) = resp.into_parts();
                strip_hop_by_hop(&mut head.headers);
                Response::from_parts(head, Either::Right(body))
            }
            Err(e) => {
                tracing::debug!(worker, error = %e, "proxy port: relay failed");
                refuse(
                    StatusCode::BAD_GATEWAY,
                    "the worker failed before answering",
                    "upstream_protocol",
                )
            }
        }
    }

    /// Maps an instance id to its connected worker, or refuses.
    #[allow(clippy::result_large_err)]
    fn instance_worker(&self, instance: i64) -> Result<(i64, u16), Response<ProxyBody>> {
        match (self.config.instance_worker)(instance) {
            Some((w, port)) if self.server.is_connected(w) => Ok((w, port)),
            Some(_) => Err(refuse(
                StatusCode::BAD_GATEWAY,
                "the worker hosting this model instance has no tunnel connected",
                "tunnel_unavailable",
            )),
            None => Err(refuse(
                StatusCode::NOT_FOUND,
                "unknown model instance",
                "model_instance_not_found",
            )),
        }
    }

    async fn open(&self, worker: i64) -> Result<crate::TunnelStream, Response<ProxyBody>> {
        self.server.open_stream(worker).await.map_err(|e| {
            tracing::debug!(worker, error = %e, "proxy port: no stream");
            if matches!(e, crate::TunnelError::GoingAway) {
                // Nothing started: marked as the worker proxy marks an instance it does not
                // have, so that the gateway tries another instance.
                let mut resp = refuse(
                    StatusCode::NOT_FOUND,
                    "the worker is going away: its tunnel takes no new streams",
                    "worker_going_away",
                );
                resp.headers_mut().insert(
                    net::headers::X_FADEN_NO_SUCH_INSTANCE,
                    http::HeaderValue::from_static("1"),
                );
                return resp;
            }
            refuse(
                StatusCode::BAD_GATEWAY,
                "the worker's tunnel is not available",
                "tunnel_unavailable",
            )
        })
    }

    /// `CONNECT model-<m>-<i>.static:0`: the worker hosting the instance relays to it.
    async fn connect_instance(
        &self,
        mut req: Request<Incoming>,
        instance: i64,
    ) -> Response<ProxyBody> {
        let worker = match self.instance_worker(instance) {
            Ok((w, port)) if self.server.dialect(w) == Some(Dialect::GpuStack) => {
                return self.connect_session(req, w, port).await;
            }
            Ok((w, _)) => w,
            Err(resp) => return resp,
        };
        let stream = match self.open(worker).await {
            Ok(s) => s,
            Err(resp) => return resp,
        };
        let target = req.uri().clone();
        let authorization = self.config.worker_authorization.clone();
        match crate::http::connect_instance(stream, target, authorization).await {
            Ok(crate::http::Connected::Relay(relayed)) => {
                match relayed {
                    // The usual case: the relay copies straight between the two streams.
                    Relayed::Stream { stream, read_ahead } if read_ahead.is_empty() => {
                        self.relays.spawn(&mut req, stream);
                    }
                    // The worker sent bytes right behind its answer: they go first.
                    Relayed::Stream { stream, read_ahead } => {
                        self.relays
                            .spawn(&mut req, with_read_ahead(stream, read_ahead));
                    }
                    Relayed::Other(upgraded) => self.relays.spawn(&mut req, TokioIo::new(upgraded)),
                }
                Response::new(Either::Left(Full::new(Bytes::new())))
            }
            Ok(crate::http::Connected::Refused(resp)) => {
                let (mut head, body) = resp.into_parts();
                strip_hop_by_hop(&mut head.headers);
                Response::from_parts(head, Either::Right(body))
            }
            Err(e) => {
                tracing::debug!(worker, error = %e, "proxy port: relay request failed");
                refuse(
                    StatusCode::BAD_GATEWAY,
                    "the worker failed before answering",
                    "upstream_protocol",
                )
            }
        }
    }

    /// A `CONNECT` to a GPUStack worker's instance: the session is the relay, the engine's
    /// bytes both ways.
    async fn connect_session(
        &self,
        mut req: Request<Incoming>,
        worker: i64,
        port: u16,
    ) -> Response<ProxyBody> {
        match self.session(worker, port).await {
            Ok(session) => {
                self.relays.spawn(&mut req, session);
                Response::new(Either::Left(Full::new(Bytes::new())))
            }
            Err(resp) => resp,
        }
    }

    async fn connect(&self, mut req: Request<Incoming>) -> Response<ProxyBody> {
        if let Some(instance) = req
            .uri()
            .authority()
            .and_then(|a| parse_relay_target(a.as_str()))
        {
            return self.connect_instance(req, instance).await;
        }
        let worker = match self.target(req.uri().authority().map(|a| a.as_str()), None) {
            Ok(Relay::WorkerProxy(w)) => w,
            Ok(Relay::Instance { worker, port }) => {
                return self.connect_session(req, worker, port).await;
            }
            Err(resp) => return resp,
        };
        let stream = match self.open(worker).await {
            Ok(s) => s,
            Err(resp) => return resp,
        };
        self.relays.spawn(&mut req, stream);
        Response::new(Either::Left(Full::new(Bytes::new())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_targets_strictly() {
        let p = |s: &str| parse_target(s, None);
        assert_eq!(p("10.0.0.5:10150"), Some(("10.0.0.5".into(), 10150)));
        assert_eq!(p("[fd00::1]:10150"), Some(("fd00::1".into(), 10150)));
        assert_eq!(p("[FD00:0::1]:1"), Some(("fd00::1".into(), 1)));
        assert_eq!(p("Worker-1.Lan:80"), Some(("worker-1.lan".into(), 80)));
        assert_eq!(
            parse_target("10.0.0.5", Some(80)),
            Some(("10.0.0.5".into(), 80))
        );
        for bad in [
            "10.0.0.5",
            "10.0.0.5:",
            "10.0.0.5:0",
            "10.0.0.5:99999",
            "10.0.0.5:+80",
            "%31%30.0.0.5:80",
            "10.0.0.5%2f:80",
            "user@10.0.0.5:80",
            "[::1%25eth0]:80",
            "[::1]x:80",
            "::1:80",
            "",
            ":80",
            "a_b:80",
        ] {
            assert_eq!(p(bad), None, "{bad}");
        }
    }
}
