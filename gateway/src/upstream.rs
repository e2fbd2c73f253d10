//! Reaching an instance: the [`Route`] per `proxy_mode`, the [`UpstreamRequest`] the gateway
//! hands to a transport, and the transports, each of which writes its own wire request.
//!
//! - `direct`: `http://<address>:<instance_port>/v1/...` over the pooled HTTP/1.1 client.
//! - `worker`: `http://<address>:<worker_port>/v1/...` with `X-GPUStack-Model-Instance` and the
//!   worker credential as `Authorization: Bearer`, over the same pool.
//! - `tunnel`: the worker behind its tunnel, sent through a pluggable [`Upstream`]: in process
//!   ([`crate::tunnel_upstream`], origin-form on a tunnel stream) or through a server's proxy
//!   port ([`crate::proxy_port_upstream`], to the endpoint's `proxy_address`). Without one the
//!   gateway answers 502.
//!
//! When `upstream_tls` names an endpoint (by worker, cluster or default), the `direct` and
//! `worker` paths dial `https://` instead, with [`crate::upstream_tls`]'s dialer of that
//! identity; other endpoints are dialled in plain TCP.
//!
//! Both go through [`net::pool`]: HTTP/1.1 keep-alive connections driven by the request's
//! own task (idle timeout below the engines' 5 s, retry of requests that never left on a
//! connection the server had closed), TLS ones pooled apart per identity.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use control_client::model::ProxyMode;
use control_client::routing::Endpoint;
use futures_util::TryFutureExt as _;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, HeaderValue, Method, Request, Response, Uri, header};
use http_body::{Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::time::Instant;
use tokio_util::either::Either;

use crate::config::GatewayConfig;
use crate::error::{BoxError, ErrorKind, GatewayError};
use crate::upstream_tls::{TlsDialer, TlsDialers, tls_kind};
use net::headers::X_GPUSTACK_MODEL_INSTANCE;
use net::pool::{Pool, PoolConfig, PooledBody, Prepared};
use net::tls::TlsConfigError;

/// What a transport answers: the response head and a streaming body, or an error whose kind
/// says whether the upstream may have started work.
pub type UpstreamFuture =
    Pin<Box<dyn Future<Output = Result<Response<UpstreamBody>, GatewayError>> + Send>>;

/// Sends one planned request to an instance.
pub trait Upstream: Send + Sync + fmt::Debug + 'static {
    /// `request` says what to send and by which [`Route`]; the transport writes the wire
    /// request of its path. `endpoint` says which instance (and worker) it is for. The
    /// response head is due by `deadline` (the gateway's first-byte timeout, or its total
    /// timeout when that comes first): past it, dialling included, the future resolves to an
    /// [`ErrorKind::UpstreamFirstByteTimeout`] error ([`first_byte_timeout`]). The caller sets
    /// no timer of its own, so that a transport with long-lived connections can keep one per
    /// connection rather than one per request.
    fn send(
        &self,
        endpoint: &Endpoint,
        request: UpstreamRequest,
        deadline: Instant,
    ) -> UpstreamFuture;
}

/// One request for one instance, as the gateway planned it: the client's request, readied for
/// the upstream, and the way to the instance.
#[derive(Debug)]
pub struct UpstreamRequest {
    pub method: Method,
    pub path_and_query: PathAndQuery,
    /// The client's headers, sanitised: no hop-by-hop headers, no `Host`, no `Content-Length`
    /// (every transport frames the buffered body itself), no client key and none of
    /// GPUStack's internal headers.
    pub headers: HeaderMap,
    pub body: Bytes,
    pub route: Route,
}

/// The way to one instance, per `proxy_mode`.
#[derive(Clone, Debug)]
pub enum Route {
    /// The engine itself, at `address:instance_port`.
    Direct { authority: Authority },
    /// The worker's proxy, at `address:worker_port`, told the instance and given the worker
    /// credential (always set: a worker route is not planned without one).
    Worker {
        authority: Authority,
        instance: HeaderValue,
        authorization: Option<HeaderValue>,
    },
    /// The worker behind its tunnel. `proxy` is the endpoint's `proxy_address` (the server's
    /// proxy port, or the `Host` a worker proxy is sent per request); the credential goes to
    /// the worker proxy.
    Tunnel {
        proxy: Authority,
        instance: HeaderValue,
        authorization: Option<HeaderValue>,
    },
}

impl Route {
    /// The address a pool dials for this route.
    pub fn authority(&self) -> &Authority {
        match self {
            Route::Direct { authority } | Route::Worker { authority, .. } => authority,
            Route::Tunnel { proxy, .. } => proxy,
        }
    }

    /// The address to dial, then what a worker proxy reads: `X-GPUStack-Model-Instance` and
    /// the worker credential (neither on the `direct` path).
    pub fn into_parts(self) -> (Authority, Option<HeaderValue>, Option<HeaderValue>) {
        match self {
            Route::Direct { authority } => (authority, None, None),
            Route::Worker {
                authority,
                instance,
                authorization,
            }
            | Route::Tunnel {
                proxy: authority,
                instance,
                authorization,
            } => (authority, Some(instance), authorization),
        }
    }
}

impl UpstreamRequest {
    /// The request to `scheme://<route authority>` in absolute form, the route's instance
    /// header and credential after the client's headers: what a pool dialling that authority
    /// sends (it writes `Host` from the URI and the target in origin form).
    pub fn into_absolute(self, scheme: Scheme) -> Result<Request<Full<Bytes>>, GatewayError> {
        let (authority, instance, authorization) = self.route.into_parts();
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(scheme);
        uri.authority = Some(authority);
        uri.path_and_query = Some(self.path_and_query);
        let uri = Uri::from_parts(uri).map_err(|e| {
            GatewayError::new(
                ErrorKind::UpstreamConnect,
                "the model instance has an invalid address",
            )
            .with_cause(e)
        })?;
        let mut request = Request::new(Full::new(self.body));
        *request.method_mut() = self.method;
        *request.uri_mut() = uri;
        *request.headers_mut() = self.headers;
        let headers = request.headers_mut();
        if let Some(v) = instance {
            headers.insert(X_GPUSTACK_MODEL_INSTANCE, v);
        }
        if let Some(v) = authorization {
            headers.insert(header::AUTHORIZATION, v);
        }
        Ok(request)
    }
}

/// A response body from an instance: read straight from a pooled connection
/// ([`net::pool`]: plain, TLS, tunnel streams), or from a hyper connection (the tunnel
/// transport through a remote server's proxy port).
#[derive(Debug)]
pub struct UpstreamBody(Source);

#[derive(Debug)]
enum Source {
    Pooled(PooledBody),
    Hyper(Incoming),
}

impl From<Incoming> for UpstreamBody {
    fn from(body: Incoming) -> Self {
        Self(Source::Hyper(body))
    }
}

impl From<PooledBody> for UpstreamBody {
    fn from(body: PooledBody) -> Self {
        Self(Source::Pooled(body))
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.0 {
            Source::Pooled(body) => Pin::new(body).poll_frame(cx).map_err(BoxError::from),
            Source::Hyper(body) => Pin::new(body).poll_frame(cx).map_err(BoxError::from),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Source::Pooled(body) => body.is_end_stream(),
            Source::Hyper(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Source::Pooled(body) => body.size_hint(),
            Source::Hyper(body) => body.size_hint(),
        }
    }
}

/// The pooled HTTP/1.1 client used for the `direct` and `worker` paths, plus one TLS dialer
/// per upstream TLS identity when any is configured (see [`crate::upstream_tls`]); plain and
/// TLS connections share the pool.
#[derive(Clone, Debug)]
pub struct HttpUpstream {
    pool: Pool,
    tls: Option<Arc<TlsDialers>>,
}

impl HttpUpstream {
    /// Plain HTTP only: `config.upstream_tls` is ignored (see [`HttpUpstream::with_tls`]).
    pub fn new(config: &GatewayConfig) -> Self {
        let pool = Pool::new(PoolConfig {
            connect_timeout: config.timeouts.connect,
            idle_timeout: config.pool_idle_timeout,
            max_idle: config.pool_max_idle_per_host,
        });
        Self { pool, tls: None }
    }

    /// Sends `request` over TLS when `endpoint` has a TLS identity, else in plain HTTP, both
    /// through the pool (whose body reads from the connection in the reader's task), in
    /// absolute form to the route's authority. Without a response head by `deadline` it fails
    /// with [`ErrorKind::UpstreamFirstByteTimeout`]; the pool keeps that timer on the
    /// connection, not one per request.
    pub(crate) fn request(
        &self,
        endpoint: &Endpoint,
        request: UpstreamRequest,
        deadline: Instant,
    ) -> impl Future<Output = Result<Response<UpstreamBody>, GatewayError>> + Send + '_ {
        match self.tls.as_ref().and_then(|t| t.for_endpoint(endpoint)) {
            Some(dialer) => Either::Left(send_tls(&self.pool, dialer, request, deadline)),
            // Combinators, not an `async` block: the pool's future is kept once, without the
            // request beside it.
            None => Either::Right(match request.into_absolute(Scheme::HTTP) {
                Ok(request) => Either::Left(
                    self.pool
                        .send_as(request, Some(deadline))
                        .map_err(GatewayError::from),
                ),
                Err(e) => Either::Right(std::future::ready(Err(e))),
            }),
        }
    }

    /// Plain HTTP, and TLS for the endpoints `config.upstream_tls` names (every PEM file is
    /// read now).
    pub fn with_tls(config: &GatewayConfig) -> Result<Self, TlsConfigError> {
        let mut upstream = Self::new(config);
        upstream.tls = TlsDialers::from_config(config)?.map(Arc::new);
        Ok(upstream)
    }
}

/// No response head by the first-byte deadline (see [`Upstream::send`]).
pub fn first_byte_timeout() -> GatewayError {
    GatewayError::new(
        ErrorKind::UpstreamFirstByteTimeout,
        "no response from the model instance within the first-byte timeout",
    )
}

/// Sends `request` to `https://` its route's authority through `pool`, on a connection of
/// `dialer`'s identity.
async fn send_tls(
    pool: &Pool,
    dialer: &TlsDialer,
    request: UpstreamRequest,
    deadline: Instant,
) -> Result<Response<UpstreamBody>, GatewayError> {
    let authority = request.route.authority().clone();
    let key = dialer.key(&authority);
    let prepared = Prepared::new(request.into_absolute(Scheme::HTTPS)?)?.within(deadline);
    let response = pool
        .send_keyed(&key, None, prepared, || dialer.connect(&authority, &key))
        .await
        .map_err(tls_kind)?;
    Ok(response.map(UpstreamBody::from))
}

impl Upstream for HttpUpstream {
    fn send(
        &self,
        endpoint: &Endpoint,
        request: UpstreamRequest,
        deadline: Instant,
    ) -> UpstreamFuture {
        let this = self.clone();
        let endpoint = endpoint.clone();
        Box::pin(async move { this.request(&endpoint, request, deadline).await })
    }
}

/// `model-<model_id>-<instance_id>.static`, the instance header GPUStack's worker proxy reads.
pub fn instance_host(endpoint: &Endpoint) -> String {
    format!(
        "model-{}-{}.static",
        endpoint.model_id, endpoint.instance_id
    )
}

/// `address:port`, brackets around a bare IPv6 address (built without the formatting
/// machinery: this runs per request).
fn authority(address: &str, port: u16) -> String {
    let bracket = address.contains(':') && !address.starts_with('[');
    let mut out = String::with_capacity(address.len() + 8);
    if bracket {
        out.push('[');
    }
    out.push_str(address);
    if bracket {
        out.push(']');
    }
    out.push(':');
    let mut buf = [0u8; 20];
    for &d in net::h1::write::digits(u64::from(port), 10, &mut buf) {
        out.push(char::from(d));
    }
    out
}

/// The route to `endpoint`: the `worker` path needs `worker_credential`, the `tunnel` path a
/// tunnel transport and a `proxy_address`.
pub fn route(
    endpoint: &Endpoint,
    worker_credential: Option<&HeaderValue>,
    tunnel_available: bool,
) -> Result<Route, GatewayError> {
    Reach::new(endpoint, tunnel_available)?.route(worker_credential)
}

/// [`route`] with what depends on the endpoint alone (its parsed authority, its instance
/// header) taken from `cache` when it was derived from an equal endpoint: no allocation and no
/// parse per request.
pub(crate) fn route_cached(
    cache: &ReachCache,
    endpoint: &Endpoint,
    worker_credential: Option<&HeaderValue>,
    tunnel_available: bool,
) -> Result<Route, GatewayError> {
    let cached = cache.0.load();
    if let Some(reach) = cached.as_deref().filter(|r| r.endpoint == *endpoint) {
        return reach.route(worker_credential);
    }
    let reach = Arc::new(Reach::new(endpoint, tunnel_available)?);
    let route = reach.route(worker_credential);
    cache.0.store(Some(reach));
    route
}

/// The last [`Reach`] of one instance (kept with its balancer state).
#[derive(Debug, Default)]
pub(crate) struct ReachCache(ArcSwapOption<Reach>);

impl ReachCache {
    /// Whether the instance was last reached as another endpoint than `endpoint` (`false` when
    /// it was never reached).
    pub(crate) fn is_other_than(&self, endpoint: &Endpoint) -> bool {
        self.0
            .load()
            .as_deref()
            .is_some_and(|r| r.endpoint != *endpoint)
    }
}

/// What it takes to reach one endpoint, whatever the request.
#[derive(Debug)]
pub(crate) struct Reach {
    /// The endpoint this was derived from.
    endpoint: Endpoint,
    /// Its route without a worker credential (that one may differ per request).
    route: Route,
}

impl Reach {
    fn new(endpoint: &Endpoint, tunnel_available: bool) -> Result<Self, GatewayError> {
        let instance = || {
            HeaderValue::from_str(&instance_host(endpoint)).map_err(|e| {
                GatewayError::new(ErrorKind::UpstreamConnect, "invalid instance id").with_cause(e)
            })
        };
        let parse = |authority: String| {
            Authority::from_maybe_shared(Bytes::from(authority)).map_err(|e| {
                GatewayError::new(
                    ErrorKind::UpstreamConnect,
                    "the model instance has an invalid address",
                )
                .with_cause(e)
            })
        };
        let route = match endpoint.proxy_mode {
            ProxyMode::Direct => Route::Direct {
                authority: parse(authority(&endpoint.address, endpoint.instance_port))?,
            },
            ProxyMode::Worker => Route::Worker {
                instance: instance()?,
                authority: parse(authority(&endpoint.address, endpoint.worker_port))?,
                authorization: None,
            },
            ProxyMode::Tunnel => {
                let proxy = endpoint
                    .proxy_address
                    .as_deref()
                    .filter(|_| tunnel_available)
                    .ok_or_else(|| {
                        GatewayError::new(ErrorKind::TunnelUnavailable, "tunnel path not available")
                    })?;
                let proxy = proxy
                    .strip_prefix("http://")
                    .unwrap_or(proxy)
                    .trim_end_matches('/');
                Route::Tunnel {
                    instance: instance()?,
                    proxy: parse(proxy.to_owned())?,
                    authorization: None,
                }
            }
        };
        Ok(Self {
            endpoint: endpoint.clone(),
            route,
        })
    }

    /// The route with `worker_credential` (required on the `worker` path).
    fn route(&self, worker_credential: Option<&HeaderValue>) -> Result<Route, GatewayError> {
        let mut route = self.route.clone();
        match &mut route {
            Route::Direct { .. } => {}
            Route::Worker { authorization, .. } => {
                *authorization = Some(worker_credential.cloned().ok_or_else(|| {
                    GatewayError::new(
                        ErrorKind::NoWorkerCredential,
                        "no credential configured for worker proxies",
                    )
                })?);
            }
            Route::Tunnel { authorization, .. } => *authorization = worker_credential.cloned(),
        }
        Ok(route)
    }
}

/// The optional tunnel transport, shared.
pub type TunnelUpstream = Option<Arc<dyn Upstream>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(mode: ProxyMode) -> Endpoint {
        Endpoint {
            instance_id: 7,
            model_id: 3,
            worker_id: 1,
            worker_name: "w".into(),
            cluster_id: 1,
            address: "10.1.2.3".into(),
            instance_port: 40000,
            worker_port: 10150,
            proxy_mode: mode,
            proxy_address: Some("http://10.0.0.2:30079".into()),
        }
    }

    /// The absolute-form request a pool is given for `route`.
    fn absolute(route: Route, path: &'static str) -> Request<Full<Bytes>> {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        UpstreamRequest {
            method: Method::POST,
            path_and_query: PathAndQuery::from_static(path),
            headers,
            body: Bytes::from_static(b"{}"),
            route,
        }
        .into_absolute(Scheme::HTTP)
        .unwrap()
    }

    /// Header names and values in their order on the wire.
    fn listed(request: &Request<Full<Bytes>>) -> Vec<(String, String)> {
        request
            .headers()
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
            .collect()
    }

    #[test]
    fn routes_each_mode() {
        let cred = HeaderValue::from_static("Bearer w");
        let r = route(&ep(ProxyMode::Direct), Some(&cred), false).unwrap();
        let request = absolute(r, "/v1/completions?x=1");
        assert_eq!(request.uri(), "http://10.1.2.3:40000/v1/completions?x=1");
        assert_eq!(request.method(), Method::POST);
        assert_eq!(
            listed(&request),
            [("content-type".into(), "application/json".into())]
        );

        let r = route(&ep(ProxyMode::Worker), Some(&cred), false).unwrap();
        assert!(matches!(r, Route::Worker { .. }));
        let request = absolute(r, "/v1/completions");
        assert_eq!(request.uri(), "http://10.1.2.3:10150/v1/completions");
        // After the client's headers, in this order.
        assert_eq!(
            listed(&request),
            [
                ("content-type".into(), "application/json".into()),
                (
                    "x-gpustack-model-instance".into(),
                    "model-3-7.static".into()
                ),
                ("authorization".into(), "Bearer w".into()),
            ]
        );
        assert_eq!(
            route(&ep(ProxyMode::Worker), None, false).unwrap_err().kind,
            ErrorKind::NoWorkerCredential
        );

        let e = route(&ep(ProxyMode::Tunnel), Some(&cred), false).unwrap_err();
        assert_eq!(e.kind, ErrorKind::TunnelUnavailable);
        let r = route(&ep(ProxyMode::Tunnel), Some(&cred), true).unwrap();
        let Route::Tunnel {
            proxy,
            instance,
            authorization,
        } = &r
        else {
            panic!("{r:?}");
        };
        assert_eq!(proxy, "10.0.0.2:30079");
        assert_eq!(instance, "model-3-7.static");
        assert_eq!(authorization.as_ref().unwrap(), "Bearer w");
        assert_eq!(
            absolute(r, "/v1/completions").uri(),
            "http://10.0.0.2:30079/v1/completions"
        );
        // Without a credential the tunnel path still goes (the worker proxy may need none).
        let r = route(&ep(ProxyMode::Tunnel), None, true).unwrap();
        assert_eq!(r.into_parts().2, None);

        let mut v6 = ep(ProxyMode::Direct);
        v6.address = "fd00::1".into();
        let r = route(&v6, None, false).unwrap();
        assert_eq!(r.authority(), "[fd00::1]:40000");
        assert_eq!(
            absolute(r, "/v1/completions").uri(),
            "http://[fd00::1]:40000/v1/completions"
        );
        for port in [0, 9, 10, 80, 65535] {
            assert_eq!(authority("a.b", port), format!("a.b:{port}"));
        }
    }

    #[test]
    fn cached_routes_follow_the_endpoint() {
        let cache = ReachCache::default();
        let cred = HeaderValue::from_static("Bearer w");
        let routed = |ep: &Endpoint| route_cached(&cache, ep, Some(&cred), true).unwrap();
        let uri = |r: Route| absolute(r, "/v1/completions").uri().to_string();
        let mut ep = ep(ProxyMode::Worker);
        assert_eq!(uri(routed(&ep)), "http://10.1.2.3:10150/v1/completions");
        let first = cache.0.load_full().unwrap();
        // The same endpoint again: the same reach, and the same route as uncached.
        let again = listed(&absolute(routed(&ep), "/v1/completions"));
        assert!(Arc::ptr_eq(&first, &cache.0.load_full().unwrap()));
        let uncached = route(&ep, Some(&cred), true).unwrap();
        assert_eq!(again, listed(&absolute(uncached, "/v1/completions")));
        // The worker moved, then changed mode: the next route follows.
        ep.address = "10.9.9.9".into();
        assert_eq!(uri(routed(&ep)), "http://10.9.9.9:10150/v1/completions");
        ep.proxy_mode = ProxyMode::Direct;
        let direct = routed(&ep);
        assert!(matches!(direct, Route::Direct { .. }));
        assert_eq!(uri(direct), "http://10.9.9.9:40000/v1/completions");
        // A failure is not kept.
        ep.proxy_mode = ProxyMode::Tunnel;
        assert!(route_cached(&cache, &ep, Some(&cred), false).is_err());
        assert_eq!(uri(routed(&ep)), "http://10.0.0.2:30079/v1/completions");
    }
}
