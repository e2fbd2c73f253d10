//! A mock OpenAI-compatible inference engine with deterministic, timed output.
//!
//! It stands in for vLLM/SGLang behind the gateway in tests and benchmarks:
//!
//! - `POST /v1/chat/completions` and `POST /v1/completions`, streamed (SSE framed exactly like
//!   vLLM: one `data: {json}\n\n` per chunk and a final `data: [DONE]\n\n`) or not;
//!   `stream_options.include_usage` adds a usage chunk before `[DONE]`.
//! - `POST /v1/embeddings`, `GET /v1/models`, `GET /health`, `GET /healthz`; any other
//!   `POST /v1/...` answers a small JSON echo so that pass-through routes can be tested.
//!
//! Token `i` is the text `"tok{i} "`. The first token comes after `time_to_first_token`, token
//! `i` at `time_to_first_token + i * inter_token_delay` (an absolute schedule, so delays do not
//! drift). A streamed response sends its headers at once, as vLLM does, and the tokens in the body.
//!
//! [`MockStats`] counts requests and client disconnects (a request or stream dropped before it
//! finished) and keeps the last requests seen with their headers, so tests can await a disconnect
//! and assert what a proxy forwarded. Failures can be injected at run time through
//! [`MockEngineHandle`]: an error status for every inference call, or a stream that aborts its
//! connection after some tokens (an engine dying mid-stream).
//!
//! To stand in for a real engine under load, the timing can be jittered ([`Jitter`] on the time
//! to first token and on each inter-token delay), tokens can be padded to a size
//! ([`MockEngineConfig::bytes_per_token`]), and faults can be injected by rate ([`Faults`]:
//! errors, 429s, stalls before or after the first token, aborts mid-stream, slow reads of the
//! request body). Every random choice comes from [`MockEngineConfig::seed`] and the arrival index
//! of the inference request, so the faults among the first N requests are the same on every run
//! whatever the concurrency.
//!
//! # The performance model: an engine with a prefix cache
//!
//! [`MockEngineConfig::perf`] (`--kv-blocks N` with N > 0 on the command line) turns on a model
//! of an engine such as vLLM with prefix caching, so that routing by cache and by load can be
//! measured and tested against it. Off (the default), everything above holds unchanged.
//!
//! - **Prompt**: the request's canonical rendering, one token per 4 bytes, cut into blocks of
//!   [`PerfModel::block_tokens`] (16) tokens named by chained hashes (see [`prompt`]).
//! - **Queue**: at most [`PerfModel::max_running`] (64) requests run, in prefill or decode; the
//!   others wait in a FIFO queue, admitted in arrival order as running requests end.
//! - **Cache**: [`PerfModel::kv_blocks`] blocks. At admission the hit is the leading run of the
//!   prompt's blocks found cached, at most `(prompt_tokens - 1) / block_tokens` blocks (as in
//!   vLLM, the last prompt token is always computed); `cached_tokens = hit × block_tokens`. The
//!   hit blocks are pinned; when the prefill ends, the prompt's other whole blocks are cached and
//!   pinned, evicting the least recently used unpinned blocks (a block that finds no room is not
//!   cached, nor are the ones after it). When the request ends its blocks are unpinned, last block
//!   first: recency is when a block's last user finished, and a prompt's tail goes before its
//!   head.
//! - **Prefill**, one at a time in admission order, starting when the request is admitted or when
//!   the previous prefill ends, whichever is later:
//!   `prefill = time_to_first_token + prefill_per_token × (prompt_tokens − cached_tokens)`
//!   (`time_to_first_token` with its jitter is the fixed part; [`PerfModel::prefill_per_token`]
//!   is 50 µs by default). The first token is due when the prefill ends, so the time to first
//!   token is the wait in the queue, the wait for the prefill slot and the prefill itself.
//! - **Decode**: token `i + 1` is due `inter_token_delay + itl_per_running × running` after token
//!   `i` (the delay with its jitter; [`PerfModel::itl_per_running`], 0 by default, times the
//!   requests running when token `i` goes out).
//! - **Answers**: `usage.prompt_tokens` counts the rendering's tokens, and
//!   `usage.prompt_tokens_details.cached_tokens` the hit, in non-streamed answers and in the usage
//!   chunk of a stream.
//! - **Faults**: errors and 429s answer before the queue; injected stalls delay a request in its
//!   running slot (before or after its first token); aborts, slow reads and
//!   [`MockEngineHandle::set_fail_status`] work as without the model. A request whose client
//!   leaves is taken out of the queue, or out of the running set (a prefill cut short caches
//!   nothing).
//! - **Controls**: [`MockEngineHandle::stall`] stops the engine's clock (no admission, no prefill
//!   progress, no token: the queue grows) until [`MockEngineHandle::resume`], which shifts every
//!   schedule by the stall's length; [`MockEngineHandle::clear_cache`] forgets the cache (an
//!   engine restart); [`MockEngineHandle::model_stats`] and
//!   [`MockEngineHandle::wait_model_stats`] read the figures.
//! - **Deterministic**: every decision is taken under one lock in arrival order, so the same
//!   arrivals give the same hits and the same schedule; jitter and faults come from the seed.
//!
//! How it differs from real engines: vLLM tokenizes with the model's tokenizer and chat
//! template, uses 16-token blocks on GPUs and 128 on CPUs, chunks prefills and batches them with
//! the decode steps (a long prefill slows every running stream; several prefills share a step),
//! admits a request only when its blocks fit (preempting otherwise), caches the blocks of
//! generated tokens too, and counts in `kv_cache_usage_perc` every block held by running
//! requests (here: only their whole, cached prompt blocks). SGLang matches per token in a radix
//! tree (a hit can end mid-block) and evicts tree leaves by LRU.
//!
//! # Metrics
//!
//! `GET /metrics` answers Prometheus text with vLLM's names and labels
//! (`model_name="<model>",engine="0"`): `vllm:num_requests_running`,
//! `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (pinned blocks / `kv_blocks`),
//! `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (tokens, at admission),
//! `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
//! `vllm:cache_config_info{block_size,enable_prefix_caching,num_gpu_blocks,...} 1.0` and the
//! histogram `vllm:time_to_first_token_seconds` (the scheduled time: arrival to the first token's
//! due time). With the model off, running counts the generation requests in flight, waiting is 0,
//! the cache figures and the histogram are empty and `enable_prefix_caching="False"`. Scrapes are
//! counted apart ([`MockStats::scrapes`]), not in [`MockStats::requests`] nor the recorded
//! requests.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

mod args;
mod cache;
mod metrics;
mod perf;
pub mod prompt;

pub use args::PerfModelArgs;
pub use perf::{ModelStats, PerfModel};

use perf::{Model, Ticket, Timing};

/// Response header carrying the engine's sequence number of a request (ids derive from it).
pub const REQUEST_SEQ_HEADER: &str = "x-mock-request-seq";

/// How the mock engine behaves.
#[derive(Clone, Debug)]
pub struct MockEngineConfig {
    /// The served model name (listed by `/v1/models`, echoed in answers).
    pub model: String,
    /// Completion tokens per answer when the request sets no `max_tokens`.
    pub tokens: usize,
    /// Delay before the first token.
    pub time_to_first_token: Duration,
    /// Delay between two tokens.
    pub inter_token_delay: Duration,
    /// Length of each embedding vector.
    pub embedding_dims: usize,
    /// How many of the last requests [`MockStats::seen`] keeps (0 keeps none).
    pub record_limit: usize,
    /// Initial value of [`MockEngineHandle::set_fail_status`].
    pub fail_status: Option<u16>,
    /// Initial value of [`MockEngineHandle::set_abort_after_tokens`]. The abort happens when the
    /// next token is due, so with no inter-token delay the tokens before it may not be flushed.
    pub abort_after_tokens: Option<usize>,
    /// The `created` timestamp of every answer (fixed, so output is deterministic).
    pub created: u64,
    /// Random variation of the time to first token.
    pub ttft_jitter: Jitter,
    /// Random variation of each inter-token delay (drawn per token).
    pub itl_jitter: Jitter,
    /// Size of each token's text in bytes (`tok{i}` padded with `x`, then a space); 0 keeps the
    /// natural `"tok{i} "`. [`expected_stream`] assumes 0.
    pub bytes_per_token: usize,
    /// Faults injected by rate.
    pub faults: Faults,
    /// Seed of every random choice (jitter and faults).
    pub seed: u64,
    /// The performance model of an engine with a prefix cache (`None`: off, the timing above
    /// alone).
    pub perf: Option<PerfModel>,
}

/// Random variation around a delay, clamped at zero.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Jitter {
    /// The delay as configured.
    #[default]
    None,
    /// Uniform in `[delay - spread, delay + spread]`.
    Uniform(Duration),
    /// Normal with this standard deviation.
    Normal(Duration),
}

impl Jitter {
    fn apply(self, base: Duration, rng: &mut SplitMix64) -> Duration {
        let offset = match self {
            Self::None => return base,
            Self::Uniform(spread) => (rng.next_f64() * 2.0 - 1.0) * spread.as_secs_f64(),
            Self::Normal(sd) => rng.next_normal() * sd.as_secs_f64(),
        };
        Duration::try_from_secs_f64((base.as_secs_f64() + offset).max(0.0)).unwrap_or(base)
    }
}

/// Faults injected by rate: each rate is the probability (0 to 1) that one inference request
/// gets the fault. An error or a 429 replaces the answer; the other faults can combine.
#[derive(Clone, Debug)]
pub struct Faults {
    /// Share of requests answered with `error_status` and an OpenAI error body.
    pub error_rate: f64,
    /// Status of the injected errors.
    pub error_status: u16,
    /// Share of requests answered `429 Too Many Requests` (with `retry-after: 1`).
    pub rate_limit_rate: f64,
    /// Share of requests that wait `stall` more before their first token.
    pub stall_before_first_rate: f64,
    /// Share of requests that wait `stall` more after their first token.
    pub stall_after_first_rate: f64,
    /// How long a stall lasts.
    pub stall: Duration,
    /// Share of streams whose connection is aborted mid-stream (non-streamed answers are not
    /// aborted).
    pub abort_rate: f64,
    /// Tokens sent before a rate-injected abort (`None`: half of the answer's tokens).
    pub abort_after_tokens: Option<usize>,
    /// Share of requests whose body the engine reads slowly.
    pub slow_read_rate: f64,
    /// Reading speed of a slow read.
    pub slow_read_bytes_per_sec: u64,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            error_rate: 0.0,
            error_status: 500,
            rate_limit_rate: 0.0,
            stall_before_first_rate: 0.0,
            stall_after_first_rate: 0.0,
            stall: Duration::from_secs(3600),
            abort_rate: 0.0,
            abort_after_tokens: None,
            slow_read_rate: 0.0,
            slow_read_bytes_per_sec: 16 * 1024,
        }
    }
}

/// The faults drawn for one inference request.
#[derive(Clone, Copy, Debug, Default)]
struct Draw {
    error: bool,
    rate_limited: bool,
    stall_before: bool,
    stall_after: bool,
    abort: bool,
    slow_read: bool,
}

/// SplitMix64: a small, fast, seedable generator (deterministic across platforms and versions).
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn for_request(seed: u64, index: u64) -> Self {
        let mut rng = Self(seed ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03));
        rng.next_u64();
        rng
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn next_normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// True with probability `p` (always draws, so later draws do not depend on `p`).
    fn chance(&mut self, p: f64) -> bool {
        self.next_f64() < p
    }
}

impl Default for MockEngineConfig {
    fn default() -> Self {
        Self {
            model: "mock-model".to_owned(),
            tokens: 16,
            time_to_first_token: Duration::ZERO,
            inter_token_delay: Duration::ZERO,
            embedding_dims: 8,
            record_limit: 1024,
            fail_status: None,
            abort_after_tokens: None,
            created: 1_700_000_000,
            ttft_jitter: Jitter::None,
            itl_jitter: Jitter::None,
            bytes_per_token: 0,
            faults: Faults::default(),
            seed: 0,
            perf: None,
        }
    }
}

/// A request as the engine received it.
#[derive(Clone, Debug)]
pub struct SeenRequest {
    pub method: Method,
    /// Path and query.
    pub uri: String,
    pub version: http::Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// Counters and recorded requests, shared with the running engine.
#[derive(Debug)]
pub struct MockStats {
    requests: watch::Sender<u64>,
    disconnects: watch::Sender<u64>,
    connections: AtomicU64,
    completed: AtomicU64,
    aborted: AtomicU64,
    injected_errors: AtomicU64,
    rate_limited: AtomicU64,
    stalls: AtomicU64,
    slow_reads: AtomicU64,
    /// Generation requests between their arrival and their end.
    in_flight: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    scrapes: AtomicU64,
    /// Bumped when a figure of [`ModelStats`] may have changed.
    changes: watch::Sender<u64>,
    seen: Mutex<VecDeque<SeenRequest>>,
    record_limit: usize,
}

impl MockStats {
    fn new(record_limit: usize) -> Self {
        Self {
            requests: watch::Sender::new(0),
            disconnects: watch::Sender::new(0),
            connections: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            aborted: AtomicU64::new(0),
            injected_errors: AtomicU64::new(0),
            rate_limited: AtomicU64::new(0),
            stalls: AtomicU64::new(0),
            slow_reads: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            scrapes: AtomicU64::new(0),
            changes: watch::Sender::new(0),
            seen: Mutex::new(VecDeque::new()),
            record_limit,
        }
    }

    /// Requests received (every path but `GET /metrics`).
    pub fn requests(&self) -> u64 {
        *self.requests.borrow()
    }

    /// Connections accepted (a proxy that reuses its connections keeps this low).
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// Inference requests whose client went away before the answer was complete.
    pub fn disconnects(&self) -> u64 {
        *self.disconnects.borrow()
    }

    /// Inference answers sent completely.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    /// Streams the engine aborted on purpose (see [`MockEngineHandle::set_abort_after_tokens`]
    /// and [`Faults::abort_rate`]).
    pub fn aborted(&self) -> u64 {
        self.aborted.load(Ordering::Relaxed)
    }

    /// Requests answered with an error by [`Faults::error_rate`].
    pub fn injected_errors(&self) -> u64 {
        self.injected_errors.load(Ordering::Relaxed)
    }

    /// Requests answered 429 by [`Faults::rate_limit_rate`].
    pub fn rate_limited(&self) -> u64 {
        self.rate_limited.load(Ordering::Relaxed)
    }

    /// Requests that got a stall (before or after the first token).
    pub fn stalls(&self) -> u64 {
        self.stalls.load(Ordering::Relaxed)
    }

    /// Requests whose body was read slowly.
    pub fn slow_reads(&self) -> u64 {
        self.slow_reads.load(Ordering::Relaxed)
    }

    /// `GET /metrics` requests answered (counted apart from [`MockStats::requests`], so that a
    /// scraper does not disturb tests that count requests).
    pub fn scrapes(&self) -> u64 {
        self.scrapes.load(Ordering::Relaxed)
    }

    /// Waits until at least `n` client disconnects were seen.
    pub async fn wait_disconnects(&self, n: u64) {
        let mut rx = self.disconnects.subscribe();
        // The sender lives as long as `self`, so `wait_for` cannot fail here.
        let _ = rx.wait_for(|v| *v >= n).await;
    }

    /// Waits until at least `n` requests were received.
    pub async fn wait_requests(&self, n: u64) {
        let mut rx = self.requests.subscribe();
        let _ = rx.wait_for(|v| *v >= n).await;
    }

    /// The last requests received, oldest first.
    pub fn seen(&self) -> Vec<SeenRequest> {
        self.seen.lock().iter().cloned().collect()
    }

    /// The last request received.
    pub fn last_request(&self) -> Option<SeenRequest> {
        self.seen.lock().back().cloned()
    }

    fn record(&self, req: SeenRequest) {
        if self.record_limit == 0 {
            return;
        }
        let mut seen = self.seen.lock();
        if seen.len() >= self.record_limit {
            seen.pop_front();
        }
        seen.push_back(req);
    }
}

/// Behaviour that tests change while the engine runs.
#[derive(Debug)]
struct Controls {
    /// 0 = answer normally.
    fail_status: AtomicU16,
    /// `usize::MAX` = never abort.
    abort_after_tokens: AtomicUsize,
}

/// The mock engine.
#[derive(Debug)]
pub struct MockEngine;

/// A running mock engine. Dropping it stops the engine.
#[derive(Debug)]
pub struct MockEngineHandle {
    /// The bound address (`127.0.0.1:<ephemeral>`).
    pub addr: SocketAddr,
    /// Counters and recorded requests.
    pub stats: Arc<MockStats>,
    /// Cancelling it stops the engine and drops its connections.
    pub shutdown: CancellationToken,
    controls: Arc<Controls>,
    model: Option<Arc<Model>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl MockEngineHandle {
    /// Makes every inference call answer `status` with an OpenAI error body (`None`: normal).
    pub fn set_fail_status(&self, status: Option<u16>) {
        self.controls
            .fail_status
            .store(status.unwrap_or(0), Ordering::Relaxed);
    }

    /// Makes streams abort their connection after `tokens` tokens (`None`: never).
    pub fn set_abort_after_tokens(&self, tokens: Option<usize>) {
        self.controls
            .abort_after_tokens
            .store(tokens.unwrap_or(usize::MAX), Ordering::Relaxed);
    }

    /// The engine's port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Stalls the engine (performance model only): nothing is admitted, prefilled or generated,
    /// so the queue grows, until [`MockEngineHandle::resume`].
    pub fn stall(&self) {
        if let Some(model) = &self.model {
            model.stall();
        }
    }

    /// Ends a stall; the schedules of the requests in progress shift by its length.
    pub fn resume(&self) {
        if let Some(model) = &self.model {
            model.resume();
        }
    }

    /// Forgets the prefix cache, as an engine restart does (performance model only).
    pub fn clear_cache(&self) {
        if let Some(model) = &self.model {
            model.clear_cache();
        }
    }

    /// The engine's figures (those `GET /metrics` shows).
    pub fn model_stats(&self) -> ModelStats {
        model_stats(self.model.as_deref(), &self.stats).0
    }

    /// Waits until `done` holds for the engine's figures, and returns them.
    pub async fn wait_model_stats(&self, mut done: impl FnMut(&ModelStats) -> bool) -> ModelStats {
        let mut changes = self.stats.changes.subscribe();
        loop {
            let stats = self.model_stats();
            if done(&stats) {
                return stats;
            }
            // The sender lives as long as `self.stats`: `changed` cannot fail here.
            let _ = changes.changed().await;
        }
    }

    /// Stops the engine and waits for it.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for MockEngineHandle {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl MockEngine {
    /// Starts an engine on `127.0.0.1:0`.
    pub async fn start(config: MockEngineConfig) -> std::io::Result<MockEngineHandle> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        Self::start_on(listener, config)
    }

    /// Starts an engine on a bound listener (for `faden mock-engine --listen ...`).
    pub fn start_on(
        listener: TcpListener,
        config: MockEngineConfig,
    ) -> std::io::Result<MockEngineHandle> {
        let addr = listener.local_addr()?;
        let stats = Arc::new(MockStats::new(config.record_limit));
        let controls = Arc::new(Controls {
            fail_status: AtomicU16::new(config.fail_status.unwrap_or(0)),
            abort_after_tokens: AtomicUsize::new(config.abort_after_tokens.unwrap_or(usize::MAX)),
        });
        let shutdown = CancellationToken::new();
        let engine = Arc::new(Engine::new(config, stats.clone(), controls.clone()));
        let model = engine.model.clone();
        // Ends at `shutdown`; the handle keeps the task and aborts it when dropped.
        #[allow(clippy::disallowed_methods)]
        let task = tokio::spawn(accept_loop(listener, engine, shutdown.clone()));
        Ok(MockEngineHandle {
            addr,
            stats,
            shutdown,
            controls,
            model,
            task: Some(task),
        })
    }
}

async fn accept_loop(listener: TcpListener, engine: Arc<Engine>, shutdown: CancellationToken) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                engine.stats.connections.fetch_add(1, Ordering::Relaxed);
                let engine = engine.clone();
                conns.spawn(async move {
                    let service = service_fn(move |req| {
                        let engine = engine.clone();
                        async move { Ok::<_, Infallible>(engine.handle(req).await) }
                    });
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        }
    }
    // Dropping the set aborts every connection: the engine stops at once, like a killed process.
    conns.shutdown().await;
}

/// The body of an engine response.
pub type MockBody = http_body_util::Either<Full<Bytes>, SseBody>;

struct Engine {
    config: MockEngineConfig,
    /// The model name as a JSON string literal (quoted and escaped once).
    model_json: Arc<str>,
    stats: Arc<MockStats>,
    controls: Arc<Controls>,
    seq: AtomicU64,
    /// Arrival index of the next inference request (the key of its random draws).
    draws: AtomicU64,
    model: Option<Arc<Model>>,
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

/// What a generation endpoint streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completion,
}

impl Engine {
    fn new(config: MockEngineConfig, stats: Arc<MockStats>, controls: Arc<Controls>) -> Self {
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

    async fn handle(&self, req: Request<Incoming>) -> Response<MockBody> {
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
fn model_stats(model: Option<&Model>, stats: &MockStats) -> (ModelStats, perf::TtftHistogram) {
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

fn response_id(kind: StreamKind, seq: u64) -> String {
    match kind {
        StreamKind::Chat => format!("chatcmpl-mock-{seq}"),
        StreamKind::Completion => format!("cmpl-mock-{seq}"),
    }
}

fn prompt_tokens(body: &[u8]) -> usize {
    (body.len() / 4).max(1)
}

/// Renders the chunks of one answer; public through [`expected_stream`].
#[derive(Debug)]
struct Render {
    kind: StreamKind,
    id: Arc<str>,
    model_json: Arc<str>,
    created: u64,
    tokens: usize,
    prompt_tokens: usize,
    /// `usage.prompt_tokens_details.cached_tokens` (`None`: no details, as without the model).
    cached_tokens: Option<usize>,
    /// Bytes per token text (0: natural).
    pad: usize,
}

impl Render {
    /// Appends the text of token `i`: `tok{i} `, padded with `x` before the space to `pad` bytes.
    fn push_token(&self, i: usize, out: &mut String) {
        let start = out.len();
        out.push_str("tok");
        out.push_str(&i.to_string());
        let len = out.len() - start + 1;
        for _ in len..self.pad {
            out.push('x');
        }
        out.push(' ');
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (StreamKind::Chat, true) => "chat.completion.chunk",
            (StreamKind::Chat, false) => "chat.completion",
            (StreamKind::Completion, _) => "text_completion",
        }
    }

    fn usage(&self) -> String {
        let (p, t, c) = (
            self.prompt_tokens,
            self.prompt_tokens + self.tokens,
            self.tokens,
        );
        match self.cached_tokens {
            None => {
                format!(r#"{{"prompt_tokens":{p},"total_tokens":{t},"completion_tokens":{c}}}"#)
            }
            Some(cached) => format!(
                r#"{{"prompt_tokens":{p},"total_tokens":{t},"completion_tokens":{c},"prompt_tokens_details":{{"cached_tokens":{cached}}}}}"#
            ),
        }
    }

    /// The SSE event of token `i`.
    fn token_event(&self, i: usize) -> Bytes {
        let finish = if i + 1 == self.tokens {
            r#""length""#
        } else {
            "null"
        };
        let mut text = String::with_capacity(self.pad.max(8));
        self.push_token(i, &mut text);
        let choice = match self.kind {
            StreamKind::Chat if i == 0 => format!(
                r#"{{"index":0,"delta":{{"role":"assistant","content":"{text}"}},"logprobs":null,"finish_reason":{finish}}}"#
            ),
            StreamKind::Chat => format!(
                r#"{{"index":0,"delta":{{"content":"{text}"}},"logprobs":null,"finish_reason":{finish}}}"#
            ),
            StreamKind::Completion => {
                format!(r#"{{"index":0,"text":"{text}","logprobs":null,"finish_reason":{finish}}}"#)
            }
        };
        Bytes::from(format!(
            "data: {{\"id\":\"{id}\",\"object\":\"{o}\",\"created\":{c},\"model\":{m},\"choices\":[{choice}]}}\n\n",
            id = self.id,
            o = self.object(true),
            c = self.created,
            m = self.model_json,
        ))
    }

    fn usage_event(&self) -> Bytes {
        Bytes::from(format!(
            "data: {{\"id\":\"{id}\",\"object\":\"{o}\",\"created\":{c},\"model\":{m},\"choices\":[],\"usage\":{u}}}\n\n",
            id = self.id,
            o = self.object(true),
            c = self.created,
            m = self.model_json,
            u = self.usage(),
        ))
    }

    fn full(&self) -> String {
        let mut text = String::with_capacity(self.tokens * self.pad.max(6));
        for i in 0..self.tokens {
            self.push_token(i, &mut text);
        }
        let choice = match self.kind {
            StreamKind::Chat => format!(
                r#"{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"logprobs":null,"finish_reason":"length"}}"#
            ),
            StreamKind::Completion => {
                format!(r#"{{"index":0,"text":"{text}","logprobs":null,"finish_reason":"length"}}"#)
            }
        };
        format!(
            r#"{{"id":"{id}","object":"{o}","created":{c},"model":{m},"choices":[{choice}],"usage":{u}}}"#,
            id = self.id,
            o = self.object(false),
            c = self.created,
            m = self.model_json,
            u = self.usage(),
        )
    }
}

/// The final SSE event.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// The exact bytes the engine streams for a request, given the `x-mock-request-seq` it answered
/// with: one element per SSE event, in order. `model` is the configured model name.
pub fn expected_stream(
    kind: StreamKind,
    model: &str,
    created: u64,
    seq: u64,
    tokens: usize,
    prompt_bytes: usize,
    include_usage: bool,
) -> Vec<Bytes> {
    let render = Render {
        kind,
        id: response_id(kind, seq).into(),
        model_json: serde_json::to_string(model).unwrap_or_default().into(),
        created,
        tokens,
        prompt_tokens: prompt_tokens(&vec![0; prompt_bytes]),
        cached_tokens: None,
        pad: 0,
    };
    let mut out: Vec<Bytes> = (0..tokens).map(|i| render.token_event(i)).collect();
    if include_usage {
        out.push(render.usage_event());
    }
    out.push(Bytes::from_static(SSE_DONE));
    out
}

/// Counts a generation request in flight while it lives, and a disconnect when it is dropped
/// before it finished.
struct DisconnectGuard {
    stats: Arc<MockStats>,
    armed: bool,
}

impl DisconnectGuard {
    fn new(stats: Arc<MockStats>) -> Self {
        stats.in_flight.fetch_add(1, Ordering::Relaxed);
        stats.changes.send_modify(|n| *n += 1);
        Self { stats, armed: true }
    }
}

impl Drop for DisconnectGuard {
    fn drop(&mut self) {
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.stats.changes.send_modify(|n| *n += 1);
        if self.armed {
            self.stats.disconnects.send_modify(|n| *n += 1);
        }
    }
}

/// A stream's request in the performance model: between tokens, or waiting for the next one.
enum ModelRun {
    Ready(Ticket),
    Waiting(Pin<Box<dyn std::future::Future<Output = Ticket> + Send>>),
}

/// The injected mid-stream failure.
#[derive(Debug, thiserror::Error)]
#[error("mock engine aborted the stream")]
pub struct MockAbort;

/// A timed SSE body: one frame per event, each flushed as it is produced.
pub struct SseBody {
    render: Render,
    include_usage: bool,
    abort_after: usize,
    /// Next token to send.
    next: usize,
    /// After the tokens: 0 = usage (if any), 1 = `[DONE]`, 2 = finished.
    tail: u8,
    /// When the next token is due (an absolute schedule: delays do not drift).
    next_deadline: Instant,
    itl: Duration,
    itl_jitter: Jitter,
    /// Extra delay after the first token (an injected stall).
    stall_after: Duration,
    rng: SplitMix64,
    sleep: Option<Pin<Box<Sleep>>>,
    /// Under the performance model, the request's place in it (the timing fields above are then
    /// unused); dropped when the last token is out.
    run: Option<ModelRun>,
    guard: DisconnectGuard,
}

impl std::fmt::Debug for SseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SseBody")
            .field("next", &self.next)
            .field("tokens", &self.render.tokens)
            .finish_non_exhaustive()
    }
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = MockAbort;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, MockAbort>>> {
        let this = &mut *self;
        if this.next < this.render.tokens {
            if let Some(run) = this.run.take() {
                let mut wait = match run {
                    ModelRun::Waiting(wait) => wait,
                    ModelRun::Ready(mut ticket) => {
                        let i = this.next;
                        Box::pin(async move {
                            ticket.token(i).await;
                            ticket
                        })
                    }
                };
                let Poll::Ready(ticket) = wait.as_mut().poll(cx) else {
                    this.run = Some(ModelRun::Waiting(wait));
                    return Poll::Pending;
                };
                this.render.cached_tokens = Some(ticket.cached_tokens());
                // The request leaves the model with its last token.
                if this.next + 1 < this.render.tokens {
                    this.run = Some(ModelRun::Ready(ticket));
                }
            } else if this.next_deadline > Instant::now() {
                let deadline = this.next_deadline;
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if sleep.deadline() != deadline {
                    sleep.as_mut().reset(deadline);
                }
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            // The engine dies while producing this token (what it sent before is flushed).
            if this.next == this.abort_after {
                this.run = None;
                this.guard.armed = false;
                this.render.tokens = 0;
                this.tail = 2;
                this.guard.stats.aborted.fetch_add(1, Ordering::Relaxed);
                return Poll::Ready(Some(Err(MockAbort)));
            }
            let event = this.render.token_event(this.next);
            this.next += 1;
            this.guard
                .stats
                .generation_tokens
                .fetch_add(1, Ordering::Relaxed);
            this.next_deadline += this.itl_jitter.apply(this.itl, &mut this.rng);
            if this.next == 1 {
                this.next_deadline += this.stall_after;
            }
            return Poll::Ready(Some(Ok(Frame::data(event))));
        }
        if this.tail == 0 {
            this.tail = 1;
            if this.include_usage {
                return Poll::Ready(Some(Ok(Frame::data(this.render.usage_event()))));
            }
        }
        if this.tail == 1 {
            this.tail = 2;
            this.guard.armed = false;
            this.guard.stats.completed.fetch_add(1, Ordering::Relaxed);
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(SSE_DONE)))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.tail == 2
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
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

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use hyper_util::client::legacy::Client;

    fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
        Client::builder(TokioExecutor::new()).build_http()
    }

    fn post(addr: SocketAddr, path: &str, body: &str) -> Request<Full<Bytes>> {
        Request::post(format!("http://{addr}{path}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap()
    }

    #[tokio::test]
    async fn streams_tokens_then_usage_then_done() {
        let engine = MockEngine::start(MockEngineConfig {
            tokens: 3,
            ..Default::default()
        })
        .await
        .unwrap();
        let body =
            r#"{"model":"mock-model","stream":true,"stream_options":{"include_usage":true}}"#;
        let resp = tokio::time::timeout(
            Duration::from_secs(5),
            client().request(post(engine.addr, "/v1/chat/completions", body)),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(resp.status(), 200);
        let seq: u64 = resp.headers()[REQUEST_SEQ_HEADER]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let got = resp.into_body().collect().await.unwrap().to_bytes();
        let want: Vec<u8> = expected_stream(
            StreamKind::Chat,
            "mock-model",
            1_700_000_000,
            seq,
            3,
            body.len(),
            true,
        )
        .concat();
        assert_eq!(got, Bytes::from(want));
        assert!(got.ends_with(b"data: [DONE]\n\n"));
        assert_eq!(engine.stats.completed(), 1);
        assert_eq!(engine.stats.disconnects(), 0);
        let text = String::from_utf8(got.to_vec()).unwrap();
        for event in text.split("\n\n").filter(|e| !e.is_empty()) {
            let data = event.strip_prefix("data: ").unwrap();
            if data != "[DONE]" {
                let _: serde_json::Value = serde_json::from_str(data).unwrap();
            }
        }
    }

    #[tokio::test]
    async fn non_stream_and_embeddings_and_models() {
        let engine = MockEngine::start(MockEngineConfig::default())
            .await
            .unwrap();
        let c = client();
        let resp = c
            .request(post(
                engine.addr,
                "/v1/completions",
                r#"{"model":"m","max_tokens":2}"#,
            ))
            .await
            .unwrap();
        let v: serde_json::Value =
            serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(v["choices"][0]["text"], "tok0 tok1 ");
        assert_eq!(v["usage"]["completion_tokens"], 2);

        let resp = c
            .request(post(
                engine.addr,
                "/v1/embeddings",
                r#"{"model":"m","input":["a","b"]}"#,
            ))
            .await
            .unwrap();
        let v: serde_json::Value =
            serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(v["data"].as_array().unwrap().len(), 2);
        assert_eq!(v["data"][1]["embedding"].as_array().unwrap().len(), 8);

        let req = Request::get(format!("http://{}/v1/models", engine.addr))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = c.request(req).await.unwrap();
        let v: serde_json::Value =
            serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(v["data"][0]["id"], "mock-model");
        assert_eq!(engine.stats.seen().len(), 3);
    }

    #[tokio::test]
    async fn counts_a_disconnect_mid_stream() {
        let engine = MockEngine::start(MockEngineConfig {
            tokens: 100,
            inter_token_delay: Duration::from_millis(20),
            ..Default::default()
        })
        .await
        .unwrap();
        let resp = client()
            .request(post(
                engine.addr,
                "/v1/chat/completions",
                r#"{"stream":true}"#,
            ))
            .await
            .unwrap();
        let mut body = resp.into_body();
        let first = body.frame().await.unwrap().unwrap();
        assert!(first.data_ref().unwrap().starts_with(b"data: "));
        drop(body);
        tokio::time::timeout(Duration::from_secs(5), engine.stats.wait_disconnects(1))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn injected_failures() {
        let engine = MockEngine::start(MockEngineConfig {
            tokens: 5,
            inter_token_delay: Duration::from_millis(5),
            ..Default::default()
        })
        .await
        .unwrap();
        engine.set_fail_status(Some(503));
        let resp = client()
            .request(post(engine.addr, "/v1/chat/completions", "{}"))
            .await
            .unwrap();
        assert_eq!(resp.status(), 503);
        engine.set_fail_status(None);
        engine.set_abort_after_tokens(Some(2));
        let resp = client()
            .request(post(
                engine.addr,
                "/v1/chat/completions",
                r#"{"stream":true}"#,
            ))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert!(resp.into_body().collect().await.is_err());
        assert_eq!(engine.stats.aborted(), 1);
    }
}
