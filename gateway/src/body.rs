//! The response body the gateway streams: upstream frames passed through as they arrive, with
//! the first-byte, idle and total timeouts, and an explicit failure when the upstream breaks.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use tokio::time::{Instant, Sleep};

use control_client::routing::ModelRoute;

use crate::balance::InflightGuard;
use crate::error::{ErrorKind, GatewayError};
use crate::metrics::{ActiveRequest, GenAiSeries};
use crate::route::Api;
use crate::sse;
use crate::telemetry::RequestSpan;
use crate::upstream::UpstreamBody;
use crate::usage::{JsonUsageScanner, SseUsageScanner, Usage};

/// How long the SSE error event has to leave before the response is aborted.
const ERROR_EVENT_FLUSH_GRACE: Duration = Duration::from_millis(20);

/// Every gateway response body: a complete body (errors, lists) or a proxied stream.
pub type GatewayBody = http_body_util::Either<Full<Bytes>, ProxyBody>;

/// Deadlines of one proxied response.
#[derive(Clone, Copy, Debug)]
pub struct Deadlines {
    /// Until the first body byte.
    pub first_byte: Instant,
    /// Between body chunks, once the first arrived.
    pub idle: Duration,
    /// The whole request.
    pub total: Instant,
}

#[derive(Debug)]
enum State {
    Streaming,
    /// The SSE error event went out; the next poll aborts the response.
    Failing(Option<GatewayError>),
    Done,
}

/// A proxied upstream body.
#[derive(Debug)]
pub struct ProxyBody {
    /// The upstream body (a pooled one reads its connection as it is polled, and gives the
    /// connection back to the pool at its end; see [`net::pool`]).
    inner: UpstreamBody,
    sse: bool,
    state: State,
    deadlines: Deadlines,
    /// The deadline in force (`sleep` may be set earlier, never later).
    armed: Instant,
    /// Created the first time the body waits: an answer that is complete when first read (a
    /// short non-streamed one) never registers a timer.
    sleep: Option<Pin<Box<Sleep>>>,
    got_first: bool,
    started: Instant,
    api: Api,
    /// The request in `faden_gateway_active_requests` (and its metrics), until this body drops.
    active: ActiveRequest,
    /// The request's count on its instance; its queued prefill ends at the first byte.
    inflight: InflightGuard,
    /// Reads the answer's token usage as it passes (see [`crate::usage`]).
    usage: Option<UsageTap>,
    /// The GenAI histograms of the answer's model, with its time to the first byte.
    genai: Option<(Arc<GenAiSeries>, Option<Duration>)>,
    /// The request's span, ended with the body.
    span: Option<Box<RequestSpan>>,
}

/// The usage scanner of one answer and the model its tokens are counted under.
#[derive(Debug)]
pub struct UsageTap {
    model: Arc<ModelRoute>,
    scanner: Scanner,
}

#[derive(Debug)]
enum Scanner {
    Sse(SseUsageScanner),
    Json(JsonUsageScanner),
}

impl UsageTap {
    /// A tap for an event stream (`sse`) or a JSON answer, counted under `model`'s name (the
    /// route of the routing snapshot: shared, not copied).
    pub fn new(model: Arc<ModelRoute>, sse: bool) -> Self {
        let scanner = if sse {
            Scanner::Sse(SseUsageScanner::new())
        } else {
            Scanner::Json(JsonUsageScanner::new())
        };
        Self { model, scanner }
    }

    fn feed(&mut self, chunk: &[u8]) {
        match &mut self.scanner {
            Scanner::Sse(s) => s.feed(chunk),
            Scanner::Json(s) => s.feed(chunk),
        }
    }

    fn usage(&self) -> Option<Usage> {
        match &self.scanner {
            Scanner::Sse(s) => s.usage(),
            Scanner::Json(s) => s.usage(),
        }
    }
}

impl ProxyBody {
    pub fn new(
        inner: UpstreamBody,
        sse: bool,
        deadlines: Deadlines,
        started: Instant,
        api: Api,
        active: ActiveRequest,
        inflight: InflightGuard,
    ) -> Self {
        let armed = deadlines.first_byte.min(deadlines.total);
        active.metrics().stream_started();
        Self {
            inner,
            sse,
            state: State::Streaming,
            deadlines,
            armed,
            sleep: None,
            got_first: false,
            started,
            api,
            active,
            inflight,
            usage: None,
            genai: None,
            span: None,
        }
    }

    /// Counts the answer's tokens from the usage it carries, if any.
    pub fn with_usage(mut self, tap: Option<UsageTap>) -> Self {
        self.usage = tap;
        self
    }

    /// Records the answer in the GenAI histograms `series`, and ends `span` with it.
    pub fn with_genai(mut self, series: Arc<GenAiSeries>, span: Option<Box<RequestSpan>>) -> Self {
        self.genai = Some((series, None));
        self.span = span;
        self
    }

    fn fail(&mut self, error: GatewayError) -> Poll<Option<Result<Frame<Bytes>, GatewayError>>> {
        self.active.metrics().upstream_error(error.kind);
        if let Some(span) = &mut self.span {
            span.error(error.kind.code());
        }
        tracing::warn!(kind = ?error.kind, error = %error, cause = ?error.cause, "upstream failed mid-response");
        if self.sse {
            let event = sse::error_event(&error);
            self.state = State::Failing(Some(error));
            // Give the server a moment to flush the event before the abort, which would
            // otherwise discard it with the rest of the connection's write buffer.
            let grace = Instant::now() + ERROR_EVENT_FLUSH_GRACE;
            match &mut self.sleep {
                Some(sleep) => sleep.as_mut().reset(grace),
                None => self.sleep = Some(Box::pin(tokio::time::sleep_until(grace))),
            }
            Poll::Ready(Some(Ok(Frame::data(event))))
        } else {
            self.state = State::Done;
            Poll::Ready(Some(Err(error)))
        }
    }

    fn timeout_error(&self, now: Instant) -> GatewayError {
        if now >= self.deadlines.total {
            GatewayError::new(
                ErrorKind::UpstreamTotalTimeout,
                "request exceeded the total timeout",
            )
        } else if !self.got_first {
            GatewayError::new(
                ErrorKind::UpstreamFirstByteTimeout,
                "no response from the model instance within the first-byte timeout",
            )
        } else {
            GatewayError::new(
                ErrorKind::UpstreamIdleTimeout,
                "the model instance sent nothing within the idle timeout",
            )
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = GatewayError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, GatewayError>>> {
        let this = &mut *self;
        match &mut this.state {
            State::Streaming => {}
            State::Failing(error) => {
                if let Some(sleep) = &mut this.sleep
                    && sleep.as_mut().poll(cx).is_pending()
                {
                    return Poll::Pending;
                }
                let error = error.take();
                this.state = State::Done;
                return Poll::Ready(error.map(Err));
            }
            State::Done => return Poll::Ready(None),
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if frame.is_data() {
                    let now = Instant::now();
                    if !this.got_first {
                        this.got_first = true;
                        let ttft = now - this.started;
                        this.active.metrics().ttft(this.api, ttft);
                        if let Some((series, first)) = &mut this.genai {
                            series.first_token(ttft);
                            *first = Some(ttft);
                        }
                        this.inflight.first_byte();
                    }
                    // Re-armed lazily, only when the body next waits.
                    this.armed = (now + this.deadlines.idle).min(this.deadlines.total);
                    if let (Some(tap), Some(data)) = (&mut this.usage, frame.data_ref()) {
                        tap.feed(data);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => this.fail(
                GatewayError::new(
                    ErrorKind::UpstreamProtocol,
                    "the model instance connection failed mid-response",
                )
                .with_cause(e),
            ),
            Poll::Ready(None) => {
                this.state = State::Done;
                Poll::Ready(None)
            }
            Poll::Pending => {
                // The timer only ever moves earlier here. Each chunk pushes the idle deadline
                // later; re-registering the timer for every chunk cost more than forwarding the
                // chunk, so an earlier timer is left as it is, and when it fires before the
                // current deadline it is re-armed then (once per idle period at most).
                let armed = this.armed;
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(armed)));
                if sleep.deadline() > armed {
                    sleep.as_mut().reset(armed);
                }
                loop {
                    match sleep.as_mut().poll(cx) {
                        Poll::Ready(()) if sleep.deadline() >= armed => {
                            let error = this.timeout_error(Instant::now());
                            return this.fail(error);
                        }
                        Poll::Ready(()) => sleep.as_mut().reset(armed),
                        Poll::Pending => return Poll::Pending,
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self.state {
            State::Streaming => self.inner.is_end_stream(),
            State::Failing(_) => false,
            State::Done => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self.state {
            State::Streaming if !self.sse => self.inner.size_hint(),
            _ => SizeHint::default(),
        }
    }
}

impl Drop for ProxyBody {
    fn drop(&mut self) {
        let metrics = self.active.metrics();
        metrics.stream_ended();
        if matches!(self.state, State::Streaming) && !self.inner.is_end_stream() {
            // The client went away (or the server aborted the connection): dropping `inner`
            // closes the upstream connection, which cancels the generation.
            // A complete body returns its connection to the pool as `inner` drops.
            metrics.client_disconnect();
        }
        let duration = self.started.elapsed();
        metrics.duration(self.api, duration);
        // Whatever usage went past, also when the client left after it.
        let usage = self.usage.as_ref().and_then(UsageTap::usage);
        if let (Some(tap), Some(u)) = (&self.usage, usage) {
            metrics.tokens(&tap.model.name, u);
        }
        if let Some((series, ttft)) = &self.genai {
            series.finished(duration, *ttft, usage);
        }
        if let Some(span) = self.span.take() {
            span.finish(usage);
        }
    }
}
impl GatewayError {
    /// The response the client sees.
    pub fn into_response(self) -> Response<GatewayBody> {
        let mut resp = json_response(self.kind.status(), self.body());
        if self.kind == ErrorKind::Unauthorized {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// A JSON response with a complete body.
pub fn json_response(status: StatusCode, body: Bytes) -> Response<GatewayBody> {
    let mut resp = Response::new(GatewayBody::Left(Full::new(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}
