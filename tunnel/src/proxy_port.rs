//! The proxy port (GPUStack's `--proxy-port`, default 30079): an HTTP/1.1 proxy that relays to
//! tunnel workers, for gateways outside this process.
//!
//! Every request is first made a route: a connected worker and a [`Target`] on it.
//! - origin-form with `X-GPUStack-Model-Instance: model-<m>-<instance>.static`, and `CONNECT
//!   model-<m>-<instance>.static:0`: the instance (its worker, from the caller's instance
//!   lookup, must have a tunnel up);
//! - absolute-form `http://<worker host>:<worker port>/...` and `CONNECT <worker host>:<worker
//!   port>`: the worker's proxy (faden workers);
//! - absolute-form and `CONNECT` to `<worker ip>:<instance port>` (what GPUStack's own proxy
//!   port takes): that instance, when the port is one of a GPUStack worker's routable
//!   instances.
//!
//! Then the tunnel's [`Connector`] does the rest, whichever dialect the worker speaks: a
//! `CONNECT` gets 200 and a byte relay over a stream to the target (each direction's end passed
//! on separately), or the worker proxy's own refusal (404, 502) as it gave it; any other request
//! goes to the target on kept-alive streams. To an instance it goes as the gateway's own tunnel
//! transport sends it: origin-form, `Host: 127.0.0.1:<port>`, the worker credential on the
//! relay's `CONNECT` only; neither the caller's key nor the credential reaches the engine.
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
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use net::admission::AuthLimiter;
use net::config::ListenerConfig;
use net::headers::{X_GPUSTACK_MODEL_INSTANCE, strip_hop_by_hop};
use net::pool::{PoolConfig, PooledBody, Prepared};
use net::relay::Relays;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::connector::{ConnectError, Connector, Instance, Opened, Target, engine_host};
use crate::http::to_origin_form;
use crate::server::{Dialect, TunnelServer, canonical_host, json_error};
use crate::target::{parse_instance_name, parse_relay_target};

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

/// Response bodies: a local answer, the target's, or a worker proxy's refusal of a relay.
pub type ProxyBody = Either<Full<Bytes>, Either<PooledBody, Incoming>>;

/// Idle kept-alive streams per target, at most.
const MAX_IDLE_PER_TARGET: usize = 512;

/// A kept-alive stream unused for longer than this is closed: below the engines' own
/// keep-alive (uvicorn: 5 s), as the gateway's tunnel transport does.
const IDLE_TIMEOUT: Duration = Duration::from_secs(3);

/// The proxy. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ProxyPort {
    connector: Connector,
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
        let pool = PoolConfig {
            // Streams are opened, not dialled: the tunnel's own liveness bounds them.
            connect_timeout: Duration::from_secs(10),
            idle_timeout: IDLE_TIMEOUT,
            max_idle: MAX_IDLE_PER_TARGET,
        };
        Self {
            connector: Connector::new(server, pool),
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
        let (worker, target) = match self.route(&req) {
            Ok(route) => route,
            Err(resp) => return resp,
        };
        if req.method() == Method::CONNECT {
            self.connect(req, worker, target).await
        } else {
            self.forward(req, worker, target).await
        }
    }

    /// The worker and the target on it that a request names, or a refusal.
    #[allow(clippy::result_large_err)]
    fn route(&self, req: &Request<Incoming>) -> Result<(i64, Target), Response<ProxyBody>> {
        let authority = req.uri().authority().map(|a| a.as_str());
        if req.method() == Method::CONNECT {
            if let Some(instance) = authority.and_then(parse_relay_target) {
                let model = authority
                    .and_then(parse_instance_name)
                    .map_or(0, |(model, _)| model);
                return self.instance(model, instance);
            }
            return self.target(authority, None);
        }
        if req.uri().scheme().is_some() || authority.is_some() {
            if req.uri().scheme_str() != Some("http") {
                return Err(refuse(
                    StatusCode::BAD_REQUEST,
                    "only http:// targets can be relayed",
                    "bad_request",
                ));
            }
            return self.target(authority, Some(80));
        }
        let name = req
            .headers()
            .get(X_GPUSTACK_MODEL_INSTANCE)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_instance_name);
        let Some((model, instance)) = name else {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "origin-form requests need X-GPUStack-Model-Instance: model-<model id>-<instance id>.static",
                "bad_request",
            ));
        };
        self.instance(model, instance)
    }

    /// A model instance by id: its connected worker, or a refusal.
    #[allow(clippy::result_large_err)]
    fn instance(&self, model: i64, id: i64) -> Result<(i64, Target), Response<ProxyBody>> {
        match (self.config.instance_worker)(id) {
            Some((worker, port)) if self.connector.server().is_connected(worker) => {
                let instance = Instance {
                    model,
                    id,
                    port,
                    ip: None,
                };
                Ok((worker, Target::Instance(instance)))
            }
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

    /// Maps a `CONNECT`/absolute-form authority to what it may reach, or refuses.
    #[allow(clippy::result_large_err)]
    fn target(
        &self,
        authority: Option<&str>,
        default_port: Option<u16>,
    ) -> Result<(i64, Target), Response<ProxyBody>> {
        let Some((host, port)) = authority.and_then(|a| parse_target(a, default_port)) else {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "invalid target: expected <worker ip>:<worker port>",
                "invalid_target",
            ));
        };
        let server = self.connector.server();
        let faden = server
            .worker_at(&host, port)
            .filter(|&w| server.dialect(w) == Some(Dialect::Faden));
        if let Some(worker) = faden {
            return Ok((worker, Target::Proxy));
        }
        let gpustack = server
            .gpustack_worker_at(&host)
            .filter(|&w| (self.config.instance_on_port)(w, port));
        if let Some(worker) = gpustack {
            let instance = Instance {
                model: 0,
                id: 0,
                port,
                ip: host.parse().ok(),
            };
            return Ok((worker, Target::Instance(instance)));
        }
        Err(refuse(
            StatusCode::FORBIDDEN,
            "target is not a connected tunnel worker: this proxy relays only to the worker port of workers whose tunnel is up, or to a running instance of a GPUStack worker whose tunnel is up",
            "target_not_allowed",
        ))
    }

    /// The credential for the worker's proxy: the configured one, else the caller's
    /// `Authorization` when `Proxy-Authorization` authenticated this hop.
    fn credential(&self, req: &Request<Incoming>) -> Option<HeaderValue> {
        match &self.config.worker_authorization {
            Some(v) => Some(v.clone()),
            None if req.headers().contains_key(header::PROXY_AUTHORIZATION) => {
                req.headers().get(header::AUTHORIZATION).cloned()
            }
            None => None,
        }
    }

    /// Any request but a `CONNECT`: to the target on a kept-alive stream.
    async fn forward(
        &self,
        mut req: Request<Incoming>,
        worker: i64,
        target: Target,
    ) -> Response<ProxyBody> {
        let credential = self.credential(&req);
        let origin_form = req.uri().authority().is_none();
        strip_hop_by_hop(req.headers_mut());
        let headers = req.headers_mut();
        headers.remove(header::AUTHORIZATION);
        match (target, &credential) {
            // The worker's proxy checks the credential per request.
            (Target::Proxy, Some(credential)) => {
                headers.insert(header::AUTHORIZATION, credential.clone());
            }
            (Target::Proxy, None) => {}
            (Target::Instance(instance), _) => {
                headers.remove(X_GPUSTACK_MODEL_INSTANCE);
                if origin_form {
                    headers.insert(header::HOST, engine_host(instance.port));
                }
            }
        }
        if to_origin_form(&mut req, None).is_err() {
            return refuse(
                StatusCode::BAD_REQUEST,
                "invalid request target",
                "bad_request",
            );
        }
        let prepared = match Prepared::new(req) {
            Ok(prepared) => prepared,
            Err(e) => {
                tracing::debug!(worker, error = %e, "proxy port: request not sent");
                return refuse(
                    StatusCode::BAD_REQUEST,
                    "reading the request body failed",
                    "bad_request",
                );
            }
        };
        let sent = self
            .connector
            .send(worker, target, prepared, credential.as_ref())
            .await;
        match sent {
            Ok(answer) => {
                let (mut head, body) = answer.into_parts();
                strip_hop_by_hop(&mut head.headers);
                Response::from_parts(head, Either::Right(body))
            }
            Err(e) => failed(worker, &e),
        }
    }

    /// A `CONNECT`: 200 and a byte relay over a stream to the target, or the worker proxy's
    /// refusal.
    async fn connect(
        &self,
        mut req: Request<Incoming>,
        worker: i64,
        target: Target,
    ) -> Response<ProxyBody> {
        let credential = self.credential(&req);
        match self
            .connector
            .open(worker, target, credential.as_ref())
            .await
        {
            Ok(Opened::Stream(stream)) => {
                self.relays.spawn(&mut req, stream.into_relay_io());
                Response::new(Either::Left(Full::new(Bytes::new())))
            }
            Ok(Opened::Answered(answer)) => {
                let (mut head, body) = answer.into_parts();
                strip_hop_by_hop(&mut head.headers);
                Response::from_parts(head, Either::Right(Either::Right(body)))
            }
            Err(e) => failed(worker, &e),
        }
    }
}

/// The answer for a request the connector could not take to its target.
fn failed(worker: i64, e: &ConnectError) -> Response<ProxyBody> {
    tracing::debug!(worker, error = %e, "proxy port: not relayed");
    match e {
        ConnectError::GoingAway => {
            // Nothing started: marked as the worker proxy marks an instance it does not have,
            // so that the gateway tries another instance.
            let mut resp = refuse(
                StatusCode::NOT_FOUND,
                "the worker is going away: its tunnel takes no new streams",
                "worker_going_away",
            );
            resp.headers_mut().insert(
                net::headers::X_FADEN_NO_SUCH_INSTANCE,
                HeaderValue::from_static("1"),
            );
            resp
        }
        ConnectError::NoAddress => refuse(
            StatusCode::BAD_GATEWAY,
            "the worker's address is not an IP: its GPUStack tunnel cannot dial it",
            "tunnel_unavailable",
        ),
        ConnectError::Tunnel(_) | ConnectError::NoProxy => refuse(
            StatusCode::BAD_GATEWAY,
            "the worker's tunnel is not available",
            "tunnel_unavailable",
        ),
        ConnectError::Relay(_) | ConnectError::Refused(_) => refuse(
            StatusCode::BAD_GATEWAY,
            "the worker failed before answering",
            "upstream_protocol",
        ),
        ConnectError::Pool(_) => refuse(
            StatusCode::BAD_GATEWAY,
            "the model instance failed before answering (through the tunnel)",
            "upstream_protocol",
        ),
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
