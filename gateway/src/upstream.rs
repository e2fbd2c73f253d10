//! Reaching an instance: the request target per `proxy_mode`, and the transports that send it.
//!
//! - `direct`: `http://<address>:<instance_port>/v1/...` over the pooled HTTP/1.1 client.
//! - `worker`: `http://<address>:<worker_port>/v1/...` with `X-GPUStack-Model-Instance` and the
//!   worker credential as `Authorization: Bearer`, over the same pool.
//! - `tunnel`: `http://<proxy_address>/v1/...` with the same header, sent through a pluggable
//!   [`Upstream`] (the tunnel crate provides one later: it can dial a yamux stream in-process
//!   instead of going through the proxy port). Without one the gateway answers 502.
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
use control::model::ProxyMode;
use control::routing::Endpoint;
use http::uri::{Authority, PathAndQuery};
use http::{HeaderValue, Request, Response, Uri};
use http_body::{Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::time::Instant;
use tokio_util::either::Either;

use crate::config::GatewayConfig;
use crate::error::{BoxError, ErrorKind, GatewayError};
use crate::upstream_tls::{TlsDialer, TlsDialers, tls_kind};
use net::pool::{Pool, PoolConfig, PooledBody, Prepared};
use net::tls::TlsConfigError;

/// What a transport answers: the response head and a streaming body, or an error whose kind
/// says whether the upstream may have started work.
pub type UpstreamFuture =
    Pin<Box<dyn Future<Output = Result<Response<UpstreamBody>, GatewayError>> + Send>>;

/// Sends one prepared request to an instance.
pub trait Upstream: Send + Sync + fmt::Debug + 'static {
    /// `request` carries the absolute URI and every header to send; `endpoint` says which
    /// instance (and worker) it is for. The response head is due by `deadline` (the gateway's
    /// first-byte timeout, or its total timeout when that comes first): past it, dialling
    /// included, the future resolves to an [`ErrorKind::UpstreamFirstByteTimeout`] error
    /// ([`first_byte_timeout`]). The caller sets no timer of its own, so that a transport with
    /// long-lived connections can keep one per connection rather than one per request.
    fn send(
        &self,
        endpoint: &Endpoint,
        request: Request<Full<Bytes>>,
        deadline: Instant,
    ) -> UpstreamFuture;
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
    /// through the pool (whose body reads from the connection in the reader's task). Without
    /// a response head by `deadline` it fails with [`ErrorKind::UpstreamFirstByteTimeout`];
    /// the pool keeps that timer on the connection, not one per request.
    pub(crate) fn request(
        &self,
        endpoint: &Endpoint,
        request: Request<Full<Bytes>>,
        deadline: Instant,
    ) -> impl Future<Output = Result<Response<UpstreamBody>, GatewayError>> + Send + '_ {
        match self.tls.as_ref().and_then(|t| t.for_endpoint(endpoint)) {
            Some(dialer) => Either::Left(send_tls(&self.pool, dialer, request, deadline)),
            None => {
                Either::Right(async move { Ok(self.pool.send_as(request, Some(deadline)).await?) })
            }
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

/// Sends `request` (an `http://` URI) to `https://` the same authority through `pool`, on a
/// connection of `dialer`'s identity.
async fn send_tls(
    pool: &Pool,
    dialer: &TlsDialer,
    request: Request<Full<Bytes>>,
    deadline: Instant,
) -> Result<Response<UpstreamBody>, GatewayError> {
    let invalid = || {
        GatewayError::new(
            ErrorKind::UpstreamConnect,
            "the model instance has an invalid address",
        )
    };
    let (mut parts, body) = request.into_parts();
    let authority = parts.uri.authority().cloned().ok_or_else(invalid)?;
    let mut uri = std::mem::take(&mut parts.uri).into_parts();
    uri.scheme = Some(http::uri::Scheme::HTTPS);
    parts.uri = Uri::from_parts(uri).map_err(|e| invalid().with_cause(e))?;
    let key = dialer.key(&authority);
    let prepared = Prepared::new(Request::from_parts(parts, body))?.within(deadline);
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
        request: Request<Full<Bytes>>,
        deadline: Instant,
    ) -> UpstreamFuture {
        let this = self.clone();
        let endpoint = endpoint.clone();
        Box::pin(async move { this.request(&endpoint, request, deadline).await })
    }
}

/// Which transport a request takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    Pool,
    Tunnel,
}

/// Where and how to send a request for one endpoint.
#[derive(Debug)]
pub struct Plan {
    pub uri: Uri,
    pub via: Via,
    /// `X-GPUStack-Model-Instance` value (worker and tunnel paths).
    pub instance_header: Option<HeaderValue>,
    /// `Authorization` value for the worker proxy.
    pub authorization: Option<HeaderValue>,
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

/// Plans the request of `path_and_query` to `endpoint`.
pub fn plan(
    endpoint: &Endpoint,
    path_and_query: &str,
    worker_credential: Option<&HeaderValue>,
    tunnel_available: bool,
) -> Result<Plan, GatewayError> {
    let path = PathAndQuery::try_from(path_and_query).map_err(|e| {
        GatewayError::new(ErrorKind::BadRequest, "invalid request target").with_cause(e)
    })?;
    plan_path(endpoint, &path, worker_credential, tunnel_available)
}

/// [`plan`] with a parsed target (a static one costs no copy and no parse).
pub fn plan_path(
    endpoint: &Endpoint,
    path_and_query: &PathAndQuery,
    worker_credential: Option<&HeaderValue>,
    tunnel_available: bool,
) -> Result<Plan, GatewayError> {
    Reach::new(endpoint, tunnel_available)?.plan(path_and_query, worker_credential)
}

/// [`plan_path`] with what depends on the endpoint alone (its parsed authority, its instance
/// header) taken from `cache` when it was derived from an equal endpoint: no allocation and no
/// parse per request.
pub(crate) fn plan_cached(
    cache: &ReachCache,
    endpoint: &Endpoint,
    path_and_query: &PathAndQuery,
    worker_credential: Option<&HeaderValue>,
    tunnel_available: bool,
) -> Result<Plan, GatewayError> {
    let cached = cache.0.load();
    if let Some(reach) = cached.as_deref().filter(|r| r.endpoint == *endpoint) {
        return reach.plan(path_and_query, worker_credential);
    }
    let reach = Arc::new(Reach::new(endpoint, tunnel_available)?);
    let plan = reach.plan(path_and_query, worker_credential);
    cache.0.store(Some(reach));
    plan
}

/// The last [`Reach`] of one instance (kept with its balancer state).
#[derive(Debug, Default)]
pub(crate) struct ReachCache(ArcSwapOption<Reach>);

/// What it takes to reach one endpoint, whatever the request.
#[derive(Debug)]
pub(crate) struct Reach {
    /// The endpoint this was derived from.
    endpoint: Endpoint,
    via: Via,
    authority: Authority,
    /// `X-GPUStack-Model-Instance` (worker and tunnel paths).
    instance_header: Option<HeaderValue>,
}

impl Reach {
    fn new(endpoint: &Endpoint, tunnel_available: bool) -> Result<Self, GatewayError> {
        let instance_header = || {
            HeaderValue::from_str(&instance_host(endpoint)).map_err(|e| {
                GatewayError::new(ErrorKind::UpstreamConnect, "invalid instance id").with_cause(e)
            })
        };
        let (via, authority, instance_header) = match endpoint.proxy_mode {
            ProxyMode::Direct => (
                Via::Pool,
                authority(&endpoint.address, endpoint.instance_port),
                None,
            ),
            ProxyMode::Worker => (
                Via::Pool,
                authority(&endpoint.address, endpoint.worker_port),
                Some(instance_header()?),
            ),
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
                (Via::Tunnel, proxy.to_owned(), Some(instance_header()?))
            }
        };
        let authority = Authority::from_maybe_shared(Bytes::from(authority)).map_err(|e| {
            GatewayError::new(
                ErrorKind::UpstreamConnect,
                "the model instance has an invalid address",
            )
            .with_cause(e)
        })?;
        Ok(Self {
            endpoint: endpoint.clone(),
            via,
            authority,
            instance_header,
        })
    }

    fn plan(
        &self,
        path_and_query: &PathAndQuery,
        worker_credential: Option<&HeaderValue>,
    ) -> Result<Plan, GatewayError> {
        let authorization = match self.endpoint.proxy_mode {
            ProxyMode::Direct => None,
            ProxyMode::Worker => Some(worker_credential.cloned().ok_or_else(|| {
                GatewayError::new(
                    ErrorKind::NoWorkerCredential,
                    "no credential configured for worker proxies",
                )
            })?),
            ProxyMode::Tunnel => worker_credential.cloned(),
        };
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(http::uri::Scheme::HTTP);
        uri.authority = Some(self.authority.clone());
        uri.path_and_query = Some(path_and_query.clone());
        let uri = Uri::from_parts(uri).map_err(|e| {
            GatewayError::new(
                ErrorKind::UpstreamConnect,
                "the model instance has an invalid address",
            )
            .with_cause(e)
        })?;
        Ok(Plan {
            uri,
            via: self.via,
            instance_header: self.instance_header.clone(),
            authorization,
        })
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

    #[test]
    fn plans_each_mode() {
        let cred = HeaderValue::from_static("Bearer w");
        let p = plan(
            &ep(ProxyMode::Direct),
            "/v1/completions?x=1",
            Some(&cred),
            false,
        )
        .unwrap();
        assert_eq!(p.uri, "http://10.1.2.3:40000/v1/completions?x=1");
        assert!(p.instance_header.is_none() && p.authorization.is_none());

        let p = plan(
            &ep(ProxyMode::Worker),
            "/v1/completions",
            Some(&cred),
            false,
        )
        .unwrap();
        assert_eq!(p.uri, "http://10.1.2.3:10150/v1/completions");
        assert_eq!(p.instance_header.unwrap(), "model-3-7.static");
        assert_eq!(p.authorization.unwrap(), "Bearer w");
        assert_eq!(
            plan(&ep(ProxyMode::Worker), "/v1/completions", None, false)
                .unwrap_err()
                .kind,
            ErrorKind::NoWorkerCredential
        );

        let e = plan(
            &ep(ProxyMode::Tunnel),
            "/v1/completions",
            Some(&cred),
            false,
        )
        .unwrap_err();
        assert_eq!(e.kind, ErrorKind::TunnelUnavailable);
        let p = plan(&ep(ProxyMode::Tunnel), "/v1/completions", Some(&cred), true).unwrap();
        assert_eq!(p.uri, "http://10.0.0.2:30079/v1/completions");
        assert_eq!(p.via, Via::Tunnel);

        let mut v6 = ep(ProxyMode::Direct);
        v6.address = "fd00::1".into();
        let p = plan(&v6, "/v1/completions", None, false).unwrap();
        assert_eq!(p.uri, "http://[fd00::1]:40000/v1/completions");
        for port in [0, 9, 10, 80, 65535] {
            assert_eq!(authority("a.b", port), format!("a.b:{port}"));
        }
    }

    #[test]
    fn cached_plans_follow_the_endpoint() {
        let cache = ReachCache::default();
        let cred = HeaderValue::from_static("Bearer w");
        let path = PathAndQuery::from_static("/v1/completions");
        let plan = |ep: &Endpoint| plan_cached(&cache, ep, &path, Some(&cred), true).unwrap();
        let mut ep = ep(ProxyMode::Worker);
        assert_eq!(plan(&ep).uri, "http://10.1.2.3:10150/v1/completions");
        let first = cache.0.load_full().unwrap();
        // The same endpoint again: the same reach, and the same plan as uncached.
        let again = plan(&ep);
        assert!(Arc::ptr_eq(&first, &cache.0.load_full().unwrap()));
        let uncached = plan_path(&ep, &path, Some(&cred), true).unwrap();
        assert_eq!(again.uri, uncached.uri);
        assert_eq!(again.instance_header, uncached.instance_header);
        assert_eq!(again.authorization, uncached.authorization);
        // The worker moved, then changed mode: the next plan follows.
        ep.address = "10.9.9.9".into();
        assert_eq!(plan(&ep).uri, "http://10.9.9.9:10150/v1/completions");
        ep.proxy_mode = ProxyMode::Direct;
        let direct = plan(&ep);
        assert_eq!(direct.uri, "http://10.9.9.9:40000/v1/completions");
        assert!(direct.instance_header.is_none() && direct.authorization.is_none());
        // A failure is not kept.
        ep.proxy_mode = ProxyMode::Tunnel;
        assert!(plan_cached(&cache, &ep, &path, Some(&cred), false).is_err());
        assert_eq!(plan(&ep).uri, "http://10.0.0.2:30079/v1/completions");
    }
}
