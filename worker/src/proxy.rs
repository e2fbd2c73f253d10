//! The worker reverse proxy: listens on the worker port and forwards to the model instances of
//! this worker, chosen by `X-GPUStack-Model-Instance`.
//!
//! It is never an open proxy: it dials only `127.0.0.1:<port>` of an instance registered in its
//! [`LocalInstances`], whatever the request's URI or `Host` say. Callers must present one of the
//! configured credentials (`Authorization: Bearer` or `X-API-Key`), compared in constant time; a
//! source address that presented wrong credentials too often gets 429 with `Retry-After` before
//! its credential is compared (see [`net::admission::AuthLimiter`]).
//! Only GET, POST, OPTIONS and HEAD are forwarded, and only origin-form targets (an HTTP/1
//! absolute-form target gets 400); both bodies stream (nothing is buffered). An unknown instance
//! gets a JSON 404 marked with [`X_FADEN_NO_SUCH_INSTANCE`], so the gateway knows no work started
//! and may try another instance.
//!
//! **Instance relay.** `CONNECT model-<model id>-<instance id>.static:0` (see
//! [`tunnel::target::relay_target`]), after the same credential check, answers 200 and then copies bytes both
//! ways between the connection and a new TCP connection to the instance's `127.0.0.1:<port>`
//! (`TCP_NODELAY`, each direction's end passed on separately, 8 KiB buffers per direction): the
//! caller then speaks HTTP/1.1 to the engine itself, and this proxy does no HTTP work per
//! request. An unregistered instance gets the same marked 404, an instance that does not accept
//! the connection within the connect timeout 502. Any other `CONNECT` target gets 405, as
//! before the relay existed: this is never an open relay.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use control_client::tokens;
use http::{HeaderValue, Method, Request, Response, StatusCode, Uri, header};
use http_body_util::{BodyExt as _, Full, combinators::UnsyncBoxBody};
use hyper::body::Incoming;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use net::config::ListenerConfig;
use net::headers::{self, X_FADEN_NO_SUCH_INSTANCE, X_GPUSTACK_MODEL_INSTANCE};
use net::headers::{X_API_KEY, presented_key};
use net::pool::{Pool, PoolConfig};
use net::relay::{Relays, TakeOver};
use net::{BoxError, error_body};
use tunnel::target::{parse_instance_id, parse_relay_target};

/// The instances this worker hosts: instance id → local port. Cheap to clone; clones share.
#[derive(Clone, Debug, Default)]
pub struct LocalInstances {
    ports: Arc<ArcSwap<HashMap<i64, u16>>>,
}

impl LocalInstances {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers (or moves) an instance.
    pub fn insert(&self, instance_id: i64, port: u16) {
        self.ports.rcu(|m| {
            let mut m = HashMap::clone(m);
            m.insert(instance_id, port);
            m
        });
    }

    /// Unregisters an instance.
    pub fn remove(&self, instance_id: i64) {
        self.ports.rcu(|m| {
            let mut m = HashMap::clone(m);
            m.remove(&instance_id);
            m
        });
    }

    /// Replaces the whole set.
    pub fn replace(&self, ports: HashMap<i64, u16>) {
        self.ports.store(Arc::new(ports));
    }

    /// The local port of an instance.
    pub fn port(&self, instance_id: i64) -> Option<u16> {
        self.ports.load().get(&instance_id).copied()
    }
}

/// Worker proxy settings.
#[derive(Clone, Debug)]
pub struct WorkerProxyConfig {
    pub listener: ListenerConfig,
    /// Accepted bearer credentials (the worker token, the cluster registration token, the
    /// gateway's worker credential).
    pub credentials: Vec<String>,
    /// Whether requests must present one of `credentials`. Off only where the transport itself
    /// is authenticated: streams of a worker's own tunnel, which only the server it dialled (and
    /// authenticated with its token) can open.
    pub require_credential: bool,
    /// Connect timeout to a local instance.
    pub connect_timeout: Duration,
    /// Pooled connections to instances idle longer than this are closed (below uvicorn's 5 s).
    pub pool_idle_timeout: Duration,
    /// Takes the connections of instance relays that arrive on another transport (a tunnel's
    /// streams) out of hyper's `Upgraded`, so that the relay reads and writes them directly.
    pub relay_take_over: Option<TakeOver>,
}

impl Default for WorkerProxyConfig {
    fn default() -> Self {
        Self {
            listener: ListenerConfig::default(),
            credentials: Vec::new(),
            require_credential: true,
            connect_timeout: Duration::from_secs(2),
            pool_idle_timeout: Duration::from_secs(3),
            relay_take_over: None,
        }
    }
}

type ProxyRespBody = UnsyncBoxBody<Bytes, BoxError>;

/// Idle connections kept per local instance.
const MAX_IDLE_PER_INSTANCE: usize = 256;

/// The worker reverse proxy. Cheap to clone.
#[derive(Clone, Debug)]
pub struct WorkerProxy {
    inner: Arc<ProxyInner>,
}

#[derive(Debug)]
struct ProxyInner {
    config: WorkerProxyConfig,
    auth_limiter: net::admission::AuthLimiter,
    instances: LocalInstances,
    /// Connections to the local instances; the client's request body streams through.
    pool: Pool,
    /// Open instance relays (`CONNECT`): drained by [`WorkerProxy::serve`] at shutdown.
    relays: Relays,
    /// Requests proxied one by one, from their arrival to the end of their answer's body.
    proxied: Arc<AtomicUsize>,
}

/// Counts one proxied request while it lives (held by its answer's body).
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl WorkerProxy {
    pub fn new(config: WorkerProxyConfig, instances: LocalInstances) -> Self {
        let pool = Pool::new(PoolConfig {
            connect_timeout: config.connect_timeout,
            idle_timeout: config.pool_idle_timeout,
            max_idle: MAX_IDLE_PER_INSTANCE,
        });
        Self {
            inner: Arc::new(ProxyInner {
                auth_limiter: net::admission::AuthLimiter::new(config.listener.auth),
                instances,
                pool,
                relays: config
                    .relay_take_over
                    .map_or_else(Relays::new, Relays::with_take_over),
                proxied: Arc::default(),
                config,
            }),
        }
    }

    /// The instance set this proxy forwards to.
    pub fn instances(&self) -> &LocalInstances {
        &self.inner.instances
    }

    /// Instance relays open now (`CONNECT`: on tunnel streams or worker-port connections).
    pub fn open_relays(&self) -> usize {
        self.inner.relays.open()
    }

    /// What this proxy has in flight: open relays, and requests proxied one by one until the
    /// end of their answer's body.
    pub fn in_flight(&self) -> usize {
        self.open_relays() + self.inner.proxied.load(Ordering::Relaxed)
    }

    /// Serves until `shutdown` fires, then drains (open instance relays too, for up to the
    /// listener's `drain_timeout`, then they are closed).
    pub async fn serve(&self, listener: TcpListener, shutdown: CancellationToken) {
        let proxy = self.clone();
        let handler = move |req, peer| {
            let proxy = proxy.clone();
            async move { proxy.handle(req, peer).await }
        };
        let options = net::listener::ServeOptions {
            upgrades: true,
            ..Default::default()
        };
        net::listener::serve_with(
            listener,
            &self.inner.config.listener,
            options,
            handler,
            shutdown,
            || {},
        )
        .await;
        // Upgraded (`CONNECT`) connections left hyper: their relays drain here. (Relays on
        // tunnel streams end with the tunnel.)
        let timeout = self.inner.config.listener.drain_timeout;
        self.inner.relays.drain(timeout, "worker proxy").await;
    }

    fn authorized(&self, headers: &http::HeaderMap) -> bool {
        let Some(key) = presented_key(headers) else {
            return false;
        };
        // Compare against every credential, without stopping at the first match.
        self.inner.config.credentials.iter().fold(false, |ok, c| {
            tokens::constant_time_eq(c.as_bytes(), key.as_bytes()) | ok
        })
    }

    /// Answers one request.
    pub async fn handle(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<ProxyRespBody> {
        if !matches!(
            *req.method(),
            Method::GET | Method::POST | Method::OPTIONS | Method::HEAD | Method::CONNECT
        ) {
            return error(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed",
                "method_not_allowed",
            );
        }
        if self.inner.config.require_credential && !self.authorized(req.headers()) {
            if presented_key(req.headers()).is_some()
                && let Err(blocked) = self.inner.auth_limiter.failed(peer.ip())
            {
                let mut resp = error(
                    StatusCode::TOO_MANY_REQUESTS,
                    &blocked.to_string(),
                    net::admission::Blocked::CODE,
                );
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, blocked.retry_after_header());
                return resp;
            }
            return error(
                StatusCode::UNAUTHORIZED,
                "invalid or missing worker credential",
                "invalid_api_key",
            );
        }
        if req.method() == Method::CONNECT {
            return self.relay(req).await;
        }
        // The target is the instance header, never the request URI: an HTTP/1 absolute-form
        // target (`GET http://169.254.169.254/ HTTP/1.1`) is refused rather than ignored.
        if req.version() <= http::Version::HTTP_11 && req.uri().authority().is_some() {
            return error(
                StatusCode::BAD_REQUEST,
                "absolute-form request targets are not accepted: this proxy forwards only to the instance named by X-GPUStack-Model-Instance",
                "invalid_target",
            );
        }
        let instance = req
            .headers()
            .get(X_GPUSTACK_MODEL_INSTANCE)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_instance_id);
        let Some(port) = instance.and_then(|id| self.inner.instances.port(id)) else {
            return no_such_instance();
        };

        let (mut parts, body) = req.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        let Ok(uri) = Uri::try_from(format!("http://127.0.0.1:{port}{path}")) else {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid request path",
                "bad_request",
            );
        };
        parts.uri = uri;
        parts.version = http::Version::HTTP_11;
        headers::strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(header::AUTHORIZATION);
        parts.headers.remove(X_API_KEY);
        parts.headers.remove(X_GPUSTACK_MODEL_INSTANCE);
        let counted = InFlight::new(&self.inner.proxied);
        match self.inner.pool.send(Request::from_parts(parts, body)).await {
            Ok(resp) => {
                let (mut head, body) = resp.into_parts();
                headers::strip_hop_by_hop(&mut head.headers);
                head.version = http::Version::default();
                // The count ends with the body, however it ends (the client may leave).
                let body = body.map_err(BoxError::from).map_frame(move |frame| {
                    let _ = &counted;
                    frame
                });
                Response::from_parts(head, body.boxed_unsync())
            }
            Err(e) => {
                tracing::warn!(port, error = %e, cause = ?e.cause, "worker proxy: instance unreachable");
                error(
                    StatusCode::BAD_GATEWAY,
                    "model instance unreachable",
                    "upstream_connect",
                )
            }
        }
    }
}

impl WorkerProxy {
    /// `CONNECT` (credential already checked): a byte relay to a registered local instance.
    async fn relay(&self, mut req: Request<Incoming>) -> Response<ProxyRespBody> {
        let instance = req
            .uri()
            .authority()
            .and_then(|a| parse_relay_target(a.as_str()));
        let Some(instance) = instance else {
            return error(
                StatusCode::METHOD_NOT_ALLOWED,
                "CONNECT is allowed only to a model instance of this worker: model-<model id>-<instance id>.static:0",
                "method_not_allowed",
            );
        };
        let Some(port) = self.inner.instances.port(instance) else {
            return no_such_instance();
        };
        let connect = TcpStream::connect((Ipv4Addr::LOCALHOST, port));
        let upstream = match tokio::time::timeout(self.inner.config.connect_timeout, connect).await
        {
            Ok(Ok(stream)) => stream,
            outcome => {
                let reason = match outcome {
                    Ok(Err(e)) => e.to_string(),
                    _ => "connect timed out".to_owned(),
                };
                tracing::warn!(port, error = %reason, "worker proxy: instance unreachable (relay)");
                return error(
                    StatusCode::BAD_GATEWAY,
                    "model instance unreachable",
                    "upstream_connect",
                );
            }
        };
        let _ = upstream.set_nodelay(true);
        self.inner.relays.spawn(&mut req, upstream);
        Response::new(
            http_body_util::Empty::new()
                .map_err(|never: Infallible| match never {})
                .boxed_unsync(),
        )
    }
}

fn no_such_instance() -> Response<ProxyRespBody> {
    let mut resp = error(
        StatusCode::NOT_FOUND,
        "model instance not found on this worker",
        "model_instance_not_found",
    );
    resp.headers_mut()
        .insert(X_FADEN_NO_SUCH_INSTANCE, HeaderValue::from_static("1"));
    resp
}

fn error(status: StatusCode, message: &str, code: &str) -> Response<ProxyRespBody> {
    let error_type = match status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        _ => "invalid_request_error",
    };
    let body = Full::new(error_body(message, error_type, code))
        .map_err(|never: Infallible| match never {})
        .boxed_unsync();
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_instances_update() {
        let i = LocalInstances::new();
        i.insert(1, 40000);
        i.insert(2, 40001);
        i.remove(1);
        assert_eq!(i.port(1), None);
        assert_eq!(i.port(2), Some(40001));
        i.replace(HashMap::from([(3, 40002)]));
        assert_eq!(i.port(2), None);
        assert_eq!(i.port(3), Some(40002));
    }
}
