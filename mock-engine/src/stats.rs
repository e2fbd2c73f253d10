//! The counters and recorded requests that tests read.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{HeaderMap, Method};
use parking_lot::Mutex;
use tokio::sync::watch;

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
    pub(crate) requests: watch::Sender<u64>,
    pub(crate) disconnects: watch::Sender<u64>,
    pub(crate) connections: AtomicU64,
    pub(crate) completed: AtomicU64,
    pub(crate) aborted: AtomicU64,
    pub(crate) injected_errors: AtomicU64,
    pub(crate) rate_limited: AtomicU64,
    pub(crate) stalls: AtomicU64,
    pub(crate) slow_reads: AtomicU64,
    /// Generation requests between their arrival and their end.
    pub(crate) in_flight: AtomicU64,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) generation_tokens: AtomicU64,
    pub(crate) scrapes: AtomicU64,
    /// Bumped when a figure of [`ModelStats`] may have changed.
    pub(crate) changes: watch::Sender<u64>,
    pub(crate) seen: Mutex<VecDeque<SeenRequest>>,
    pub(crate) record_limit: usize,
}

impl MockStats {
    pub(crate) fn new(record_limit: usize) -> Self {
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

    /// Streams the engine aborted on purpose (see
    /// [`MockEngineHandle::set_abort_after_tokens`](crate::MockEngineHandle::set_abort_after_tokens)
    /// and [`Faults::abort_rate`](crate::Faults::abort_rate)).
    pub fn aborted(&self) -> u64 {
        self.aborted.load(Ordering::Relaxed)
    }

    /// Requests answered with an error by [`Faults::error_rate`](crate::Faults::error_rate).
    pub fn injected_errors(&self) -> u64 {
        self.injected_errors.load(Ordering::Relaxed)
    }

    /// Requests answered 429 by [`Faults::rate_limit_rate`](crate::Faults::rate_limit_rate).
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

    pub(crate) fn record(&self, req: SeenRequest) {
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
