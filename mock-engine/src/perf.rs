//! The performance model of an inference engine with a prefix cache (see the crate docs for the
//! model itself).
//!
//! Everything is decided under one lock, in arrival order, on an engine clock that stops while
//! the engine is stalled: a request's admission, its cache hit and its prefill's end are computed
//! when it is admitted (prefills are serialized, so each one starts where the previous one ends);
//! its blocks enter the cache when its prefill ends (applied lazily, before anyone looks at the
//! cache); each decode step is computed from the running count when the previous token goes out.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::Jitter;
use crate::cache::BlockCache;
use crate::rng::SplitMix64;
use crate::stats::MockStats;

/// The performance model's parameters (see the crate docs). `MockEngineConfig::perf: Some(..)`
/// turns it on.
#[derive(Clone, Debug, PartialEq)]
pub struct PerfModel {
    /// KV-cache blocks (0: nothing is ever cached, the scheduling still applies).
    pub kv_blocks: usize,
    /// Tokens per block (at least 1).
    pub block_tokens: usize,
    /// Requests running at once, in prefill or decode (at least 1); more wait in a FIFO queue.
    pub max_running: usize,
    /// Prefill time per uncached prompt token (prefills run one at a time).
    pub prefill_per_token: Duration,
    /// Decode time added to each inter-token delay per running request.
    pub itl_per_running: Duration,
}

impl Default for PerfModel {
    fn default() -> Self {
        Self {
            kv_blocks: 4096,
            block_tokens: 16,
            max_running: 64,
            prefill_per_token: Duration::from_micros(50),
            itl_per_running: Duration::ZERO,
        }
    }
}

/// The model's figures (and, with the model off, the few that still mean something: running is
/// the inference requests in flight, the token counters count).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelStats {
    /// Requests admitted and not finished (prefill or decode).
    pub running: usize,
    /// Requests queued for admission.
    pub waiting: usize,
    /// The cache's size in blocks.
    pub kv_blocks: usize,
    /// Blocks cached.
    pub cached_blocks: usize,
    /// Cached blocks pinned by running requests.
    pub used_blocks: usize,
    /// Prompt tokens looked up in the cache (at admission).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found cached.
    pub prefix_cache_hits: u64,
    /// Prompt tokens of the generation requests answered.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// First tokens sent (the count of the TTFT histogram).
    pub ttft_count: u64,
    /// Sum of the scheduled times to first token (arrival to the first token's due time:
    /// exact, without the timer's lateness).
    pub ttft_sum: Duration,
    /// Whether [`crate::MockEngineHandle::stall`] holds the engine.
    pub stalled: bool,
}

/// Upper bounds of vLLM's `time_to_first_token_seconds` buckets.
pub(crate) const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// The TTFT histogram: counts per bucket (not cumulative), then the sum.
#[derive(Clone, Debug, Default)]
pub(crate) struct TtftHistogram {
    pub(crate) buckets: [u64; TTFT_BUCKETS.len()],
    pub(crate) count: u64,
    pub(crate) sum: Duration,
}

impl TtftHistogram {
    fn observe(&mut self, ttft: Duration) {
        let secs = ttft.as_secs_f64();
        if let Some(i) = TTFT_BUCKETS.iter().position(|le| secs <= *le) {
            self.buckets[i] += 1;
        }
        self.count += 1;
        self.sum += ttft;
    }
}

/// The running model, shared by the engine's requests.
#[derive(Debug)]
pub(crate) struct Model {
    config: PerfModel,
    /// Engine time 0.
    start: Instant,
    state: Mutex<State>,
    /// Bumped when a stall ends.
    resumed: watch::Sender<u64>,
    stats: Arc<MockStats>,
}

#[derive(Debug)]
struct State {
    cache: BlockCache,
    waiting: VecDeque<Waiting>,
    /// Admitted requests by id.
    running: HashMap<u64, Running>,
    /// Admitted requests whose blocks are not cached yet, in the order their prefills end.
    prefilling: VecDeque<u64>,
    /// When the prefill in progress ends (engine time).
    prefill_free_at: Duration,
    /// Since when the engine is stalled (real time).
    stalled_since: Option<Instant>,
    /// Real time spent stalled before `stalled_since`: engine time = real - start - stalled.
    stalled: Duration,
    next_id: u64,
    queries: u64,
    hits: u64,
    ttft: TtftHistogram,
}

#[derive(Debug)]
struct Waiting {
    id: u64,
    blocks: Vec<u64>,
    tokens: usize,
    /// The fixed part of its prefill.
    fixed: Duration,
    admitted: oneshot::Sender<Admitted>,
}

#[derive(Debug)]
struct Running {
    blocks: Vec<u64>,
    /// Leading blocks pinned in the cache of `epoch`.
    pinned: usize,
    epoch: u64,
    prefill_end: Duration,
}

#[derive(Clone, Copy, Debug)]
struct Admitted {
    /// When the prefill ends (engine time).
    prefill_end: Duration,
    cached_tokens: usize,
}

impl State {
    /// Engine time at real time `now`.
    fn engine_time(&self, start: Instant, now: Instant) -> Duration {
        self.stalled_since
            .unwrap_or(now)
            .saturating_duration_since(start)
            .saturating_sub(self.stalled)
    }

    /// Caches the blocks of the prefills that ended by `now`.
    fn finish_prefills(&mut self, now: Duration) {
        while let Some(&id) = self.prefilling.front() {
            let Some(run) = self.running.get_mut(&id) else {
                self.prefilling.pop_front();
                continue;
            };
            if run.prefill_end > now {
                break;
            }
            self.prefilling.pop_front();
            if run.epoch != self.cache.epoch() {
                run.epoch = self.cache.epoch();
                run.pinned = 0;
            }
            // A block not cached leaves the ones after it useless: stop there.
            while run.pinned < run.blocks.len() && self.cache.acquire(run.blocks[run.pinned]) {
                run.pinned += 1;
            }
        }
    }
}

impl Model {
    pub(crate) fn new(config: PerfModel, stats: Arc<MockStats>) -> Self {
        let config = PerfModel {
            block_tokens: config.block_tokens.max(1),
            max_running: config.max_running.max(1),
            ..config
        };
        Self {
            state: Mutex::new(State {
                cache: BlockCache::new(config.kv_blocks),
                waiting: VecDeque::new(),
                running: HashMap::new(),
                prefilling: VecDeque::new(),
                prefill_free_at: Duration::ZERO,
                stalled_since: None,
                stalled: Duration::ZERO,
                next_id: 0,
                queries: 0,
                hits: 0,
                ttft: TtftHistogram::default(),
            }),
            config,
            start: Instant::now(),
            resumed: watch::Sender::new(0),
            stats,
        }
    }

    pub(crate) fn config(&self) -> &PerfModel {
        &self.config
    }

    /// Queues a request whose prompt has `tokens` tokens and these block hashes; it is admitted
    /// at once when a slot is free. Dropping the ticket takes the request out.
    pub(crate) fn enqueue(self: &Arc<Self>, blocks: Vec<u64>, tokens: usize, t: Timing) -> Ticket {
        let arrival = Instant::now();
        let (tx, rx) = oneshot::channel();
        let id = {
            let mut s = self.state.lock();
            let id = s.next_id;
            s.next_id += 1;
            s.waiting.push_back(Waiting {
                id,
                blocks,
                tokens,
                fixed: t.fixed,
                admitted: tx,
            });
            let now = s.engine_time(self.start, arrival);
            self.admit(&mut s, now);
            id
        };
        self.changed();
        Ticket {
            model: self.clone(),
            id,
            admission: Some(rx),
            arrival,
            next: Duration::ZERO,
            cached_tokens: 0,
            timing: t,
        }
    }

    /// Admits waiting requests while slots are free and the engine is not stalled.
    fn admit(&self, s: &mut State, now: Duration) {
        let bt = self.config.block_tokens;
        while s.stalled_since.is_none() && s.running.len() < self.config.max_running {
            let Some(w) = s.waiting.pop_front() else {
                break;
            };
            s.finish_prefills(now);
            // As vLLM: the last prompt token is always computed.
            let most = (w.tokens.saturating_sub(1) / bt).min(w.blocks.len());
            let hit = s.cache.leading_hits(&w.blocks[..most]);
            for h in &w.blocks[..hit] {
                s.cache.acquire(*h);
            }
            let cached_tokens = hit * bt;
            let uncached = u32::try_from(w.tokens - cached_tokens).unwrap_or(u32::MAX);
            let prefill_end =
                s.prefill_free_at.max(now) + w.fixed + self.config.prefill_per_token * uncached;
            s.prefill_free_at = prefill_end;
            s.queries += w.tokens as u64;
            self.stats
                .prompt_tokens
                .fetch_add(w.tokens as u64, Ordering::Relaxed);
            s.hits += cached_tokens as u64;
            let epoch = s.cache.epoch();
            s.running.insert(
                w.id,
                Running {
                    blocks: w.blocks,
                    pinned: hit,
                    epoch,
                    prefill_end,
                },
            );
            s.prefilling.push_back(w.id);
            let _ = w.admitted.send(Admitted {
                prefill_end,
                cached_tokens,
            });
        }
    }

    /// Takes a finished or abandoned request out: a waiting one leaves the queue, a running one
    /// frees its slot and unpins its blocks (last block first, so that a prompt's tail is
    /// evicted before its head, as vLLM frees them).
    fn release(&self, id: u64) {
        {
            let mut s = self.state.lock();
            let now = s.engine_time(self.start, Instant::now());
            s.finish_prefills(now);
            if let Some(i) = s.waiting.iter().position(|w| w.id == id) {
                s.waiting.remove(i);
            } else if let Some(run) = s.running.remove(&id) {
                // A prefill cut short caches nothing (its slot in the prefill order stays spent).
                if let Some(i) = s.prefilling.iter().position(|p| *p == id) {
                    s.prefilling.remove(i);
                }
                if run.epoch == s.cache.epoch() {
                    for h in run.blocks[..run.pinned].iter().rev() {
                        s.cache.release(*h);
                    }
                }
                self.admit(&mut s, now);
            }
        }
        self.changed();
    }

    /// Stops all progress: no admission, no prefill, no token until [`Model::resume`].
    pub(crate) fn stall(&self) {
        {
            let mut s = self.state.lock();
            if s.stalled_since.is_none() {
                s.stalled_since = Some(Instant::now());
            }
        }
        self.changed();
    }

    pub(crate) fn resume(&self) {
        {
            let mut s = self.state.lock();
            let Some(since) = s.stalled_since.take() else {
                return;
            };
            s.stalled += since.elapsed();
            let now = s.engine_time(self.start, Instant::now());
            self.admit(&mut s, now);
        }
        self.resumed.send_modify(|n| *n += 1);
        self.changed();
    }

    /// Forgets every cached block (an engine restart).
    pub(crate) fn clear_cache(&self) {
        self.state.lock().cache.clear();
        self.changed();
    }

    pub(crate) fn snapshot(&self) -> (ModelStats, TtftHistogram) {
        let mut s = self.state.lock();
        let now = s.engine_time(self.start, Instant::now());
        s.finish_prefills(now);
        let stats = ModelStats {
            running: s.running.len(),
            waiting: s.waiting.len(),
            kv_blocks: self.config.kv_blocks,
            cached_blocks: s.cache.len(),
            used_blocks: s.cache.pinned(),
            prefix_cache_queries: s.queries,
            prefix_cache_hits: s.hits,
            prompt_tokens: self.stats.prompt_tokens.load(Ordering::Relaxed),
            generation_tokens: self.stats.generation_tokens.load(Ordering::Relaxed),
            ttft_count: s.ttft.count,
            ttft_sum: s.ttft.sum,
            stalled: s.stalled_since.is_some(),
        };
        (stats, s.ttft.clone())
    }

    fn changed(&self) {
        self.stats.changes.send_modify(|n| *n += 1);
    }

    /// Waits until engine time `t`, however long the engine stalls meanwhile.
    async fn until(&self, t: Duration) {
        loop {
            let mut resumed = self.resumed.subscribe();
            let due = {
                let s = self.state.lock();
                s.stalled_since
                    .is_none()
                    .then(|| self.start + s.stalled + t)
            };
            match due {
                // The sender lives in `self`: `changed` cannot fail here.
                None => {
                    let _ = resumed.changed().await;
                }
                Some(due) if due <= Instant::now() => return,
                Some(due) => tokio::time::sleep_until(due).await,
            }
        }
    }

    /// The decode time a running count adds to an inter-token delay.
    fn batch_delay(&self) -> Duration {
        if self.config.itl_per_running.is_zero() {
            return Duration::ZERO;
        }
        let running = u32::try_from(self.state.lock().running.len()).unwrap_or(u32::MAX);
        self.config.itl_per_running * running
    }

    /// Records the first token of a request that arrived at `arrival`, due at engine time `due`.
    fn first_token(&self, arrival: Instant, due: Duration) {
        {
            let mut s = self.state.lock();
            let ttft = (self.start + s.stalled + due).saturating_duration_since(arrival);
            s.ttft.observe(ttft);
        }
        self.changed();
    }
}

/// A request's timing parameters, drawn when it arrives.
#[derive(Clone, Debug)]
pub(crate) struct Timing {
    /// The fixed part of its prefill (the jittered time to first token).
    pub(crate) fixed: Duration,
    /// An injected stall before the first token.
    pub(crate) stall_before: Duration,
    /// An injected stall after the first token.
    pub(crate) stall_after: Duration,
    pub(crate) itl: Duration,
    pub(crate) itl_jitter: Jitter,
    pub(crate) rng: SplitMix64,
}

/// One request in the model, from its arrival to its end; dropping it takes it out.
#[derive(Debug)]
pub(crate) struct Ticket {
    model: Arc<Model>,
    id: u64,
    /// Until the admission is read.
    admission: Option<oneshot::Receiver<Admitted>>,
    arrival: Instant,
    /// When the last token was due (engine time).
    next: Duration,
    cached_tokens: usize,
    timing: Timing,
}

impl Ticket {
    /// Prompt tokens found in the cache (known once the first token is out).
    pub(crate) fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    /// Waits until token `i` is due (tokens are awaited in order, from 0).
    pub(crate) async fn token(&mut self, i: usize) {
        let model = self.model.clone();
        if let Some(admission) = self.admission.take() {
            // The sender is dropped unsent only if the request left the queue, which only
            // dropping this ticket does.
            let admitted = admission.await.unwrap_or(Admitted {
                prefill_end: Duration::ZERO,
                cached_tokens: 0,
            });
            self.cached_tokens = admitted.cached_tokens;
            self.next = admitted.prefill_end + self.timing.stall_before;
            model.until(self.next).await;
            model.first_token(self.arrival, self.next);
        } else {
            if i == 1 {
                self.next += self.timing.stall_after;
            }
            let t = &mut self.timing;
            self.next += t.itl_jitter.apply(t.itl, &mut t.rng) + model.batch_delay();
            model.until(self.next).await;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.model.release(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(itl: Duration) -> Timing {
        Timing {
            fixed: Duration::ZERO,
            stall_before: Duration::ZERO,
            stall_after: Duration::ZERO,
            itl,
            itl_jitter: Jitter::None,
            rng: SplitMix64(0),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn schedules_follow_the_queue_the_cache_and_stalls() {
        let ms = Duration::from_millis;
        let model = Arc::new(Model::new(
            PerfModel {
                kv_blocks: 8,
                max_running: 1,
                prefill_per_token: ms(1),
                itl_per_running: ms(2),
                ..PerfModel::default()
            },
            Arc::new(MockStats::new(0)),
        ));
        let t0 = Instant::now();
        let mut a = model.enqueue(vec![1, 2], 40, timing(ms(10)));
        let mut b = model.enqueue(vec![1, 2, 3], 50, timing(ms(10)));
        a.token(0).await;
        assert_eq!(t0.elapsed(), ms(40));
        // A 1 s stall in the middle of a decode step (10 ms + 2 ms for the one running) delays
        // the token by 1 s.
        tokio::time::sleep(ms(5)).await;
        model.stall();
        tokio::time::sleep(ms(1000)).await;
        assert_eq!(model.snapshot().0.waiting, 1);
        model.resume();
        a.token(1).await;
        assert_eq!(t0.elapsed(), ms(40 + 12 + 1000));
        // b is admitted when a ends, and finds a's two blocks cached: 18 tokens to prefill.
        drop(a);
        b.token(0).await;
        assert_eq!(b.cached_tokens(), 32);
        assert_eq!(t0.elapsed(), ms(1052 + 18));
        let (stats, ttft) = model.snapshot();
        assert_eq!(
            (stats.prefix_cache_queries, stats.prefix_cache_hits),
            (90, 32)
        );
        // b's time to first token: the wait for a (and a's stall), then its prefill.
        assert_eq!(ttft.sum, ms(40) + ms(1070));
    }
}
