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

use std::time::Duration;

mod args;
mod cache;
mod engine;
mod metrics;
mod perf;
pub mod prompt;
mod render;
mod rng;
mod server;
mod sse;
mod stats;
#[cfg(test)]
mod tests;

pub use args::PerfModelArgs;
pub use engine::MockBody;
pub use perf::{ModelStats, PerfModel};
pub use render::{SSE_DONE, StreamKind, expected_stream};
pub use server::{MockEngine, MockEngineHandle};
pub use sse::{MockAbort, SseBody};
pub use stats::{MockStats, SeenRequest};

use rng::SplitMix64;

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
