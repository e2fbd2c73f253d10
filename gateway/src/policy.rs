//! The routing policy: which instance of a model takes a request, by what the engines hold and
//! how loaded they are.
//!
//! **`cache_aware`** (the default), for a prompt of at least one block ([`crate::prompt`]):
//!
//! 1. **Load bound.** An instance is a candidate while its load, requests in flight, stays
//!    below `load_factor` × the mean over the model's instances, + 1 (bounded-load consistent
//!    hashing: no instance is sent more than its share). Its load is what this gateway has in
//!    flight there, or what its engine reports running and waiting (a fresh reading,
//!    [`control_client::engine_load`]), whichever is more: the engine also sees other
//!    gateways' requests.
//! 2. **Cost.** For each candidate, the prefill work the request would wait for there, in
//!    estimated tokens: the work queued ahead of it (this gateway's requests that have no byte
//!    of their answer yet, or the engine's waiting requests, whichever is more) plus the part
//!    of this prompt the instance does not hold (its prefix index says how many leading blocks
//!    it was sent before, [`crate::prefix_index`]).
//! 3. **Choice.** Among the candidates within a tolerance of the cheapest (an eighth of the
//!    prompt, at least a block), the one holding the longest prefix; ties go to the
//!    instance ranked first for the request's affinity key by rendezvous hashing (the client's
//!    session hint, `x-session-id` or the OpenAI `user` field, else the prompt's first block).
//!    Every gateway ranks the same way over the same snapshot, so a prefix seen for the first
//!    time goes to the same instance whichever gateway routes it; the index only refines that.
//!
//! So a request stays with the instance that caches its prefix ("sticky") until that
//! instance's queued prefill outweighs what the cache saves, or its load reaches the bound;
//! then it goes where it waits least. A stalled engine's queue grows (its waiting count, and
//! the requests this gateway sent there that never answer) and it stops taking new work.
//!
//! Prompts shorter than a block, and models set to **`least_loaded`**, are routed by power of
//! two choices on requests in flight ([`crate::balance`]), as are retries' second attempts
//! when the policy finds no candidate.
//!
//! The index is each gateway's own; what it costs to miss is a cold prefill, never a failure.

use std::sync::Arc;

use control_client::engine_load::EngineLoads;
use control_client::model::RoutePolicy;
use control_client::routing::Endpoint;
use tokio::time::Instant;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::balance::{Balancer, InstanceState, Pick};
use crate::prompt::{BLOCK_TOKENS, PromptShape};

/// Settings of the policy.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyConfig {
    /// For models that set none.
    pub default: RoutePolicy,
    /// An instance stays a candidate while its load is below this × the mean load, + 1.
    pub load_factor: f64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            default: RoutePolicy::CacheAware,
            load_factor: 1.5,
        }
    }
}

/// Why the policy chose an instance (`faden_route_decisions_total{reason}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The chosen instance held the longest prefix of the prompt.
    CacheHit,
    /// No instance held any of it: the affinity ranking chose.
    Affinity,
    /// An instance holding more of it was too loaded.
    Load,
    /// Power of two choices: the prompt is shorter than a block, or the model asks for it.
    LeastLoaded,
}

impl Reason {
    pub const ALL: [Reason; 4] = [
        Reason::CacheHit,
        Reason::Affinity,
        Reason::Load,
        Reason::LeastLoaded,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Reason::CacheHit => "cache_hit",
            Reason::Affinity => "affinity",
            Reason::Load => "load",
            Reason::LeastLoaded => "least_loaded",
        }
    }
}

/// What the policy knows of a request.
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteRequest<'a> {
    pub prompt: Option<&'a PromptShape>,
    /// The client's session hint, hashed.
    pub session: Option<u64>,
}

/// A choice: the instance, why, and the request's estimated prompt and uncached tokens there.
#[derive(Debug)]
pub struct Decision<'a> {
    pub pick: Pick<'a>,
    pub reason: Reason,
    pub prompt_tokens: u64,
    pub uncached_tokens: u64,
}

impl Decision<'_> {
    /// Marks the request outstanding on the chosen instance, with its token estimates.
    pub fn start(&self) -> crate::balance::InflightGuard {
        self.pick
            .start_with(self.prompt_tokens, self.uncached_tokens)
    }
}

struct Candidate<'a> {
    endpoint: &'a Endpoint,
    state: Arc<InstanceState>,
    load: f64,
    held: usize,
    cost: u64,
    rank: u64,
}

/// Chooses an instance of `endpoints` for `request`, leaving out the ids in `exclude` (already
/// tried), and records the prompt's blocks in the chosen instance's index.
pub fn choose<'a>(
    balancer: &Balancer,
    endpoints: &'a [Endpoint],
    exclude: &[i64],
    policy: RoutePolicy,
    config: &PolicyConfig,
    request: RouteRequest<'_>,
    loads: Option<&EngineLoads>,
) -> Option<Decision<'a>> {
    let prompt_tokens = request.prompt.map_or(0, |p| p.tokens);
    let blocks = match request.prompt {
        Some(p) if policy == RoutePolicy::CacheAware && !p.blocks.is_empty() => &p.blocks[..],
        _ => {
            let pick = balancer.pick(endpoints, exclude)?;
            return Some(Decision {
                pick,
                reason: Reason::LeastLoaded,
                prompt_tokens,
                uncached_tokens: prompt_tokens,
            });
        }
    };
    let key = request.session.unwrap_or(blocks[0]);
    let now = Instant::now();
    let now_ms = balancer.now_ms();
    let mut candidates: Vec<Candidate<'a>> = Vec::with_capacity(endpoints.len());
    let mut ejected: Vec<Candidate<'a>> = Vec::new();
    for endpoint in endpoints {
        if exclude.contains(&endpoint.instance_id) {
            continue;
        }
        let state = balancer.state(endpoint.instance_id);
        let reading = loads.and_then(|l| l.get(endpoint.instance_id, now));
        let mut queued = state.prefill_tokens();
        let mut load = f64::from(state.outstanding());
        let held = {
            let mut index = state.index().lock();
            if let Some(r) = reading {
                let capacity = r
                    .load
                    .cache_tokens()
                    .map(|t| usize::try_from(t / BLOCK_TOKENS as u64).unwrap_or(usize::MAX));
                index.follow(r.load.epoch, capacity);
            }
            index.matched(blocks)
        };
        if let Some(r) = reading {
            load = load.max(f64::from(r.load.running) + f64::from(r.load.waiting));
            queued = queued.max(u64::from(r.load.waiting).saturating_mul(prompt_tokens));
        }
        let uncached = prompt_tokens.saturating_sub((held * BLOCK_TOKENS) as u64);
        let candidate = Candidate {
            endpoint,
            load,
            held,
            cost: queued.saturating_add(uncached),
            rank: xxh3_64_with_seed(&endpoint.instance_id.to_le_bytes(), key),
            state,
        };
        if candidate.state.is_ejected_at(now_ms) {
            ejected.push(candidate);
        } else {
            candidates.push(candidate);
        }
    }
    // Every instance ejected: all of them rather than none (as `Balancer::pick`).
    if candidates.is_empty() {
        candidates = ejected;
    }
    if candidates.is_empty() {
        return None;
    }
    let mean = candidates.iter().map(|c| c.load).sum::<f64>() / candidates.len() as f64;
    let bound = config.load_factor * mean + 1.0;
    // The least loaded instance is always below the bound (its load is at most the mean).
    let best_held = candidates.iter().map(|c| c.held).max().unwrap_or(0);
    candidates.retain(|c| c.load < bound);
    let cheapest = candidates.iter().map(|c| c.cost).min()?;
    let tolerance = (prompt_tokens / 8).max(BLOCK_TOKENS as u64);
    let chosen = candidates
        .into_iter()
        .filter(|c| c.cost <= cheapest.saturating_add(tolerance))
        .max_by_key(|c| (c.held, c.rank))?;
    let reason = if chosen.held > 0 && chosen.held == best_held {
        Reason::CacheHit
    } else if best_held > 0 {
        Reason::Load
    } else {
        Reason::Affinity
    };
    chosen.state.index().lock().insert(blocks);
    let uncached_tokens = prompt_tokens.saturating_sub((chosen.held * BLOCK_TOKENS) as u64);
    Some(Decision {
        pick: Pick {
            endpoint: chosen.endpoint,
            state: chosen.state,
        },
        reason,
        prompt_tokens,
        uncached_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use control_client::engine_load::{EngineLoad, Reading};
    use control_client::model::ProxyMode;

    fn ep(id: i64) -> Endpoint {
        Endpoint {
            instance_id: id,
            model_id: 1,
            worker_id: id,
            worker_name: "w".into(),
            cluster_id: 1,
            address: "127.0.0.1".into(),
            instance_port: 1,
            worker_port: 2,
            proxy_mode: ProxyMode::Direct,
            proxy_address: None,
        }
    }

    fn prompt(tenant: u8, len: usize) -> PromptShape {
        let mut text = vec![tenant; 4096];
        text.extend(std::iter::repeat_n(b'.', len));
        PromptShape::of(&text)
    }

    fn choose_for<'a>(
        b: &Balancer,
        eps: &'a [Endpoint],
        p: &PromptShape,
        loads: Option<&EngineLoads>,
    ) -> Decision<'a> {
        let request = RouteRequest {
            prompt: Some(p),
            session: None,
        };
        choose(
            b,
            eps,
            &[],
            RoutePolicy::CacheAware,
            &PolicyConfig::default(),
            request,
            loads,
        )
        .unwrap()
    }

    #[test]
    fn a_prefix_goes_back_where_it_was_sent() {
        let b = Balancer::new(Default::default());
        let eps: Vec<Endpoint> = (1..=4).map(ep).collect();
        let first = choose_for(&b, &eps, &prompt(1, 100), None);
        assert_eq!(first.reason, Reason::Affinity);
        let home = first.pick.endpoint.instance_id;
        for i in 0..20 {
            let d = choose_for(&b, &eps, &prompt(1, 100 + i * 300), None);
            assert_eq!(d.pick.endpoint.instance_id, home);
            assert_eq!(d.reason, Reason::CacheHit);
            assert!(d.uncached_tokens < d.prompt_tokens);
        }
        // Another balancer (another gateway) that never saw it chooses the same instance.
        let other = Balancer::new(Default::default());
        assert_eq!(
            choose_for(&other, &eps, &prompt(1, 100), None)
                .pick
                .endpoint
                .instance_id,
            home
        );
    }

    #[test]
    fn tenants_spread_over_instances() {
        let b = Balancer::new(Default::default());
        let eps: Vec<Endpoint> = (1..=4).map(ep).collect();
        let homes: std::collections::HashSet<i64> = (0..32)
            .map(|t| {
                choose_for(&b, &eps, &prompt(t, 10), None)
                    .pick
                    .endpoint
                    .instance_id
            })
            .collect();
        assert_eq!(homes.len(), 4);
    }

    #[test]
    fn a_loaded_home_sends_the_prefix_elsewhere() {
        let b = Balancer::new(Default::default());
        let eps: Vec<Endpoint> = (1..=2).map(ep).collect();
        let p = prompt(1, 100);
        let first = choose_for(&b, &eps, &p, None);
        let home = first.pick.endpoint.instance_id;
        // Requests held in flight at home: its load passes 1.5 × the mean + 1.
        let mut held = vec![first.start()];
        let mut moved = None;
        for _ in 0..10 {
            let d = choose_for(&b, &eps, &p, None);
            if d.pick.endpoint.instance_id != home {
                moved = Some(d.reason);
                break;
            }
            held.push(d.start());
        }
        assert_eq!(moved, Some(Reason::Load));
        // 1.5 × the mean + 1 with two instances: at 4 in flight home is past the bound.
        assert_eq!(held.len(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn an_engine_with_a_queue_stops_taking_work() {
        let b = Balancer::new(Default::default());
        let eps: Vec<Endpoint> = (1..=2).map(ep).collect();
        let p = prompt(1, 100);
        let home = choose_for(&b, &eps, &p, None).pick.endpoint.instance_id;
        let loads = EngineLoads::default();
        let now = Instant::now();
        let stalled = EngineLoad {
            waiting: 4,
            running: 1,
            ..EngineLoad::default()
        };
        loads.update(
            [(
                home,
                Reading {
                    load: stalled,
                    taken: now,
                },
            )],
            now,
        );
        let d = choose_for(&b, &eps, &p, Some(&loads));
        assert_ne!(d.pick.endpoint.instance_id, home);
        // A stale reading is ignored: home again.
        tokio::time::advance(control_client::engine_load::MAX_AGE * 2).await;
        let d = choose_for(&b, &eps, &p, Some(&loads));
        assert_eq!(d.pick.endpoint.instance_id, home);
    }

    #[tokio::test(start_paused = true)]
    async fn a_restarted_engine_is_forgotten() {
        let b = Balancer::new(Default::default());
        let eps: Vec<Endpoint> = (1..=1).map(ep).collect();
        let p = prompt(1, 100);
        choose_for(&b, &eps, &p, None);
        assert_eq!(choose_for(&b, &eps, &p, None).reason, Reason::CacheHit);
        let loads = EngineLoads::default();
        let now = Instant::now();
        let restarted = EngineLoad {
            epoch: 1,
            ..EngineLoad::default()
        };
        loads.update(
            [(
                1,
                Reading {
                    load: restarted,
                    taken: now,
                },
            )],
            now,
        );
        assert_eq!(
            choose_for(&b, &eps, &p, Some(&loads)).reason,
            Reason::Affinity
        );
    }

    #[test]
    fn short_prompts_and_least_loaded_models_use_p2c() {
        let b = Balancer::new(Default::default());
        let eps: Vec<Endpoint> = (1..=2).map(ep).collect();
        let short = PromptShape::of(b"hello");
        assert_eq!(
            choose_for(&b, &eps, &short, None).reason,
            Reason::LeastLoaded
        );
        let long = prompt(1, 10);
        let d = choose(
            &b,
            &eps,
            &[],
            RoutePolicy::LeastLoaded,
            &PolicyConfig::default(),
            RouteRequest {
                prompt: Some(&long),
                session: None,
            },
            None,
        )
        .unwrap();
        assert_eq!(d.reason, Reason::LeastLoaded);
    }
}
