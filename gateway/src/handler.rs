//! The request path, as explicit phases.
//!
//! 1. **classify**: path → target (404), method (405).
//! 2. **authenticate**: key from `Authorization: Bearer` / `X-API-Key`, checked against the
//!    snapshot taken for this request (401); a source address with too many refused keys gets
//!    429 with `Retry-After` before its key is looked at. In front of GPUStack, a key the
//!    snapshot does not hold goes to [`crate::RemoteKeys`] (401, or 503 when the server cannot
//!    say), before any body is read.
//! 3. **read body**: whole body into one `Bytes` under a size limit (413) and a deadline (408).
//! 4. **resolve model**: `model` from the JSON (or multipart) body without re-serialising it
//!    (400), then its route in the snapshot (404, 503); a remote key is checked for that model
//!    (403 when it may not call it).
//! 5. **select upstream**: P2C over the route's instances, minus ejected and already tried.
//! 6. **forward**: plan the request for the endpoint's `proxy_mode`, send it with the original
//!    body bytes; on a failure that cannot have started work, retry once on another instance.
//! 7. **respond**: pass status and headers on (hop-by-hop stripped), stream the body through
//!    [`ProxyBody`] with the idle and total timeouts.
//!
//! The snapshot is read once per request, so one request never mixes two routing states.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use control::key_check::CheckError;
use control::model::ProxyMode;
use control::routing::{ModelRoute, RoutingSnapshot};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};

use net::h1::ClientBody;
use tokio::time::Instant;

use crate::Gateway;
use crate::auth::{self, Caller};
use crate::balance::Outcome;
use crate::body::json_response;
use crate::body::{Deadlines, GatewayBody, ProxyBody, UsageTap};
use crate::error::{ErrorKind, GatewayError};
use crate::metrics::ROUTE_OTHER;
use crate::route::{self, Api, Target};
use crate::sse;
use crate::upstream::{self, Via};
use crate::usage;
use net::headers::{self, X_ACCEL_BUFFERING, X_FADEN_NO_SUCH_INSTANCE, X_GPUSTACK_MODEL_INSTANCE};

/// Headers that may name the model when the body does not (GPUStack / Higress).
const MODEL_HEADERS: [&str; 2] = ["x-gpustack-model", "x-higress-llm-model"];

/// Tries per request: the first and at most one retry on another instance.
const MAX_ATTEMPTS: usize = 2;

impl Gateway {
    /// Answers one request. Never fails: every error becomes an OpenAI-shaped response.
    pub fn handle(
        &self,
        req: Request<ClientBody>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<GatewayBody>> + Send + '_ {
        handle_with(self, req, peer)
    }

    /// [`Gateway::handle`] on a gateway the future owns: what the listener runs per request.
    pub(crate) fn handle_owned(
        self,
        req: Request<ClientBody>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<GatewayBody>> + Send + 'static {
        handle_with(self, req, peer)
    }

    fn readyz(&self) -> Response<GatewayBody> {
        if self.is_ready() {
            json_response(
                StatusCode::OK,
                Bytes::from_static(b"{\"status\":\"ready\"}"),
            )
        } else {
            let reason = if self
                .inner
                .draining
                .load(std::sync::atomic::Ordering::Relaxed)
            {
                "draining".to_owned()
            } else {
                match &self.inner.staleness {
                    Some(probe) if probe() != std::time::Duration::MAX => format!(
                        "routing snapshot is stale ({:.1} s since the management API was last heard from)",
                        probe().as_secs_f64()
                    ),
                    _ => "routing snapshot is stale".to_owned(),
                }
            };
            GatewayError::new(ErrorKind::Draining, reason).into_response()
        }
    }

    fn reject(
        &self,
        model: &str,
        route: &'static str,
        error: GatewayError,
    ) -> Response<GatewayBody> {
        if error.kind.source() != crate::error::ErrorSource::Downstream {
            tracing::warn!(kind = ?error.kind, error = %error, cause = ?error.cause, "request failed");
        } else {
            tracing::debug!(kind = ?error.kind, error = %error, "request refused");
        }
        self.inner
            .metrics
            .request(model, route, error.kind.status().as_u16());
        error.into_response()
    }

    /// Phases 2 to 7 of an inference call. The error carries the model label for metrics.
    #[allow(clippy::manual_async_fn)] // on purpose, see the comment inside
    fn inference(
        &self,
        api: Api,
        parts: http::request::Parts,
        body: ClientBody,
        peer: SocketAddr,
        started: Instant,
    ) -> impl Future<Output = Result<Response<GatewayBody>, (String, GatewayError)>> + Send + '_
    {
        // An `async move` block rather than an `async fn`: the arguments are used where they
        // were captured instead of being copied into a second slot of the future.
        async move {
            let unlabelled = |e| (String::new(), e);
            // One snapshot for the whole request.
            let snapshot = self.inner.snapshots.load();

            // Phase 2: authenticate.
            let caller = self
                .authenticate(&snapshot, &parts.headers, peer)
                .await
                .map_err(unlabelled)?;

            // Phase 3: read the body.
            let body = self.read_body(body, started).await.map_err(unlabelled)?;

            // Phase 4: resolve the model and its route; a key left to the management server is
            // checked for that model.
            let (route, streamed_without_options) =
                resolve_route(&snapshot, &parts.headers, &body).map_err(unlabelled)?;
            let labelled = |e| (route.name.clone(), e);
            if let Caller::Remote(key) = caller {
                self.check_remote(key, Some(&route.name), peer)
                    .await
                    .map_err(labelled)?;
            }
            if route.endpoints.is_empty() {
                return Err(labelled(GatewayError::new(
                    ErrorKind::NoRoutableInstance,
                    format!("model {:?} has no running instance", route.name),
                )));
            }

            let path_and_query = match parts.uri.query() {
                Some(q) => {
                    PathAndQuery::try_from(format!("{}?{q}", api.upstream_path())).map_err(|e| {
                        labelled(
                            GatewayError::new(ErrorKind::BadRequest, "invalid query string")
                                .with_cause(e),
                        )
                    })?
                }
                None => api.upstream_path_and_query(),
            };
            let body = match api {
                Api::ChatCompletions | Api::Completions
                    if self.inner.config.count_tokens && streamed_without_options =>
                {
                    usage::add_include_usage(&body).map_or(body, Bytes::from)
                }
                _ => body,
            };
            let mut forward_headers = parts.headers;
            // `content-length` goes too: every transport frames the buffered body itself (the
            // pool's client and hyper's both write its exact length).
            headers::sanitize_request(&mut forward_headers);

            let timeouts = &self.inner.config.timeouts;
            let total = started + timeouts.total;
            let first_byte = (started + timeouts.first_byte).min(total);

            // Phases 5 and 6: select, forward, maybe retry once.
            // Instances tried so far: `tried[..attempt]`.
            let mut tried = [0i64; MAX_ATTEMPTS];
            let mut last_error = None;
            let attempts = if self.inner.config.retry {
                MAX_ATTEMPTS
            } else {
                1
            };
            for attempt in 0..attempts {
                let Some(pick) = self
                    .inner
                    .balancer
                    .pick(&route.endpoints, &tried[..attempt])
                else {
                    break;
                };
                tried[attempt] = pick.endpoint.instance_id;
                if attempt > 0 {
                    self.inner.metrics.retry();
                }
                let inflight = pick.start();
                let per_endpoint;
                let worker_credential = match &self.inner.worker_credentials {
                    Some(resolve) if pick.endpoint.proxy_mode != ProxyMode::Direct => {
                        per_endpoint = resolve(pick.endpoint);
                        per_endpoint
                            .as_ref()
                            .or(self.inner.worker_authorization.as_ref())
                    }
                    _ => self.inner.worker_authorization.as_ref(),
                };
                let plan = match upstream::plan_cached(
                    &pick.state.reach,
                    pick.endpoint,
                    &path_and_query,
                    worker_credential,
                    self.inner.tunnel.is_some(),
                ) {
                    Ok(plan) => plan,
                    Err(e) => {
                        // Nothing was sent: another instance (maybe on another path) may do.
                        last_error = Some(e);
                        continue;
                    }
                };
                // The headers are moved into the last request that can be made (every request
                // but a first one that might be retried): no copy of the map per request.
                let retry_possible = attempt + 1 < attempts && attempt + 1 < route.endpoints.len();
                let headers = if retry_possible {
                    forward_headers.clone()
                } else {
                    std::mem::take(&mut forward_headers)
                };
                let via = plan.via;
                let request = build_request(plan, headers, body.clone());
                // The transports bound the wait for the response head themselves (the pool
                // on a timer each connection keeps: `Upstream::send`).
                let sent = match (via, &self.inner.tunnel) {
                    (Via::Tunnel, Some(tunnel)) => {
                        tunnel.send(pick.endpoint, request, first_byte).await
                    }
                    _ => {
                        self.inner
                            .pool
                            .request(pick.endpoint, request, first_byte)
                            .await
                    }
                };
                let result = match sent {
                    Err(e)
                        if e.kind == ErrorKind::UpstreamFirstByteTimeout && first_byte >= total =>
                    {
                        Err(GatewayError::new(
                            ErrorKind::UpstreamTotalTimeout,
                            "request exceeded the total timeout",
                        ))
                    }
                    sent => sent,
                };
                match result {
                    Ok(resp) if is_no_such_instance(&resp) => {
                        self.inner.balancer.report(&pick.state, Outcome::Failure);
                        self.inner
                            .metrics
                            .upstream_error(ErrorKind::UpstreamNoSuchInstance);
                        last_error = Some(GatewayError::new(
                            ErrorKind::UpstreamNoSuchInstance,
                            "the worker does not host this model instance",
                        ));
                    }
                    Ok(resp) => {
                        let outcome = if resp.status().is_server_error() {
                            Outcome::Failure
                        } else {
                            Outcome::Success
                        };
                        self.inner.balancer.report(&pick.state, outcome);
                        // Phase 7: respond.
                        let deadlines = Deadlines {
                            first_byte,
                            idle: timeouts.idle,
                            total,
                        };
                        let (mut head, incoming) = resp.into_parts();
                        headers::sanitize_response(&mut head.headers);
                        let content_type = head.headers.get(header::CONTENT_TYPE);
                        let is_sse = sse::is_event_stream_type(content_type);
                        let usage = usage_tap(api, route, head.status, is_sse, content_type);
                        if is_sse {
                            head.headers
                                .insert(X_ACCEL_BUFFERING, HeaderValue::from_static("no"));
                        }
                        head.version = http::Version::default();
                        self.inner
                            .metrics
                            .request(&route.name, api.suffix(), head.status.as_u16());
                        let body = ProxyBody::new(
                            incoming,
                            is_sse,
                            deadlines,
                            started,
                            api,
                            self.inner.metrics.clone(),
                            inflight,
                        )
                        .with_usage(usage);
                        return Ok(Response::from_parts(head, GatewayBody::Right(body)));
                    }
                    Err(e) => {
                        if e.kind.counts_against_instance() {
                            self.inner.balancer.report(&pick.state, Outcome::Failure);
                        }
                        self.inner.metrics.upstream_error(e.kind);
                        let retry = e.kind.retryable();
                        tracing::debug!(instance = pick.endpoint.instance_id, kind = ?e.kind, cause = ?e.cause, "attempt failed");
                        last_error = Some(e);
                        if !retry {
                            break;
                        }
                    }
                }
            }
            Err(labelled(last_error.unwrap_or_else(|| {
                GatewayError::new(
                    ErrorKind::NoRoutableInstance,
                    format!("no instance of model {:?} can take the request", route.name),
                )
            })))
        }
    }

    /// Phase 2: the key, with failed attempts counted per source address. A key the snapshot
    /// does not hold, with remote keys active, is checked with the management server (for no
    /// model yet: whether it is a key at all) before any body is read.
    async fn authenticate<'h>(
        &self,
        snapshot: &RoutingSnapshot,
        headers: &'h HeaderMap,
        peer: SocketAddr,
    ) -> Result<Caller<'h>, GatewayError> {
        let remote = self
            .inner
            .remote_keys
            .as_ref()
            .is_some_and(|r| (r.active)());
        let caller = auth::authenticate_source(
            &self.inner.auth_limiter,
            peer.ip(),
            snapshot,
            headers,
            chrono::Utc::now,
            remote,
        )?;
        if let Caller::Remote(key) = caller {
            self.check_remote(key, None, peer).await?;
        }
        Ok(caller)
    }

    /// The management server's verdict on `key` for `model` (cached); a refused key counts as
    /// a failure of its source address.
    async fn check_remote(
        &self,
        key: &str,
        model: Option<&str>,
        peer: SocketAddr,
    ) -> Result<(), GatewayError> {
        let Some(remote) = &self.inner.remote_keys else {
            return Ok(());
        };
        remote.check.check(key, model).await.map_err(|e| {
            let kind = match e {
                CheckError::Unauthorized(_) => {
                    self.inner.auth_limiter.failed(peer.ip());
                    ErrorKind::Unauthorized
                }
                CheckError::Forbidden(_) => ErrorKind::ModelNotAllowed,
                CheckError::Unavailable(_) => ErrorKind::AuthUnavailable,
            };
            GatewayError::new(kind, e.to_string())
        })
    }

    /// `GET /v1/models`: every model with a routable instance that the caller's key may call.
    async fn models(
        &self,
        snapshot: &RoutingSnapshot,
        headers: &HeaderMap,
        peer: SocketAddr,
    ) -> Result<Bytes, GatewayError> {
        let caller = self.authenticate(snapshot, headers, peer).await?;
        let names = routable_models(snapshot);
        let Caller::Remote(key) = caller else {
            return Ok(models_list(names));
        };
        // At most this many checks at once for a key seen for the first time.
        const CONCURRENT_CHECKS: usize = 8;
        let mut allowed = Vec::with_capacity(names.len());
        for chunk in names.chunks(CONCURRENT_CHECKS) {
            let mut verdicts = Vec::with_capacity(chunk.len());
            for name in chunk {
                verdicts.push(self.check_remote(key, Some(name), peer));
            }
            let verdicts = futures_util::future::join_all(verdicts).await;
            for (name, verdict) in chunk.iter().zip(verdicts) {
                match verdict {
                    Ok(()) => allowed.push(*name),
                    Err(e) if e.kind == ErrorKind::ModelNotAllowed => {}
                    // A key refused outright, or a server that cannot say: the list would be
                    // wrong.
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(models_list(allowed))
    }

    /// Phase 3: the whole body, under the size limit and the body deadline.
    async fn read_body(&self, body: ClientBody, started: Instant) -> Result<Bytes, GatewayError> {
        let max = self.inner.config.max_body_bytes;
        let too_large = || {
            GatewayError::new(
                ErrorKind::PayloadTooLarge,
                format!("request body is larger than {max} bytes"),
            )
        };
        // The declared length is the body's exact size hint (both servers take it from
        // `Content-Length`; the native one leaves that header out of the map).
        let declared = http_body::Body::size_hint(&body).exact();
        if declared.is_some_and(|n| n > max as u64) {
            return Err(too_large());
        }
        let read = collect_body(body, max, declared);
        let deadline = started + self.inner.config.timeouts.request_body;
        match tokio::time::timeout_at(deadline, read).await {
            Err(_) => Err(GatewayError::new(
                ErrorKind::RequestTimeout,
                "request body not received in time",
            )),
            Ok(Err(None)) => Err(too_large()),
            Ok(Err(Some(e))) => Err(GatewayError::new(
                ErrorKind::BadRequest,
                "could not read the request body",
            )
            .with_cause(e)),
            Ok(Ok(body)) => Ok(body),
        }
    }
}

/// Below this many bytes received, a body's declared length is not reserved up front (a client
/// that announces a large body and sends little gets no large buffer).
const RESERVE_DECLARED_AFTER: usize = 1 << 20;

/// Reads a whole request body into one buffer, at most `max` bytes (`Err(None)` beyond). A body
/// that arrives in one piece is kept as it is (no copy); otherwise the pieces are copied into
/// one buffer as they come, each freed at once, so the peak is about one body rather than the
/// pieces plus their concatenation. The declared length, when known, is reserved once the
/// first MiB arrived.
async fn collect_body(
    mut body: ClientBody,
    max: usize,
    declared: Option<u64>,
) -> Result<Bytes, Option<net::BoxError>> {
    let mut first: Option<Bytes> = None;
    let mut buf = bytes::BytesMut::new();
    let mut reserved = false;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(Some)?.into_data() else {
            continue;
        };
        let have = first.as_ref().map_or(0, Bytes::len) + buf.len();
        if have + data.len() > max {
            return Err(None);
        }
        if first.is_none() && buf.is_empty() {
            first = Some(data);
            continue;
        }
        if !reserved && have + data.len() > RESERVE_DECLARED_AFTER {
            if let Some(n) = declared.and_then(|n| usize::try_from(n).ok()) {
                buf.reserve(n.min(max).saturating_sub(buf.len()));
            }
            reserved = true;
        }
        if let Some(first) = first.take() {
            buf.extend_from_slice(&first);
        }
        buf.extend_from_slice(&data);
    }
    Ok(first.unwrap_or_else(|| buf.freeze()))
}

/// The request path of [`Gateway::handle`], on a borrowed or owned gateway. An `async move`
/// block rather than an `async fn`: the arguments are used where they were captured instead of
/// being copied into a second slot of the future (a few hundred bytes moved per request).
#[allow(clippy::manual_async_fn)]
fn handle_with<G>(
    gateway: G,
    req: Request<ClientBody>,
    peer: SocketAddr,
) -> impl Future<Output = Response<GatewayBody>> + Send
where
    G: std::borrow::Borrow<Gateway> + Send,
{
    async move {
        let this: &Gateway = gateway.borrow();
        let started = Instant::now();
        // Phase 1: classify.
        let Some(target) = route::classify(req.uri().path()) else {
            return this.reject(
                "",
                ROUTE_OTHER,
                GatewayError::new(
                    ErrorKind::NotFound,
                    format!("no route for {}", req.uri().path()),
                ),
            );
        };
        let method_ok = match target.method() {
            Method::GET => req.method() == Method::GET || req.method() == Method::HEAD,
            m => req.method() == m,
        };
        if !method_ok {
            let allow = target.method();
            let mut resp = this.reject(
                "",
                ROUTE_OTHER,
                GatewayError::new(
                    ErrorKind::MethodNotAllowed,
                    format!("method {} not allowed, use {allow}", req.method()),
                ),
            );
            if let Ok(v) = HeaderValue::from_str(allow.as_str()) {
                resp.headers_mut().insert(header::ALLOW, v);
            }
            return resp;
        }
        match target {
            Target::Healthz => {
                json_response(StatusCode::OK, Bytes::from_static(b"{\"status\":\"ok\"}"))
            }
            Target::Readyz => this.readyz(),
            Target::Metrics => {
                let mut resp = Response::new(GatewayBody::Left(Full::new(Bytes::from(
                    this.metrics_text(),
                ))));
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                resp
            }
            Target::Models => {
                let snapshot = this.inner.snapshots.load();
                match this.models(&snapshot, req.headers(), peer).await {
                    Ok(list) => json_response(StatusCode::OK, list),
                    Err(e) => this.reject("", "models", e),
                }
            }
            Target::Inference(api) => {
                this.inner.metrics.request_started();
                // Split here: the inference future keeps the parts it was given, not a request
                // and then its parts beside it.
                let (parts, body) = req.into_parts();
                let resp = match this.inference(api, parts, body, peer, started).await {
                    Ok(resp) => resp,
                    Err((model, e)) => this.reject(&model, api.suffix(), e),
                };
                this.inner.metrics.request_ended();
                resp
            }
        }
    }
}

/// Phase 4: model name → route.
/// The route of the model a request names, and whether its JSON body asks for a stream
/// without `stream_options` ([`route::JsonRequest::streamed_without_options`]).
fn resolve_route<'s>(
    snapshot: &'s RoutingSnapshot,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(&'s Arc<ModelRoute>, bool), GatewayError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let (from_body, streamed_without_options) = if content_type
        .trim_start()
        .get(..19)
        .is_some_and(|p| p.eq_ignore_ascii_case("multipart/form-data"))
    {
        (route::model_from_multipart(content_type, body), false)
    } else {
        let request = route::read_json_request(body)?;
        (
            request.model.ok_or_else(route::missing_model),
            request.streamed_without_options,
        )
    };
    let model = match from_body {
        Ok(m) => m,
        Err(e) if e.kind == ErrorKind::MissingModel => {
            let header = MODEL_HEADERS
                .iter()
                .find_map(|h| headers.get(*h).and_then(|v| v.to_str().ok()))
                .filter(|m| !m.is_empty());
            match header {
                Some(m) => m.into(),
                None => return Err(e),
            }
        }
        Err(e) => return Err(e),
    };
    let route = snapshot.route(&model).ok_or_else(|| {
        let mut shown: String = model.chars().take(128).collect();
        if shown.len() < model.len() {
            shown.push('…');
        }
        GatewayError::new(
            ErrorKind::ModelNotFound,
            format!("the model {shown:?} does not exist or has no running instance"),
        )
    })?;
    Ok((route, streamed_without_options))
}

/// Token counting for the answers that report usage: successful chat, text completion and
/// embedding answers, streamed or JSON.
fn usage_tap(
    api: Api,
    model: &Arc<ModelRoute>,
    status: StatusCode,
    is_sse: bool,
    content_type: Option<&HeaderValue>,
) -> Option<UsageTap> {
    let counted = matches!(
        api,
        Api::ChatCompletions | Api::Completions | Api::Embeddings
    );
    let json = || {
        content_type
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("application/json"))
    };
    (counted && status.is_success() && (is_sse || json()))
        .then(|| UsageTap::new(model.clone(), is_sse))
}

fn is_no_such_instance<B>(resp: &Response<B>) -> bool {
    resp.status() == StatusCode::NOT_FOUND && resp.headers().contains_key(X_FADEN_NO_SUCH_INSTANCE)
}

fn build_request(plan: upstream::Plan, headers: HeaderMap, body: Bytes) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = plan.uri;
    *req.headers_mut() = headers;
    let h = req.headers_mut();
    if let Some(v) = plan.instance_header {
        h.insert(X_GPUSTACK_MODEL_INSTANCE, v);
    }
    if let Some(v) = plan.authorization {
        h.insert(header::AUTHORIZATION, v);
    }
    req
}

/// Every model with at least one routable instance, sorted by name.
fn routable_models(snapshot: &RoutingSnapshot) -> Vec<&str> {
    let mut names: Vec<&str> = snapshot
        .models
        .values()
        .filter(|r| !r.endpoints.is_empty())
        .map(|r| r.name.as_str())
        .collect();
    names.sort_unstable();
    names
}

/// The OpenAI model list of `names`.
fn models_list(names: Vec<&str>) -> Bytes {
    let data: Vec<serde_json::Value> = names
        .into_iter()
        .map(|name| {
            serde_json::json!({"id": name, "object": "model", "created": 0, "owned_by": "faden"})
        })
        .collect();
    Bytes::from(serde_json::json!({"object": "list", "data": data}).to_string())
}
