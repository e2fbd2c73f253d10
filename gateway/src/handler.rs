//! The request path, as explicit phases.
//!
//! 1. **classify**: path → target (404), method (405).
//!
//! An inference call then goes through the phases of `Inference`, one method each, in this
//! order (`Inference::run`):
//!
//! 2. **authenticate**: key from `Authorization: Bearer` / `X-API-Key`, checked against the
//!    snapshot taken for this request (401; 429 with `Retry-After` from a source address past
//!    its limit of refused keys, while a valid key is served from any source). In front of GPUStack, a key the
//!    snapshot does not hold goes to [`crate::RemoteKeys`] (401, or 503 when the server cannot
//!    say), before any body is read.
//! 3. **read body**: whole body into one `Bytes` under a size limit (413) and a deadline (408).
//! 4. **resolve**: `model` from the JSON (or multipart) body without re-serialising it (400),
//!    then its route in the snapshot (404, 503); a remote key is checked for that model (403
//!    when it may not call it). The request for the upstream is readied once: the API's path
//!    with the client's query, the body, the client's headers sanitised, and the gateway's
//!    `traceparent` ([`crate::trace_context`]; the span of [`crate::telemetry`] when spans are
//!    exported).
//! 5. **pick**: P2C over the route's instances, minus ejected and already tried, and the
//!    [`Route`] to the picked one for its `proxy_mode`.
//! 6. **forward**: an [`UpstreamRequest`] (that route, the readied request) handed to the
//!    transport of the route, which writes its own wire request; on a failure that cannot have
//!    started work, once more on another instance (`forward_with_retry`).
//! 7. **respond**: pass status and headers on (hop-by-hop stripped), stream the body through
//!    [`ProxyBody`] with the idle and total timeouts.
//!
//! A failure of any phase is answered in the OpenAI shape, logged and counted for the model
//! once it is known (`Inference::reject`). The snapshot is read once per request, so one
//! request never mixes two routing states.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use control_client::key_check::CheckError;
use control_client::model::ProxyMode;
use control_client::routing::{Endpoint, ModelRoute, RoutingSnapshot};
use futures_util::FutureExt as _;
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};

use net::h1::ClientBody;
use tokio::time::Instant;
use tokio_util::either::Either;

use crate::Gateway;
use crate::auth::{self, Caller};
use crate::balance::{InflightGuard, Outcome, Pick};
use crate::body::json_response;
use crate::body::{Deadlines, GatewayBody, ProxyBody, UsageTap};
use crate::error::{ErrorKind, GatewayError};
use crate::metrics::{ActiveRequest, CLIENT_CLOSED_REQUEST, ROUTE_OTHER};
use crate::policy::{self, Decision, RouteRequest};
use crate::prompt::PromptShape;
use crate::route::{self, Api, Target};
use crate::sse;
use crate::telemetry::RequestSpan;
use crate::trace_context;
use crate::upstream::{self, Route, UpstreamBody, UpstreamRequest};
use crate::usage;
use net::headers::{self, X_ACCEL_BUFFERING, X_FADEN_NO_SUCH_INSTANCE};

/// The client's session hint: requests that carry the same value are routed together (the
/// OpenAI `user` member is taken when the header is absent).
const SESSION_HEADER: &str = "x-session-id";

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

    /// Phases 2 to 7 of an inference call ([`Inference::run`]), then the count of its end.
    #[allow(clippy::manual_async_fn)] // on purpose, see the comment inside
    fn inference(
        &self,
        api: Api,
        mut parts: Parts,
        mut body: ClientBody,
        peer: SocketAddr,
        started: Instant,
    ) -> impl Future<Output = Response<GatewayBody>> + Send + '_ {
        // An `async move` block rather than an `async fn`: the arguments are used where they
        // were captured instead of being copied into a second slot of the future (the phases
        // borrow them for the same reason).
        async move {
            // One snapshot for the whole request.
            let snapshot = self.inner.snapshots.load();
            let mut request = Inference::new(self, &snapshot, api, peer, started);
            match request.run(&mut parts, &mut body).await {
                Ok(response) => response,
                Err(e) => request.reject(e),
            }
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
                    if let Err(blocked) = self.inner.auth_limiter.failed(peer.ip()) {
                        return GatewayError::blocked(blocked);
                    }
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
}

/// One inference call on its way through the phases (see the module documentation): what every
/// phase reads, and the model once it is known.
struct Inference<'r> {
    gateway: &'r Gateway,
    /// The routing state of the whole request.
    snapshot: &'r RoutingSnapshot,
    api: Api,
    peer: SocketAddr,
    started: Instant,
    deadlines: Deadlines,
    /// Set by [`Inference::resolve`]: the label of the request's metrics.
    model: Option<&'r Arc<ModelRoute>>,
    /// The request in flight, until an answer takes it over ([`Inference::respond`]) or is
    /// chosen ([`Inference::reject`]). Still here when the request is dropped: its client left
    /// before any answer (see the `Drop` impl).
    active: Option<ActiveRequest>,
    /// The request's span, when spans are exported ([`crate::telemetry`]); boxed, so that a
    /// gateway without them carries one pointer.
    span: Option<Box<RequestSpan>>,
}

impl Drop for Inference<'_> {
    /// A request dropped unanswered (its client closed the connection, so the server dropped
    /// its future, in any phase up to the answer's head, retries included) is counted once: as
    /// a client disconnect and under status 499. Everything it held (its count on an instance,
    /// a pooled connection mid-exchange) is released by its own guard as the future drops.
    fn drop(&mut self) {
        if let Some(active) = self.active.take() {
            let metrics = active.metrics();
            metrics.client_disconnect();
            let model = self.model.map_or("", |m| m.name.as_str());
            metrics.request(model, self.api.suffix(), CLIENT_CLOSED_REQUEST);
            if let Some(span) = &mut self.span {
                span.status(CLIENT_CLOSED_REQUEST);
                span.error("client_closed_request");
            }
        }
    }
}

/// What every attempt sends, whatever the instance: the rest of an [`UpstreamRequest`].
struct Outgoing {
    path_and_query: PathAndQuery,
    headers: HeaderMap,
    body: Bytes,
}

impl Outgoing {
    /// The request of one attempt, by `route`. The headers are moved into the `last` request
    /// that can be made (every request but a first one that might be retried): no copy of the
    /// map per request.
    fn request(&mut self, route: Route, last: bool) -> UpstreamRequest {
        let headers = if last {
            std::mem::take(&mut self.headers)
        } else {
            self.headers.clone()
        };
        UpstreamRequest {
            method: Method::POST,
            path_and_query: self.path_and_query.clone(),
            headers,
            body: self.body.clone(),
            route,
        }
    }
}

impl<'r> Inference<'r> {
    fn new(
        gateway: &'r Gateway,
        snapshot: &'r RoutingSnapshot,
        api: Api,
        peer: SocketAddr,
        started: Instant,
    ) -> Self {
        let timeouts = &gateway.inner.config.timeouts;
        let total = started + timeouts.total;
        let deadlines = Deadlines {
            first_byte: (started + timeouts.first_byte).min(total),
            idle: timeouts.idle,
            total,
        };
        Self {
            gateway,
            snapshot,
            api,
            peer,
            started,
            deadlines,
            model: None,
            active: Some(gateway.inner.metrics.request_arrived()),
            span: None,
        }
    }

    /// Phases 2 to 7, in order. `parts` and `body` are the client's request, borrowed rather
    /// than moved into this future (see [`Gateway::inference`]).
    async fn run(
        &mut self,
        parts: &mut Parts,
        body: &mut ClientBody,
    ) -> Result<Response<GatewayBody>, GatewayError> {
        if let Some(telemetry) = &self.gateway.inner.telemetry {
            self.span = Some(Box::new(telemetry.request_span(&parts.headers, self.api)));
        }
        let caller = self.authenticate(&parts.headers).await?;
        let body = self.read_body(body).await?;
        let (model, hints) = self.resolve(caller, &parts.headers, &body).await?;
        let mut outgoing = self.outgoing(parts, body, hints.streamed_without_options)?;
        let (response, inflight, endpoint) = self
            .forward_with_retry(model, &hints, &mut outgoing)
            .await?;
        if let Some(span) = &mut self.span {
            span.instance(endpoint);
        }
        Ok(self.respond(model, response, inflight))
    }

    /// Phase 2: the caller's key (see [`Gateway::authenticate`]).
    async fn authenticate<'h>(&self, headers: &'h HeaderMap) -> Result<Caller<'h>, GatewayError> {
        self.gateway
            .authenticate(self.snapshot, headers, self.peer)
            .await
    }

    /// Phase 3: the whole body, under the size limit and the body deadline.
    async fn read_body(&self, body: &mut ClientBody) -> Result<Bytes, GatewayError> {
        let config = &self.gateway.inner.config;
        let max = config.max_body_bytes;
        let too_large = || {
            GatewayError::new(
                ErrorKind::PayloadTooLarge,
                format!("request body is larger than {max} bytes"),
            )
        };
        // The declared length is the body's exact size hint (both servers take it from
        // `Content-Length`; the native one leaves that header out of the map).
        let declared = http_body::Body::size_hint(&*body).exact();
        if declared.is_some_and(|n| n > max as u64) {
            return Err(too_large());
        }
        let read = collect_body(body, max, declared);
        let deadline = self.started + config.timeouts.request_body;
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

    /// Phase 4: the model the request names and its route, which must have an instance; a key
    /// left to the management server is checked for that model. Also whether the JSON body
    /// asks for a stream without `stream_options`.
    async fn resolve(
        &mut self,
        caller: Caller<'_>,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<(&'r Arc<ModelRoute>, Hints), GatewayError> {
        let (model, hints) = resolve_route(self.snapshot, headers, body)?;
        self.model = Some(model);
        if let Some(span) = &mut self.span {
            span.model(self.api, &model.name);
        }
        if let Caller::Remote(key) = caller {
            self.gateway
                .check_remote(key, Some(&model.name), self.peer)
                .await?;
        }
        if model.endpoints.is_empty() {
            return Err(GatewayError::new(
                ErrorKind::NoRoutableInstance,
                format!("model {:?} has no running instance", model.name),
            ));
        }
        Ok((model, hints))
    }

    /// Phase 4, end: what goes upstream. The API's path with the client's query, the body (a
    /// stream asked without `stream_options` is asked for its usage when tokens are counted),
    /// and the client's headers sanitised: `content-length` goes too, since every transport
    /// frames the buffered body itself.
    fn outgoing(
        &self,
        parts: &mut Parts,
        body: Bytes,
        streamed_without_options: bool,
    ) -> Result<Outgoing, GatewayError> {
        let path_and_query = match parts.uri.query() {
            Some(q) => PathAndQuery::try_from(format!("{}?{q}", self.api.upstream_path()))
                .map_err(|e| {
                    GatewayError::new(ErrorKind::BadRequest, "invalid query string").with_cause(e)
                })?,
            None => self.api.upstream_path_and_query(),
        };
        let body = match self.api {
            Api::ChatCompletions | Api::Completions
                if self.gateway.inner.config.count_tokens && streamed_without_options =>
            {
                usage::add_include_usage(&body).map_or(body, Bytes::from)
            }
            _ => body,
        };
        let mut headers = std::mem::take(&mut parts.headers);
        headers::sanitize_request(&mut headers);
        // The engine's parent is the gateway's span, in the client's trace when it sent one.
        let context = self.trace_context(&headers);
        trace_context::inject(&mut headers, &context);
        // A body without a content type was read as JSON (phase 4 refuses it otherwise), and
        // some engines refuse a JSON body that does not say so (`transformers serve`: 422).
        if !headers.contains_key(header::CONTENT_TYPE) {
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
        Ok(Outgoing {
            path_and_query,
            headers,
            body,
        })
    }

    /// The gateway's span context for this request: under the client's `traceparent` when it
    /// is valid, else in a new trace.
    fn trace_context(&self, headers: &HeaderMap) -> opentelemetry::trace::SpanContext {
        match &self.span {
            Some(span) => span.context().clone(),
            None => trace_context::child_of(trace_context::extract(headers)),
        }
    }

    /// Phases 5 and 6: pick an instance, forward; on a failure that cannot have started work,
    /// once more on another instance. The answer comes with the request counted outstanding on
    /// its instance. The last request that can be made takes `outgoing`'s headers.
    async fn forward_with_retry(
        &self,
        model: &'r ModelRoute,
        hints: &Hints,
        outgoing: &mut Outgoing,
    ) -> Result<(Response<UpstreamBody>, InflightGuard, &'r Endpoint), GatewayError> {
        let attempts = if self.gateway.inner.config.retry {
            MAX_ATTEMPTS
        } else {
            1
        };
        // Instances tried so far: `tried[..attempt]`.
        let mut tried = [0i64; MAX_ATTEMPTS];
        let mut last_error = None;
        for attempt in 0..attempts {
            let Some(decision) = self.pick(model, hints, &tried[..attempt]) else {
                break;
            };
            let pick = &decision.pick;
            tried[attempt] = pick.endpoint.instance_id;
            if attempt > 0 {
                self.gateway.inner.metrics.retry();
            }
            let inflight = decision.start();
            let route = match self.route(pick) {
                Ok(route) => route,
                Err(e) => {
                    // Nothing was sent: another instance (maybe on another path) may do.
                    last_error = Some(e);
                    continue;
                }
            };
            let last = attempt + 1 >= attempts || attempt + 1 >= model.endpoints.len();
            match self.forward(pick, outgoing.request(route, last)).await {
                Ok(response) => return Ok((response, inflight, pick.endpoint)),
                Err(e) => {
                    let retry = e.kind.retryable();
                    last_error = Some(e);
                    if !retry {
                        break;
                    }
                }
            }
        }
        Err(last_error.unwrap_or_else(|| {
            GatewayError::new(
                ErrorKind::NoRoutableInstance,
                format!("no instance of model {:?} can take the request", model.name),
            )
        }))
    }

    /// Phase 5: an instance of `model` not in `tried`, by the model's routing policy
    /// ([`crate::policy`]; ejected ones last), counted by the reason for it.
    fn pick(&self, model: &'r ModelRoute, hints: &Hints, tried: &[i64]) -> Option<Decision<'r>> {
        let inner = &self.gateway.inner;
        let config = &inner.config.routing;
        let decision = policy::choose(
            &inner.balancer,
            &model.endpoints,
            tried,
            model.policy.unwrap_or(config.default),
            config,
            RouteRequest {
                prompt: hints.prompt.as_ref(),
                session: hints.session,
            },
            inner.engine_loads.as_deref(),
        )?;
        inner.metrics.route_decision(&model.name, decision.reason);
        Some(decision)
    }

    /// Phase 5, end: the route to the picked instance, with the worker credential of its
    /// endpoint (kept with the instance's balancer state, so no parse per request).
    fn route(&self, pick: &Pick<'_>) -> Result<Route, GatewayError> {
        let inner = &self.gateway.inner;
        let per_endpoint;
        let worker_credential = match &inner.worker_credentials {
            Some(resolve) if pick.endpoint.proxy_mode != ProxyMode::Direct => {
                per_endpoint = resolve(pick.endpoint);
                per_endpoint
                    .as_ref()
                    .or(inner.worker_authorization.as_ref())
            }
            _ => inner.worker_authorization.as_ref(),
        };
        upstream::route_cached(
            &pick.state.reach,
            pick.endpoint,
            worker_credential,
            inner.tunnel.is_some(),
        )
    }

    /// Phase 6, one attempt: `request` through the transport of its route, its outcome
    /// reported to the balancer and the metrics ([`Inference::settle`]).
    fn forward<'a>(
        &'a self,
        pick: &'a Pick<'r>,
        request: UpstreamRequest,
    ) -> impl Future<Output = Result<Response<UpstreamBody>, GatewayError>> + Send + 'a {
        let inner = &self.gateway.inner;
        // The transports bound the wait for the response head themselves (the pool on a
        // timer each connection keeps: `Upstream::send`).
        let first_byte = self.deadlines.first_byte;
        let sent = match (&request.route, &inner.tunnel) {
            (Route::Tunnel { .. }, Some(tunnel)) => {
                Either::Left(tunnel.send(pick.endpoint, request, first_byte))
            }
            _ => Either::Right(inner.pool.request(pick.endpoint, request, first_byte)),
        };
        // A combinator, not an `async` block: the transport's future is kept once, without the
        // request beside it.
        sent.map(move |sent| self.settle(pick, sent))
    }

    /// What an attempt came to, reported to the balancer and the metrics. The worker proxy's
    /// answer that it does not host the instance is an error (nothing started: another
    /// instance may take it).
    fn settle(
        &self,
        pick: &Pick<'_>,
        sent: Result<Response<UpstreamBody>, GatewayError>,
    ) -> Result<Response<UpstreamBody>, GatewayError> {
        let inner = &self.gateway.inner;
        let Deadlines {
            first_byte, total, ..
        } = self.deadlines;
        let result = match sent {
            Err(e) if e.kind == ErrorKind::UpstreamFirstByteTimeout && first_byte >= total => {
                Err(GatewayError::new(
                    ErrorKind::UpstreamTotalTimeout,
                    "request exceeded the total timeout",
                ))
            }
            Ok(response) if is_no_such_instance(&response) => Err(GatewayError::new(
                ErrorKind::UpstreamNoSuchInstance,
                "the worker does not host this model instance",
            )),
            sent => sent,
        };
        match &result {
            Ok(response) => {
                let outcome = if response.status().is_server_error() {
                    Outcome::Failure
                } else {
                    Outcome::Success
                };
                inner.balancer.report(&pick.state, outcome);
            }
            Err(e) => {
                if e.kind.counts_against_instance() {
                    inner.balancer.report(&pick.state, Outcome::Failure);
                }
                inner.metrics.upstream_error(e.kind);
                tracing::debug!(instance = pick.endpoint.instance_id, kind = ?e.kind, cause = ?e.cause, "attempt failed");
            }
        }
        result
    }

    /// Phase 7: status and headers passed on (hop-by-hop stripped, an event stream marked not
    /// to be buffered), the body streamed through [`ProxyBody`] with the idle and total
    /// timeouts and, for answers that report usage, the usage tap.
    fn respond(
        &mut self,
        model: &Arc<ModelRoute>,
        response: Response<UpstreamBody>,
        inflight: InflightGuard,
    ) -> Response<GatewayBody> {
        let (mut head, incoming) = response.into_parts();
        headers::sanitize_response(&mut head.headers);
        let content_type = head.headers.get(header::CONTENT_TYPE);
        let is_sse = sse::is_event_stream_type(content_type);
        let usage = usage_tap(self.api, model, head.status, is_sse, content_type);
        if is_sse {
            head.headers
                .insert(X_ACCEL_BUFFERING, HeaderValue::from_static("no"));
        }
        head.version = http::Version::default();
        let metrics = &self.gateway.inner.metrics;
        metrics.request(&model.name, self.api.suffix(), head.status.as_u16());
        let genai = metrics.genai(&model.name, self.api);
        let mut span = self.span.take();
        if let Some(span) = &mut span {
            span.status(head.status.as_u16());
        }
        let active = self
            .active
            .take()
            .unwrap_or_else(|| metrics.request_arrived());
        let body = ProxyBody::new(
            incoming,
            is_sse,
            self.deadlines,
            self.started,
            self.api,
            active,
            inflight,
        )
        .with_usage(usage)
        .with_genai(genai, span);
        Response::from_parts(head, GatewayBody::Right(body))
    }

    /// A failed phase: answered in the OpenAI shape, logged and counted for the model when it
    /// is known.
    fn reject(&mut self, error: GatewayError) -> Response<GatewayBody> {
        // Answered: counted under the error's status, and no longer in flight.
        self.active = None;
        if let Some(mut span) = self.span.take() {
            span.status(error.kind.status().as_u16());
            span.error(error.kind.code());
        }
        let model = self.model.map_or("", |m| m.name.as_str());
        self.gateway.reject(model, self.api.suffix(), error)
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
    body: &mut ClientBody,
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
                // Split here: the inference future keeps the parts it was given, not a request
                // and then its parts beside it.
                let (parts, body) = req.into_parts();
                this.inference(api, parts, body, peer, started).await
            }
        }
    }
}

/// What phase 4 reads from a request besides its model: whether its JSON body asks for a
/// stream without `stream_options` ([`route::JsonRequest::streamed_without_options`]), and
/// what the routing policy goes by.
#[derive(Debug, Default)]
struct Hints {
    streamed_without_options: bool,
    prompt: Option<PromptShape>,
    /// The client's session hint (`x-session-id`, else the OpenAI `user` member), hashed.
    session: Option<u64>,
}

/// The route of the model a request names, and the request's [`Hints`].
fn resolve_route<'s>(
    snapshot: &'s RoutingSnapshot,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(&'s Arc<ModelRoute>, Hints), GatewayError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mut hints = Hints {
        session: headers
            .get(SESSION_HEADER)
            .filter(|v| !v.is_empty())
            .map(|v| session_key(v.as_bytes())),
        ..Hints::default()
    };
    let from_body = if content_type
        .trim_start()
        .get(..19)
        .is_some_and(|p| p.eq_ignore_ascii_case("multipart/form-data"))
    {
        route::model_from_multipart(content_type, body)
    } else {
        let request = route::read_json_request_with(body, true)?;
        hints.streamed_without_options = request.streamed_without_options;
        hints.prompt = request.prompt;
        if hints.session.is_none() {
            hints.session = request.user.as_deref().map(|u| session_key(u.as_bytes()));
        }
        request.model.ok_or_else(route::missing_model)
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
    Ok((route, hints))
}

/// A session hint as the policy's affinity key.
fn session_key(hint: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(hint)
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
