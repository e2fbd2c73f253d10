//! Answering requests: the routes, the injected faults, and the timed generation.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde::Deserialize;
use tokio::time::Instant;

use crate::perf::{self, Model, ModelStats, Timing};
use crate::render::{Render, StreamKind, prompt_tokens, response_id};
use crate::rng::SplitMix64;
use crate::sse::{DisconnectGuard, ModelRun, SseBody};
use crate::stats::{MockStats, SeenRequest};
use crate::{Draw, Jitter, MockEngineConfig, REQUEST_SEQ_HEADER, metrics, prompt};

/// Behaviour that tests change while the engine runs.
#[derive(Debug)]
pub(crate) struct Controls {
    /// 0 = answer normally.
    pub(crate) fail_status: AtomicU16,
    /// `usize::MAX` = never abort.
    pub(crate) abort_after_tokens: AtomicUsize,
}

/// The body of an engine response.
pub type MockBody = http_body_util::Either<Full<Bytes>, SseBody>;

pub(crate) struct Engine {
    pub(crate) config: MockEngineConfig,
    /// The model name as a JSON string literal (quoted and escaped once).
    pub(crate) model_json: Arc<str>,
    pub(crate) stats: Arc<MockStats>,
    pub(crate) controls: Arc<Controls>,
    pub(crate) seq: AtomicU64,
    /// Arrival index of the next inference request (the key of its random draws).
    pub(crate) draws: AtomicU64,
    pub(crate) model: Option<Arc<Model>>,
}

#[derive(Deserialize, Default)]
struct GenerationRequest {
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    max_completion_tokens: Option<usize>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct EmbeddingRequest {
    #[serde(default)]
    input: serde_json::Value,
}

impl Engine {
    pub(crate) fn new(
        config: MockEngineConfig,
        stats: Arc<MockStats>,
        controls: Arc<Controls>,
    ) -> Self {
        let model_json = serde_json::to_string(&config.model)
            .unwrap_or_else(|_| "\"mock-model\"".to_owned())
            .into();
        let model = config
            .perf
            .clone()
            .map(|perf| Arc::new(Model::new(perf, stats.clone())));
        Self {
            config,
            model_json,
            stats,
            controls,
            seq: AtomicU64::new(0),
            draws: AtomicU64::new(0),
            model,
        }
    }

    pub(crate) async fn handle(&self, req: Request<Incoming>) -> Response<MockBody> {
        if req.method() == Method::GET && req.uri().path() == "/metrics" {
            return self.metrics();
        }
        self.stats.requests.send_modify(|n| *n += 1);
        let (parts, body) = req.into_parts();
        let inference = parts.method == Method::POST
            && matches!(
                parts.uri.path(),
                "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings"
            );
        let (draw, rng) = if inference {
            self.draw()
        } else {
            (Draw::default(), SplitMix64(self.config.seed))
        };
        let body = if draw.slow_read {
            self.stats.slow_reads.fetch_add(1, Ordering::Relaxed);
            read_slowly(body, self.config.faults.slow_read_bytes_per_sec).await
        } else {
            body.collect().await.map(|b| b.to_bytes())
        };
        let Ok(body) = body else {
            return error(StatusCode::BAD_REQUEST, "could not read the body");
        };
        self.stats.record(SeenRequest {
            method: parts.method.clone(),
            uri: parts
                .uri
                .path_and_query()
                .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned()),
            version: parts.version,
            headers: parts.headers,
            body: body.clone(),
        });
        let path = parts.uri.path();
        match (&parts.method, path) {
            (&Method::GET, "/health" | "/healthz") => json(StatusCode::OK, Bytes::new()),
            (&Method::GET, "/v1/models") => self.models(),
            (&Method::POST, "/v1/chat/completions") => {
                self.generate(StreamKind::Chat, &body, draw, rng).await
            }
            (&Method::POST, "/v1/completions") => {
                self.generate(StreamKind::Completion, &body, draw, rng)
                    .await
            }
            (&Method::POST, "/v1/embeddings") => self.embeddings(&body, draw),
            (&Method::POST, p) if p.starts_with("/v1/") => self.echo(p, &body),
            _ => error(StatusCode::NOT_FOUND, "not found"),
        }
    }

    fn injected_failure(&self) -> Option<Response<MockBody>> {
        let status = self.controls.fail_status.load(Ordering::Relaxed);
        let status = StatusCode::from_u16(status).ok()?;
        Some(error(status, "injected failure"))
    }

    /// The faults of the next inference request, and its generator for the jitter.
    fn draw(&self) -> (Draw, SplitMix64) {
        let index = self.draws.fetch_add(1, Ordering::Relaxed);
        let mut rng = SplitMix64::for_request(self.config.seed, index);
        let f = &self.config.faults;
        // A fixed number of draws per request, so each fault's choice does not depend on the
        // other rates.
        let draw = Draw {
            error: rng.chance(f.error_rate),
            rate_limited: rng.chance(f.rate_limit_rate),
            stall_before: rng.chance(f.stall_before_first_rate),
            stall_after: rng.chance(f.stall_after_first_rate),
            abort: rng.chance(f.abort_rate),
            slow_read: rng.chance(f.slow_read_rate),
        };
        (draw, rng)
    }

    /// The error or 429 a draw replaces the answer with.
    fn drawn_failure(&self, draw: Draw) -> Option<Response<MockBody>> {
        if draw.error {
            self.stats.injected_errors.fetch_add(1, Ordering::Relaxed);
            let status = StatusCode::from_u16(self.config.faults.error_status)
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return Some(error(status, "injected failure"));
        }
        if draw.rate_limited {
            self.stats.rate_limited.fetch_add(1, Ordering::Relaxed);
            let mut resp = error(StatusCode::TOO_MANY_REQUESTS, "rate limited (injected)");
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return Some(resp);
        }
        None
    }

    fn metrics(&self) -> Response<MockBody> {
        self.stats.scrapes.fetch_add(1, Ordering::Relaxed);
        let (stats, ttft) = model_stats(self.model.as_deref(), &self.stats);
        let page = metrics::Page {
            model: &self.config.model,
            block_tokens: self.model.as_ref().map_or(16, |m| m.config().block_tokens),
            prefix_caching: self.model.is_some(),
        };
        let mut resp = json(
            StatusCode::OK,
            Bytes::from(metrics::render(&page, &stats, &ttft)),
        );
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        );
        resp
    }

    fn models(&self) -> Response<MockBody> {
        let body = format!(
            r#"{{"object":"list","data":[{{"id":{m},"object":"model","created":{c},"owned_by":"faden-mock","root":{m},"parent":null}}]}}"#,
            m = self.model_json,
            c = self.config.created,
        );
        json(StatusCode::OK, Bytes::from(body))
    }

    fn echo(&self, path: &str, body: &Bytes) -> Response<MockBody> {
        if let Some(resp) = self.injected_failure() {
            return resp;
        }
        let path = serde_json::to_string(path).unwrap_or_default();
        let text = format!(
            r#"{{"object":"mock.echo","path":{path},"model":{m},"body_bytes":{n}}}"#,
            m = self.model_json,
            n = body.len()
        );
        self.stats.completed.fetch_add(1, Ordering::Relaxed);
        json(StatusCode::OK, Bytes::from(text))
    }

    fn embeddings(&self, body: &Bytes, draw: Draw) -> Response<MockBody> {
        if let Some(resp) = self.injected_failure().or_else(|| self.drawn_failure(draw)) {
            return resp;
        }
        let Ok(req) = serde_json::from_slice::<EmbeddingRequest>(body) else {
            return error(StatusCode::BAD_REQUEST, "invalid JSON body");
        };
        let inputs = match &req.input {
            serde_json::Value::Array(items) => items.len().max(1),
            _ => 1,
        };
        let mut data = String::with_capacity(inputs * (32 + self.config.embedding_dims * 6));
        for i in 0..inputs {
            if i > 0 {
                data.push(',');
            }
            data.push_str(r#"{"object":"embedding","index":"#);
            data.push_str(&i.to_string());
            data.push_str(r#","embedding":["#);
            for d in 0..self.config.embedding_dims {
                if d > 0 {
                    data.push(',');
                }
                // Deterministic values in [0, 1).
                data.push_str(&format!("{:.3}", ((i * 31 + d * 7) % 1000) as f64 / 1000.0));
            }
            data.push_str("]}");
        }
        let prompt_tokens = prompt_tokens(body);
        let text = format!(
            r#"{{"object":"list","data":[{data}],"model":{m},"usage":{{"prompt_tokens":{prompt_tokens},"total_tokens":{prompt_tokens}}}}}"#,
            m = self.model_json,
        );
        self.stats.completed.fetch_add(1, Ordering::Relaxed);
        json(StatusCode::OK, Bytes::from(text))
    }

    async fn generate(
        &self,
        kind: StreamKind,
        body: &Bytes,
        draw: Draw,
        mut rng: SplitMix64,
    ) -> Response<MockBody> {
        if let Some(resp) = self.injected_failure().or_else(|| self.drawn_failure(draw)) {
            return resp;
        }
        let req = if body.is_empty() {
            GenerationRequest::default()
        } else {
            match serde_json::from_slice::<GenerationRequest>(body) {
                Ok(r) => r,
                Err(e) => return error(StatusCode::BAD_REQUEST, &format!("invalid JSON: {e}")),
            }
        };
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let tokens = req
            .max_tokens
            .or(req.max_completion_tokens)
            .unwrap_or(self.config.tokens);
        // Under the model, the prompt is its canonical rendering (see `prompt`); its tokens are
        // counted when the request is admitted.
        let prompt = self.model.as_ref().map(|model| {
            let rendered = prompt::render_prompt(kind, body).unwrap_or_default();
            let blocks = prompt::block_hashes(&rendered, model.config().block_tokens);
            (prompt::token_count(rendered.len()), blocks)
        });
        let prompt_tokens = match &prompt {
            Some((tokens, _)) => *tokens,
            None => {
                let n = prompt_tokens(body);
                self.stats
                    .prompt_tokens
                    .fetch_add(n as u64, Ordering::Relaxed);
                n
            }
        };
        let mut render = Render {
            kind,
            id: response_id(kind, seq).into(),
            model_json: self.model_json.clone(),
            created: self.config.created,
            tokens,
            prompt_tokens,
            cached_tokens: self.model.as_ref().map(|_| 0),
            pad: self.config.bytes_per_token,
        };
        let guard = DisconnectGuard::new(self.stats.clone());
        let start = Instant::now();
        let seq_header = HeaderValue::from(seq);
        let faults = &self.config.faults;
        let fixed = self
            .config
            .ttft_jitter
            .apply(self.config.time_to_first_token, &mut rng);
        let stall_before = if draw.stall_before {
            faults.stall
        } else {
            Duration::ZERO
        };
        let stall_after = if draw.stall_after {
            faults.stall
        } else {
            Duration::ZERO
        };
        if draw.stall_before || draw.stall_after {
            self.stats.stalls.fetch_add(1, Ordering::Relaxed);
        }
        let ticket = self.model.as_ref().zip(prompt).map(|(model, (n, blocks))| {
            let timing = Timing {
                fixed,
                stall_before,
                stall_after,
                itl: self.config.inter_token_delay,
                itl_jitter: self.config.itl_jitter,
                rng: rng.clone(),
            };
            model.enqueue(blocks, n, timing)
        });

        if req.stream {
            let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
            let mut abort_after = self.controls.abort_after_tokens.load(Ordering::Relaxed);
            if draw.abort {
                abort_after = abort_after.min(faults.abort_after_tokens.unwrap_or(tokens / 2));
            }
            let body = SseBody {
                render,
                include_usage,
                abort_after,
                next: 0,
                tail: 0,
                next_deadline: start + fixed + stall_before,
                itl: self.config.inter_token_delay,
                itl_jitter: self.config.itl_jitter,
                stall_after,
                rng,
                sleep: None,
                run: ticket.map(ModelRun::Ready),
                guard,
            };
            let mut resp = Response::new(http_body_util::Either::Right(body));
            let h = resp.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream; charset=utf-8"),
            );
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            h.insert(REQUEST_SEQ_HEADER, seq_header);
            return resp;
        }

        let mut guard = guard;
        if let Some(mut ticket) = ticket {
            for i in 0..tokens {
                ticket.token(i).await;
            }
            render.cached_tokens = Some(ticket.cached_tokens());
        } else if tokens > 0 {
            let mut last = fixed + stall_before;
            if tokens > 1 {
                last += stall_after;
            }
            if self.config.itl_jitter == Jitter::None {
                let gaps = u32::try_from(tokens - 1).unwrap_or(u32::MAX);
                last += self.config.inter_token_delay * gaps;
            } else {
                for _ in 1..tokens {
                    last += self
                        .config
                        .itl_jitter
                        .apply(self.config.inter_token_delay, &mut rng);
                }
            }
            // No timer at all for an instant answer (the benchmark setting): the engine is
            // on the same cores as what it measures.
            if !last.is_zero() {
                tokio::time::sleep_until(start + last).await;
            }
        }
        self.stats
            .generation_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
        guard.armed = false;
        self.stats.completed.fetch_add(1, Ordering::Relaxed);
        let mut resp = json(StatusCode::OK, Bytes::from(render.full()));
        resp.headers_mut().insert(REQUEST_SEQ_HEADER, seq_header);
        resp
    }
}

/// The figures of [`MockEngineHandle::model_stats`] and the TTFT histogram; with the model off,
/// the in-flight requests count as running and the cache figures are zero.
pub(crate) fn model_stats(
    model: Option<&Model>,
    stats: &MockStats,
) -> (ModelStats, perf::TtftHistogram) {
    match model {
        Some(model) => model.snapshot(),
        None => {
            let in_flight = stats.in_flight.load(Ordering::Relaxed);
            let figures = ModelStats {
                running: usize::try_from(in_flight).unwrap_or(usize::MAX),
                prompt_tokens: stats.prompt_tokens.load(Ordering::Relaxed),
                generation_tokens: stats.generation_tokens.load(Ordering::Relaxed),
                ..ModelStats::default()
            };
            (figures, perf::TtftHistogram::default())
        }
    }
}

/// Reads a body at about `bytes_per_sec` (an engine slow to take a large prompt).
async fn read_slowly(mut body: Incoming, bytes_per_sec: u64) -> Result<Bytes, hyper::Error> {
    let start = Instant::now();
    let mut read = 0u64;
    let mut out = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            read += data.len() as u64;
            out.extend_from_slice(&data);
            let due = Duration::from_secs_f64(read as f64 / bytes_per_sec.max(1) as f64);
            tokio::time::sleep_until(start + due).await;
        }
    }
    Ok(out.freeze())
}

fn json(status: StatusCode, body: Bytes) -> Response<MockBody> {
    let mut resp = Response::new(http_body_util::Either::Left(Full::new(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn error(status: StatusCode, message: &str) -> Response<MockBody> {
    let body = serde_json::json!({
        "error": {"message": message, "type": "mock_error", "code": status.as_u16()}
    });
    json(status, Bytes::from(body.to_string()))
}
