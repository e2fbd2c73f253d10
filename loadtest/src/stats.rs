//! Recording: HDR histograms of the timings and counters of the outcomes.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::time::Instant;

use crate::client::{ErrorClass, Outcome, micros};

/// Highest recordable value (one hour, in microseconds); larger values are clamped.
const MAX_MICROS: u64 = 3_600_000_000;

fn histogram() -> Result<Histogram<u64>, hdrhistogram::CreationError> {
    // 3 significant digits from 1 µs to 1 h: about 190 KB.
    Histogram::new_with_bounds(1, MAX_MICROS, 3)
}

/// Failed requests by class.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ErrorCounts {
    /// TCP connect or HTTP handshake failed.
    pub connect: u64,
    /// Connection reset or closed before the response head.
    pub io: u64,
    /// No complete answer within `--timeout`.
    pub timeout: u64,
    /// Streams ended with neither a finish reason nor `[DONE]`, broken off, or with an SSE error
    /// event.
    pub stream_broken: u64,
    /// Open loop: due while `--max-outstanding` requests were in flight (never sent).
    pub dropped: u64,
    /// Non-2xx answers by status code.
    pub http_status: BTreeMap<u16, u64>,
}

impl ErrorCounts {
    /// Every failed request.
    pub fn total(&self) -> u64 {
        self.connect
            + self.io
            + self.timeout
            + self.stream_broken
            + self.dropped
            + self.http_status.values().sum::<u64>()
    }

    /// Answers with this status.
    pub fn status(&self, code: u16) -> u64 {
        self.http_status.get(&code).copied().unwrap_or(0)
    }

    pub(crate) fn add(&mut self, class: ErrorClass) {
        match class {
            ErrorClass::Connect => self.connect += 1,
            ErrorClass::Io => self.io += 1,
            ErrorClass::Timeout => self.timeout += 1,
            ErrorClass::StreamBroken => self.stream_broken += 1,
            ErrorClass::Dropped => self.dropped += 1,
            ErrorClass::Status(code) => *self.http_status.entry(code).or_default() += 1,
        }
    }

    fn merge(&mut self, other: &Self) {
        self.connect += other.connect;
        self.io += other.io;
        self.timeout += other.timeout;
        self.stream_broken += other.stream_broken;
        self.dropped += other.dropped;
        for (code, n) in &other.http_status {
            *self.http_status.entry(*code).or_default() += n;
        }
    }
}

/// Everything measured in a phase (or merged from several).
#[derive(Debug)]
pub(crate) struct Recorder {
    /// End-to-end latency of successful requests, µs.
    pub(crate) latency: Histogram<u64>,
    /// Time to first token, µs.
    pub(crate) ttft: Histogram<u64>,
    /// Inter-token latency, µs.
    pub(crate) itl: Histogram<u64>,
    /// Time per output token after the first, µs.
    pub(crate) tpot: Histogram<u64>,
    /// Open loop: how late the generator sent each request after it was due, µs.
    pub(crate) send_lag: Histogram<u64>,
    /// Requests sent (dropped ones are not).
    pub(crate) sent: u64,
    pub(crate) ok: u64,
    pub(crate) errors: ErrorCounts,
    pub(crate) output_tokens: u64,
    /// Prompt tokens and prefix-cache hits of the successful requests (from their usage).
    pub(crate) cache: CacheCounts,
    /// Successful requests by target (index in the run's URLs).
    pub(crate) ok_by_target: Vec<u64>,
}

/// Prompt tokens and the engines' prefix-cache hits, from the answers' `usage`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheCounts {
    /// Sum of `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// Sum of `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Successful answers that carried `usage.prompt_tokens`.
    pub prompt_reported: u64,
    /// Successful answers that carried `cached_tokens` (engines that do not count cache hits
    /// leave it out: then the hit rate is 0 for want of data, not for want of hits).
    pub cached_reported: u64,
}

impl CacheCounts {
    /// Cached over prompt tokens, when any prompt tokens were reported.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.cached_tokens as f64 / self.prompt_tokens as f64)
    }

    fn merge(&mut self, other: &Self) {
        self.prompt_tokens += other.prompt_tokens;
        self.cached_tokens += other.cached_tokens;
        self.prompt_reported += other.prompt_reported;
        self.cached_reported += other.cached_reported;
    }
}

impl Recorder {
    pub(crate) fn new() -> Result<Self, hdrhistogram::CreationError> {
        Ok(Self {
            latency: histogram()?,
            ttft: histogram()?,
            itl: histogram()?,
            tpot: histogram()?,
            send_lag: histogram()?,
            sent: 0,
            ok: 0,
            errors: ErrorCounts::default(),
            output_tokens: 0,
            cache: CacheCounts::default(),
            ok_by_target: Vec::new(),
        })
    }

    /// Records a finished request that was due at `start`.
    pub(crate) fn record(&mut self, start: Instant, end: Instant, out: &Outcome) {
        self.sent += 1;
        if let Some(class) = out.error {
            self.errors.add(class);
            return;
        }
        self.ok += 1;
        if self.ok_by_target.len() <= out.target {
            self.ok_by_target.resize(out.target + 1, 0);
        }
        self.ok_by_target[out.target] += 1;
        if let Some(p) = out.prompt_tokens {
            self.cache.prompt_tokens += p;
            self.cache.prompt_reported += 1;
            if let Some(c) = out.cached_tokens {
                self.cache.cached_tokens += c;
                self.cache.cached_reported += 1;
            }
        }
        self.latency
            .saturating_record(micros(end.saturating_duration_since(start)));
        let tokens = out.tokens();
        self.output_tokens += tokens;
        if let Some(first) = out.first_token {
            self.ttft
                .saturating_record(micros(first.saturating_duration_since(start)));
        }
        for &gap in &out.itls {
            self.itl.saturating_record(gap);
        }
        if let (Some(first), Some(last)) = (out.first_token, out.last_token)
            && tokens > 1
        {
            let per = last.saturating_duration_since(first)
                / u32::try_from(tokens - 1).unwrap_or(u32::MAX);
            self.tpot.saturating_record(micros(per));
        }
    }

    /// Records a request that was never sent.
    pub(crate) fn record_error(&mut self, class: ErrorClass) {
        self.errors.add(class);
    }

    pub(crate) fn merge(&mut self, other: &Self) {
        // Same bounds everywhere, so adding cannot fail.
        let _ = self.latency.add(&other.latency);
        let _ = self.ttft.add(&other.ttft);
        let _ = self.itl.add(&other.itl);
        let _ = self.tpot.add(&other.tpot);
        let _ = self.send_lag.add(&other.send_lag);
        self.sent += other.sent;
        self.ok += other.ok;
        self.errors.merge(&other.errors);
        self.output_tokens += other.output_tokens;
        self.cache.merge(&other.cache);
        if self.ok_by_target.len() < other.ok_by_target.len() {
            self.ok_by_target.resize(other.ok_by_target.len(), 0);
        }
        for (mine, theirs) in self.ok_by_target.iter_mut().zip(&other.ok_by_target) {
            *mine += theirs;
        }
    }
}

/// Percentiles of a histogram, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Recorded values.
    pub count: u64,
    pub mean_ms: f64,
    pub min_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    /// The distribution at [`CDF_QUANTILES`]: `[quantile, ms]` pairs, for plots.
    pub cdf: Vec<[f64; 2]>,
}

/// Quantiles at which [`Summary::cdf`] samples the distribution: dense in the tail.
pub const CDF_QUANTILES: [f64; 22] = [
    0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.98, 0.99,
    0.995, 0.998, 0.999, 0.9999, 1.0,
];

impl Summary {
    pub(crate) fn of(h: &Histogram<u64>) -> Option<Self> {
        if h.is_empty() {
            return None;
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Some(Self {
            count: h.len(),
            mean_ms: h.mean() / 1000.0,
            min_ms: ms(h.min()),
            p50_ms: ms(h.value_at_quantile(0.5)),
            p90_ms: ms(h.value_at_quantile(0.9)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            p999_ms: ms(h.value_at_quantile(0.999)),
            max_ms: ms(h.max()),
            cdf: CDF_QUANTILES
                .iter()
                .map(|&q| [q, ms(h.value_at_quantile(q))])
                .collect(),
        })
    }
}
