//! Instance selection: power of two choices on outstanding requests, with passive outlier
//! ejection.
//!
//! Per-instance state lives in a map keyed by instance id, outside the routing snapshot: a new
//! snapshot that adds or removes an instance leaves the others' counters untouched (GPUStack's
//! round-robin cursor reset on every change and skewed traffic 27:10, #5709). P2C needs no
//! cursor at all: two random candidates, the less loaded one wins.
//!
//! Ejection: `consecutive_failures` connect failures or 5xx answers in a row eject an instance
//! for `base_ejection`, doubling for each ejection in a row up to `max_ejection`. When the period
//! ends the instance takes live traffic again; one more failure ejects it again at once (its
//! failure count is only reset by a success). When every candidate is ejected, all are used
//! (failing open beats refusing every request).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use control_client::routing::{Endpoint, RoutingSnapshot};
use dashmap::DashMap;
use rand::Rng;
use tokio::time::Instant;

use crate::config::EjectionConfig;
use crate::prefix_index::PrefixIndex;
use net::hash::FastBuild;

/// Load and health of one instance.
#[derive(Debug, Default)]
pub struct InstanceState {
    /// The instance (for logs).
    instance_id: i64,
    outstanding: AtomicU32,
    /// Failures, ejection, queued prefill and the prefix index, shared by every core's
    /// balancer.
    health: Arc<Health>,
    /// How the instance was last reached (see [`crate::upstream::route_cached`]).
    pub(crate) reach: crate::upstream::ReachCache,
}

impl InstanceState {
    /// Requests sent to this instance and not finished.
    pub fn outstanding(&self) -> u32 {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Prefill work queued here by this gateway, in estimated tokens.
    pub fn prefill_tokens(&self) -> u64 {
        self.health.prefill_tokens.load(Ordering::Relaxed)
    }

    /// Estimated prompt tokens of this gateway's requests in flight here.
    pub fn prompt_tokens(&self) -> u64 {
        self.health.prompt_tokens.load(Ordering::Relaxed)
    }

    /// What this gateway routed here, as an approximation of the engine's prefix cache.
    pub(crate) fn index(&self) -> &parking_lot::Mutex<PrefixIndex> {
        &self.health.index
    }

    /// Whether the instance is ejected at `now_ms` ([`Balancer::now_ms`]).
    pub(crate) fn is_ejected_at(&self, now_ms: u64) -> bool {
        self.health.ejected_until_ms.load(Ordering::Relaxed) > now_ms
    }
}

/// What every core of the gateway knows of an instance together: its failures and ejection (a
/// success writes them only when it changes something, so the request path of a healthy
/// instance only reads them), and, written only by requests whose prompt has at least one
/// block, the prefill queued there and the prefix index (so that a prefix goes to the same
/// instance from every core).
#[derive(Debug, Default)]
struct Health {
    /// Estimated prompt tokens not yet in the engine's cache, of requests sent here that have
    /// had no byte of their answer yet: the prefill work queued ahead of a new request.
    prefill_tokens: AtomicU64,
    /// Estimated prompt tokens of the requests in flight here.
    prompt_tokens: AtomicU64,
    index: parking_lot::Mutex<PrefixIndex>,
    consecutive_failures: AtomicU32,
    /// Ejections in a row (sets the backoff).
    ejections: AtomicU32,
    /// Milliseconds since the table's epoch until which the instance is ejected.
    ejected_until_ms: AtomicU64,
}

/// Every instance's health, shared by the balancers of a gateway's cores.
#[derive(Debug)]
pub struct HealthTable {
    instances: DashMap<i64, Arc<Health>, FastBuild>,
    epoch: Instant,
}

impl Default for HealthTable {
    fn default() -> Self {
        Self {
            instances: DashMap::default(),
            epoch: Instant::now(),
        }
    }
}

impl HealthTable {
    fn get(&self, instance_id: i64) -> Arc<Health> {
        self.instances.entry(instance_id).or_default().clone()
    }
}

/// How an attempt on an instance went, for ejection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure,
}

/// The balancer of one core's requests (each core has its own: its counts are written by that
/// core alone), with the gateway's [`HealthTable`].
#[derive(Debug)]
pub struct Balancer {
    states: DashMap<i64, Arc<InstanceState>, FastBuild>,
    config: EjectionConfig,
    health: Arc<HealthTable>,
}

/// Counts a request as outstanding on its instance until dropped (at the end of the response
/// body, so long streams count for their whole life), with its prompt tokens, and its uncached
/// prompt tokens as queued prefill until its answer's first byte.
#[derive(Debug)]
pub struct InflightGuard {
    state: Arc<InstanceState>,
    prompt_tokens: u64,
    /// Still counted as queued prefill.
    prefill_tokens: u64,
}

impl InflightGuard {
    /// The answer's first byte came: the engine has done the request's prefill.
    pub fn first_byte(&mut self) {
        if self.prefill_tokens > 0 {
            self.state
                .health
                .prefill_tokens
                .fetch_sub(self.prefill_tokens, Ordering::Relaxed);
            self.prefill_tokens = 0;
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.first_byte();
        if self.prompt_tokens > 0 {
            self.state
                .health
                .prompt_tokens
                .fetch_sub(self.prompt_tokens, Ordering::Relaxed);
        }
        self.state.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A picked instance.
#[derive(Debug)]
pub struct Pick<'a> {
    pub endpoint: &'a Endpoint,
    pub state: Arc<InstanceState>,
}

impl Pick<'_> {
    /// Marks the request outstanding on this instance.
    pub fn start(&self) -> InflightGuard {
        self.start_with(0, 0)
    }

    /// Marks the request outstanding on this instance, with its estimated prompt tokens and
    /// how many of them the engine has to prefill.
    pub fn start_with(&self, prompt_tokens: u64, prefill_tokens: u64) -> InflightGuard {
        self.state.outstanding.fetch_add(1, Ordering::Relaxed);
        if prompt_tokens > 0 {
            self.state
                .health
                .prompt_tokens
                .fetch_add(prompt_tokens, Ordering::Relaxed);
        }
        if prefill_tokens > 0 {
            self.state
                .health
                .prefill_tokens
                .fetch_add(prefill_tokens, Ordering::Relaxed);
        }
        InflightGuard {
            state: self.state.clone(),
            prompt_tokens,
            prefill_tokens,
        }
    }
}

impl Balancer {
    pub fn new(config: EjectionConfig) -> Self {
        Self::with_health(config, Arc::default())
    }

    /// A balancer sharing `health` with the other cores' balancers.
    pub fn with_health(config: EjectionConfig, health: Arc<HealthTable>) -> Self {
        Self {
            states: DashMap::default(),
            config,
            health,
        }
    }

    pub(crate) fn now_ms(&self) -> u64 {
        u64::try_from(self.health.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub(crate) fn state(&self, instance_id: i64) -> Arc<InstanceState> {
        if let Some(s) = self.states.get(&instance_id) {
            return s.clone();
        }
        self.states
            .entry(instance_id)
            .or_insert_with(|| {
                Arc::new(InstanceState {
                    instance_id,
                    health: self.health.get(instance_id),
                    ..InstanceState::default()
                })
            })
            .clone()
    }

    /// Whether an instance is ejected now.
    pub fn is_ejected(&self, instance_id: i64) -> bool {
        self.states
            .get(&instance_id)
            .is_some_and(|s| s.is_ejected_at(self.now_ms()))
    }

    /// Outstanding requests of an instance.
    pub fn outstanding(&self, instance_id: i64) -> u32 {
        self.states.get(&instance_id).map_or(0, |s| s.outstanding())
    }

    /// Picks an instance among `endpoints`, skipping the ids in `exclude` (already tried).
    ///
    /// Candidates are those neither excluded nor ejected (all non-excluded ones when every
    /// candidate is ejected); of two distinct candidates drawn uniformly at random, the one with
    /// fewer outstanding requests wins (ties: the first drawn).
    pub fn pick<'a>(&self, endpoints: &'a [Endpoint], exclude: &[i64]) -> Option<Pick<'a>> {
        // The clock is read only when some candidate was ever ejected (`ejected_until_ms` 0:
        // never).
        let now = std::cell::OnceCell::new();
        let now = || *now.get_or_init(|| self.now_ms());
        let mut rng = rand::rng();
        // Fast path, the usual case: draw two distinct instances first and only look at those.
        // When both are candidates this is the same draw as over the candidate list (every
        // instance is one), in O(1) instead of a map lookup per instance.
        let usable = |ep: &Endpoint| -> Option<Arc<InstanceState>> {
            if exclude.contains(&ep.instance_id) {
                return None;
            }
            let state = self.state(ep.instance_id);
            let until = state.health.ejected_until_ms.load(Ordering::Relaxed);
            (until == 0 || until <= now()).then_some(state)
        };
        if let [endpoint] = endpoints {
            if let Some(state) = usable(endpoint) {
                return Some(Pick { endpoint, state });
            }
        } else if endpoints.len() >= 2 {
            let n = endpoints.len();
            let a = rng.random_range(0..n);
            let mut b = rng.random_range(0..n - 1);
            if b >= a {
                b += 1;
            }
            if let Some(sa) = usable(&endpoints[a])
                && let Some(sb) = usable(&endpoints[b])
            {
                return Some(if sb.outstanding() < sa.outstanding() {
                    Pick {
                        endpoint: &endpoints[b],
                        state: sb,
                    }
                } else {
                    Pick {
                        endpoint: &endpoints[a],
                        state: sa,
                    }
                });
            }
        }
        self.pick_slow(endpoints, exclude, now(), &mut rng)
    }

    /// [`Balancer::pick`] over the full candidate list (some instance excluded or ejected).
    fn pick_slow<'a>(
        &self,
        endpoints: &'a [Endpoint],
        exclude: &[i64],
        now: u64,
        rng: &mut impl Rng,
    ) -> Option<Pick<'a>> {
        let mut eligible: Vec<(&'a Endpoint, Arc<InstanceState>)> =
            Vec::with_capacity(endpoints.len());
        let mut ejected: Vec<(&'a Endpoint, Arc<InstanceState>)> = Vec::new();
        for ep in endpoints {
            if exclude.contains(&ep.instance_id) {
                continue;
            }
            let state = self.state(ep.instance_id);
            if state.is_ejected_at(now) {
                ejected.push((ep, state));
            } else {
                eligible.push((ep, state));
            }
        }
        let pool = if eligible.is_empty() {
            ejected
        } else {
            eligible
        };
        let (endpoint, state) = match pool.len() {
            0 => return None,
            1 => pool.into_iter().next()?,
            n => {
                let a = rng.random_range(0..n);
                let mut b = rng.random_range(0..n - 1);
                if b >= a {
                    b += 1;
                }
                let pick = if pool[b].1.outstanding() < pool[a].1.outstanding() {
                    b
                } else {
                    a
                };
                pool.into_iter().nth(pick)?
            }
        };
        Some(Pick { endpoint, state })
    }

    /// Records how an attempt went.
    pub fn report(&self, state: &InstanceState, outcome: Outcome) {
        match outcome {
            Outcome::Success => {
                let health = &state.health;
                // Read first: a healthy instance's line is then only read by every core.
                if health.consecutive_failures.load(Ordering::Relaxed) != 0 {
                    health.consecutive_failures.store(0, Ordering::Relaxed);
                }
                if health.ejections.load(Ordering::Relaxed) != 0 {
                    health.ejections.store(0, Ordering::Relaxed);
                }
            }
            Outcome::Failure => {
                let health = &state.health;
                let failures = health.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
                let now = self.now_ms();
                if failures >= self.config.consecutive_failures.max(1)
                    && health.ejected_until_ms.load(Ordering::Relaxed) <= now
                {
                    let n = health.ejections.fetch_add(1, Ordering::Relaxed);
                    let backoff = backoff(&self.config, n);
                    let until =
                        now.saturating_add(u64::try_from(backoff.as_millis()).unwrap_or(u64::MAX));
                    health.ejected_until_ms.store(until, Ordering::Relaxed);
                    tracing::warn!(
                        instance_id = state.instance_id,
                        failures,
                        backoff_ms = backoff.as_millis() as u64,
                        "instance ejected"
                    );
                }
            }
        }
    }

    /// Forgets instances that left the snapshot and have nothing in flight, and lifts the
    /// ejection of instances now reached another way (a tunnel that moved to another server, a
    /// new address): failures of the old path say nothing of the new one.
    pub fn prune(&self, snapshot: &RoutingSnapshot) {
        let endpoints = || snapshot.models.values().flat_map(|r| r.endpoints.iter());
        for endpoint in endpoints() {
            if let Some(state) = self.states.get(&endpoint.instance_id)
                && state.reach.is_other_than(endpoint)
                && state.health.consecutive_failures.swap(0, Ordering::Relaxed) > 0
            {
                state.health.ejections.store(0, Ordering::Relaxed);
                state.health.ejected_until_ms.store(0, Ordering::Relaxed);
                tracing::info!(
                    instance_id = endpoint.instance_id,
                    "instance reached another way: its failures are forgotten"
                );
            }
        }
        let live: std::collections::HashSet<i64> = endpoints().map(|e| e.instance_id).collect();
        self.states
            .retain(|id, state| live.contains(id) || state.outstanding() > 0);
        // An instance no core holds state for any more has no health to keep either.
        self.health
            .instances
            .retain(|id, health| live.contains(id) || Arc::strong_count(health) > 1);
    }

    /// Instances with state (for tests and metrics).
    pub fn tracked(&self) -> usize {
        self.states.len()
    }

    /// Each tracked instance's load as this gateway counts it, and the size of its prefix
    /// index.
    pub fn render(&self, out: &mut String) {
        Self::render_all([self], out);
    }

    /// [`Balancer::render`] summed over several cores' balancers (each core balances its own
    /// requests: [`net::cores`]); what the cores share (tokens, the index) is taken once.
    pub fn render_all<'a>(all: impl IntoIterator<Item = &'a Balancer>, out: &mut String) {
        use std::fmt::Write as _;
        let mut sums: std::collections::BTreeMap<i64, [u64; 4]> = Default::default();
        for balancer in all {
            for e in balancer.states.iter() {
                let s = e.value();
                let row = sums.entry(*e.key()).or_default();
                row[0] += u64::from(s.outstanding());
                // Shared by the cores: the same in each.
                row[1] = row[1].max(s.prompt_tokens());
                row[2] = row[2].max(s.prefill_tokens());
                row[3] = row[3].max(s.index().lock().len() as u64);
            }
        }
        let rows: Vec<(i64, [u64; 4])> = sums.into_iter().collect();
        let gauges = [
            (
                "faden_gateway_instance_requests_in_flight",
                "Requests sent to an instance and not finished, by instance id.",
            ),
            (
                "faden_gateway_instance_prompt_tokens_in_flight",
                "Estimated prompt tokens of the requests in flight on an instance.",
            ),
            (
                "faden_gateway_instance_prefill_tokens",
                "Estimated uncached prompt tokens of requests sent to an instance that have no byte of their answer yet.",
            ),
            (
                "faden_gateway_prefix_index_blocks",
                "Prompt blocks in an instance's prefix index (what this gateway routed there).",
            ),
        ];
        for (i, (name, help)) in gauges.iter().enumerate() {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            for (id, values) in &rows {
                let _ = writeln!(out, "{name}{{instance=\"{id}\"}} {}", values[i]);
            }
        }
    }
}

fn backoff(config: &EjectionConfig, ejections_before: u32) -> Duration {
    let factor = 1u32
        .checked_shl(ejections_before.min(16))
        .unwrap_or(u32::MAX);
    config
        .base_ejection
        .saturating_mul(factor)
        .min(config.max_ejection)
}

#[cfg(test)]
mod tests {
    use super::*;
    use control_client::model::ProxyMode;

    fn ep(id: i64) -> Endpoint {
        Endpoint {
            instance_id: id,
            model_id: 1,
            worker_id: 1,
            worker_name: "w".into(),
            cluster_id: 1,
            address: "127.0.0.1".into(),
            instance_port: 1,
            worker_port: 2,
            proxy_mode: ProxyMode::Direct,
            proxy_address: None,
        }
    }

    #[test]
    fn p2c_prefers_less_loaded() {
        let b = Balancer::new(EjectionConfig::default());
        let eps = [ep(1), ep(2)];
        let busy = b.pick(&eps[..1], &[]).unwrap();
        let _guards: Vec<_> = (0..3).map(|_| busy.start()).collect();
        for _ in 0..50 {
            assert_eq!(b.pick(&eps, &[]).unwrap().endpoint.instance_id, 2);
        }
        assert_eq!(b.outstanding(1), 3);
    }

    #[test]
    fn spreads_evenly_when_idle() {
        let b = Balancer::new(EjectionConfig::default());
        let eps = [ep(1), ep(2), ep(3)];
        let mut counts = [0; 3];
        for _ in 0..3000 {
            let p = b.pick(&eps, &[]).unwrap();
            counts[(p.endpoint.instance_id - 1) as usize] += 1;
        }
        assert!(counts.iter().all(|c| *c > 700), "{counts:?}");
    }

    #[test]
    fn excludes_tried_and_returns_none_when_exhausted() {
        let b = Balancer::new(EjectionConfig::default());
        let eps = [ep(1), ep(2)];
        assert_eq!(b.pick(&eps, &[1]).unwrap().endpoint.instance_id, 2);
        assert!(b.pick(&eps, &[1, 2]).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn ejects_after_consecutive_failures_and_recovers() {
        let b = Balancer::new(EjectionConfig {
            consecutive_failures: 2,
            base_ejection: Duration::from_secs(1),
            max_ejection: Duration::from_secs(4),
        });
        let eps = [ep(1), ep(2)];
        let s1 = b.state(1);
        b.report(&s1, Outcome::Failure);
        assert!(!b.is_ejected(1));
        b.report(&s1, Outcome::Failure);
        assert!(b.is_ejected(1));
        for _ in 0..20 {
            assert_eq!(b.pick(&eps, &[]).unwrap().endpoint.instance_id, 2);
        }
        // All ejected: fail open.
        assert_eq!(b.pick(&eps[..1], &[]).unwrap().endpoint.instance_id, 1);
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert!(!b.is_ejected(1));
        // One more failure re-ejects at once, for twice as long.
        b.report(&s1, Outcome::Failure);
        assert!(b.is_ejected(1));
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert!(b.is_ejected(1));
        tokio::time::advance(Duration::from_millis(600)).await;
        assert!(!b.is_ejected(1));
        b.report(&s1, Outcome::Success);
        b.report(&s1, Outcome::Failure);
        assert!(!b.is_ejected(1));
    }

    #[test]
    fn state_survives_snapshot_changes() {
        let b = Balancer::new(EjectionConfig::default());
        let eps = [ep(1), ep(2)];
        let p = b.pick(&eps[..1], &[]).unwrap();
        let g = p.start();
        b.prune(&RoutingSnapshot::default());
        assert_eq!(b.outstanding(1), 1, "in-flight state kept");
        drop(g);
        b.prune(&RoutingSnapshot::default());
        assert_eq!(b.tracked(), 0);
    }

    /// A tunnel that moved to another server is a new path: the ejection earned on the old one
    /// is lifted at the snapshot that shows the move, and only then.
    #[test]
    fn a_new_path_lifts_the_ejection() {
        let b = Balancer::new(EjectionConfig {
            consecutive_failures: 1,
            base_ejection: Duration::from_secs(60),
            max_ejection: Duration::from_secs(60),
        });
        let mut old = ep(1);
        old.proxy_mode = ProxyMode::Tunnel;
        old.proxy_address = Some("http://10.0.0.2:30079".into());
        let state = b.state(1);
        crate::upstream::route_cached(&state.reach, &old, None, true).unwrap();
        b.report(&state, Outcome::Failure);
        assert!(b.is_ejected(1));
        let snapshot = |endpoint: &Endpoint| {
            let mut snapshot = RoutingSnapshot::default();
            let route = control_client::routing::ModelRoute {
                model_id: 1,
                name: "m".into(),
                policy: None,
                endpoints: vec![endpoint.clone()],
            };
            snapshot.models.insert("m".into(), Arc::new(route));
            snapshot
        };
        b.prune(&snapshot(&old));
        assert!(b.is_ejected(1), "same path: still ejected");
        let mut moved = old.clone();
        moved.proxy_address = Some("http://10.0.0.3:30079".into());
        b.prune(&snapshot(&moved));
        assert!(!b.is_ejected(1), "new path: a fresh start");
    }
}
