//! What the engines say of their own load, per model instance: read from each engine's
//! Prometheus endpoint by whoever sits next to it (the worker agent), carried to the gateways in
//! memory (never through the store's revisioned log), and read by the routing policy.
//!
//! A reading is only as good as it is fresh: [`EngineLoads::get`] hands out readings younger
//! than [`MAX_AGE`] and nothing else, so an engine whose metrics stop (or never existed) is
//! routed by the gateway's own accounting alone.
//!
//! - [`parse`]: an engine's Prometheus page → its load (vLLM's and SGLang's names);
//! - [`wire`]: the newline-delimited JSON lines the readings travel in (worker → server →
//!   standalone gateways), with each reading's age;
//! - [`follow`]: a standalone gateway's subscription to a server's table.

pub mod follow;
pub mod parse;
pub mod wire;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::time::Instant;

/// Readings older than this are ignored.
pub const MAX_AGE: Duration = Duration::from_secs(2);

/// The longest a load stream stays silent: a sender with nothing to say writes an empty line
/// this often, so that a receiver can tell a dead peer from a quiet one.
pub const KEEPALIVE: Duration = Duration::from_secs(5);

/// One engine's load, as its metrics report it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    /// Requests queued, not yet running (`vllm:num_requests_waiting`, `sglang:num_queue_reqs`).
    pub waiting: u32,
    /// Requests running (prefill or decode; `vllm:num_requests_running`,
    /// `sglang:num_running_reqs`).
    pub running: u32,
    /// Share of the KV cache in use, 0 to 1 (`vllm:kv_cache_usage_perc`, `sglang:token_usage`).
    pub kv_usage: Option<f32>,
    /// Tokens per KV-cache block (`vllm:cache_config_info{block_size}`).
    pub block_size: Option<u32>,
    /// KV-cache blocks in all (`vllm:cache_config_info{num_gpu_blocks}`).
    pub num_blocks: Option<u64>,
    /// Changes whenever the engine's cache was lost since the last reading (a restart: its
    /// counters went back, or it was unreachable in between): the gateway forgets what it
    /// routed there.
    pub epoch: u64,
}

impl EngineLoad {
    /// The engine's KV cache in tokens, when it says.
    pub fn cache_tokens(&self) -> Option<u64> {
        Some(u64::from(self.block_size?) * self.num_blocks?)
    }
}

/// A reading and when it was taken.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading {
    pub load: EngineLoad,
    /// When the engine was read (on this process's clock).
    pub taken: Instant,
}

impl Reading {
    /// Whether the reading is young enough to route by.
    pub fn is_fresh(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.taken) <= MAX_AGE
    }
}

/// The latest reading of every instance that reports one, by instance id. Read without a lock
/// (one atomic load); written by one task at a time (the server's ingestion, or a gateway's
/// subscription), each write replacing the whole map.
#[derive(Debug, Default)]
pub struct EngineLoads {
    readings: ArcSwap<HashMap<i64, Reading>>,
}

impl EngineLoads {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The instance's reading, when there is a fresh one.
    pub fn get(&self, instance_id: i64, now: Instant) -> Option<Reading> {
        self.readings
            .load()
            .get(&instance_id)
            .copied()
            .filter(|r| r.is_fresh(now))
    }

    /// Every reading held now, fresh or not.
    pub fn all(&self) -> Arc<HashMap<i64, Reading>> {
        self.readings.load_full()
    }

    /// Merges `readings` in, and drops readings older than `MAX_AGE` (so that the map holds
    /// only instances that report).
    pub fn update(&self, readings: impl IntoIterator<Item = (i64, Reading)>, now: Instant) {
        let mut next: HashMap<i64, Reading> = self
            .readings
            .load()
            .iter()
            .filter(|(_, r)| r.is_fresh(now))
            .map(|(id, r)| (*id, *r))
            .collect();
        next.extend(readings);
        self.readings.store(Arc::new(next));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn readings_expire_and_are_merged() {
        let loads = EngineLoads::default();
        let t0 = Instant::now();
        let busy = EngineLoad {
            waiting: 3,
            running: 8,
            ..EngineLoad::default()
        };
        loads.update(
            [(
                1,
                Reading {
                    load: busy,
                    taken: t0,
                },
            )],
            t0,
        );
        assert_eq!(loads.get(1, t0).map(|r| r.load), Some(busy));
        assert_eq!(loads.get(2, t0), None);
        let later = t0 + MAX_AGE + Duration::from_millis(1);
        assert_eq!(loads.get(1, later), None, "stale readings are ignored");
        loads.update(
            [(
                2,
                Reading {
                    load: EngineLoad::default(),
                    taken: later,
                },
            )],
            later,
        );
        assert_eq!(
            loads.all().len(),
            1,
            "stale readings are dropped at the next update"
        );
    }
}
