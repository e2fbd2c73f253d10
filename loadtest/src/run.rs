//! Driving the load: the closed and open loops, warmup, bounds, progress and `--compare`.

use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng as _};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::client::{Conn, ErrorClass, Outcome, Prepared, Target, execute};
use crate::config::{Arrivals, ClientRoute, LoadModel, RunConfig};
use crate::report::{CompareReport, Report};
use crate::scenario::{PrefixGenerator, Scenario, mix};
use crate::stats::Recorder;

/// Pause after a failed connect, so a closed loop against a dead target does not spin.
const CONNECT_BACKOFF: Duration = Duration::from_millis(10);

/// Runs the load described by `config` and measures it.
///
/// The run is bounded: it stops after `config.duration` (plus the warmup), or after
/// `config.requests` requests, whichever comes first, and never lasts longer than
/// [`crate::config::MAX_DURATION`]. Requests still in flight at the end are cancelled and
/// counted as `unfinished`.
/// `config`'s own rules ([`RunConfig::validate`]) and its target URL, before anything runs.
pub fn check(config: &RunConfig) -> anyhow::Result<()> {
    config.validate()?;
    Target::all(config)?;
    Ok(())
}

pub async fn run(config: RunConfig) -> anyhow::Result<Report> {
    check(&config)?;
    let ctx = Ctx::new(config)?;
    let (duration, limit) = ctx.config.limits();
    if !ctx.config.warmup.is_zero() {
        run_phase(&ctx, ctx.config.warmup, None, false, "warmup ").await?;
    }
    let done = run_phase(&ctx, duration, limit, true, "").await?;
    Ok(Report::new(
        &ctx.config,
        &done.recorder,
        done.elapsed.as_secs_f64(),
        done.unfinished,
    ))
}

/// Runs the same load against `a` and `b` in alternating slices of about `slice` (A B B A A B
/// B A …, so a steady drift of the machine weighs on both alike) and reports each target and
/// the ratio B/A of each figure.
///
/// `a.duration` is the length of the whole comparison (each target gets half); the warmup runs
/// once per target before the first slice. `requests` is not supported.
pub async fn compare(a: RunConfig, b: RunConfig, slice: Duration) -> anyhow::Result<CompareReport> {
    check(&a)?;
    check(&b)?;
    ensure!(
        a.requests.is_none() && b.requests.is_none(),
        "--compare runs for a --duration; drop --requests"
    );
    ensure!(!slice.is_zero(), "--slice must be greater than zero");
    let total = a.limits().0;
    let per_target = (total.as_secs_f64() / (2.0 * slice.as_secs_f64()))
        .round()
        .max(1.0);
    let slices = per_target as u32;
    let slice = total / (2 * slices);
    ensure!(
        slice >= Duration::from_millis(50),
        "--duration is too short for a comparison"
    );
    let ctx_a = Ctx::new(a)?;
    let ctx_b = Ctx::new(b)?;
    for ctx in [&ctx_a, &ctx_b] {
        if !ctx.config.warmup.is_zero() {
            run_phase(ctx, ctx.config.warmup, None, false, "warmup ").await?;
        }
    }
    let mut acc = [Acc::new()?, Acc::new()?];
    for k in 0..slices {
        let order = if k % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let (ctx, label) = if i == 0 {
                (&ctx_a, "A ")
            } else {
                (&ctx_b, "B ")
            };
            let done = run_phase(ctx, slice, None, true, label).await?;
            acc[i].add(&done);
        }
    }
    let [ra, rb] = acc;
    Ok(CompareReport::new(
        slices,
        slice.as_secs_f64(),
        ra.report(&ctx_a.config),
        rb.report(&ctx_b.config),
    ))
}

/// Slices of one target, summed.
struct Acc {
    recorder: Recorder,
    elapsed: Duration,
    unfinished: u64,
}

impl Acc {
    fn new() -> anyhow::Result<Self> {
        Ok(Self {
            recorder: Recorder::new()?,
            elapsed: Duration::ZERO,
            unfinished: 0,
        })
    }

    fn add(&mut self, phase: &PhaseResult) {
        self.recorder.merge(&phase.recorder);
        self.elapsed += phase.elapsed;
        self.unfinished += phase.unfinished;
    }

    fn report(&self, config: &RunConfig) -> Report {
        Report::new(
            config,
            &self.recorder,
            self.elapsed.as_secs_f64(),
            self.unfinished,
        )
    }
}

/// Salt of the affinity hash, so that tenant `t` does not simply go to URL `t mod n`.
const AFFINITY_SALT: u64 = 0xAFF1_2177;

/// What a run shares between its workers.
struct Ctx {
    config: RunConfig,
    /// One per URL.
    targets: Vec<Target>,
    source: Source,
    /// Requests routed round-robin so far.
    routed: AtomicU64,
    /// Open connections not in use (kept between phases), per target.
    idle: Vec<Mutex<Vec<Conn>>>,
}

/// Where the requests come from.
enum Source {
    /// Fixed requests drawn by weight.
    Mix {
        requests: Vec<Prepared>,
        /// Running sums of the weights.
        cumulative: Vec<u64>,
    },
    /// A generated sequence, drawn in order.
    Prefix(Mutex<PrefixGenerator>),
}

impl Ctx {
    fn new(config: RunConfig) -> anyhow::Result<Arc<Self>> {
        let targets = Target::all(&config)?;
        let source = match &config.scenario {
            Some(Scenario::Prefix(p)) => Source::Prefix(Mutex::new(PrefixGenerator::new(
                p,
                &config.model,
                config.seed,
            )?)),
            None => {
                let requests = config
                    .workloads
                    .iter()
                    .map(|w| Prepared::new(&config, w))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let cumulative = requests
                    .iter()
                    .scan(0u64, |sum, r| {
                        *sum += u64::from(r.weight);
                        Some(*sum)
                    })
                    .collect();
                Source::Mix {
                    requests,
                    cumulative,
                }
            }
        };
        Ok(Arc::new(Self {
            idle: targets.iter().map(|_| Mutex::new(Vec::new())).collect(),
            config,
            targets,
            source,
            routed: AtomicU64::new(0),
        }))
    }

    /// The next request and the index of its target. `None` if the generator failed (it
    /// cannot, short of a bug: the run then ends early).
    fn next(&self, rng: &mut SmallRng) -> Option<(usize, Prepared)> {
        match &self.source {
            Source::Mix {
                requests,
                cumulative,
            } => {
                let total = cumulative.last().copied().unwrap_or(0);
                let i = if requests.len() <= 1 || total == 0 {
                    0
                } else {
                    let r = rng.random_range(0..total);
                    cumulative.partition_point(|&c| c <= r)
                };
                Some((self.route(None), requests.get(i)?.clone()))
            }
            Source::Prefix(generator) => {
                // Routed under the lock, so that request `i` goes to the same URL on every run.
                let mut generator = generator.lock();
                let drawn = match generator.next_request() {
                    Ok(d) => d,
                    Err(e) => {
                        tracing::error!("scenario: {e:#}");
                        return None;
                    }
                };
                let stream = self.config.scenario.as_ref().is_some_and(Scenario::stream);
                Some((
                    self.route(Some(drawn.tenant)),
                    Prepared::chat(drawn.body, stream),
                ))
            }
        }
    }

    /// The target of a request with this affinity key.
    fn route(&self, key: Option<u32>) -> usize {
        let n = self.targets.len() as u64;
        if n <= 1 {
            return 0;
        }
        let i = match (self.config.route, key) {
            (ClientRoute::Affinity, Some(k)) => mix(u64::from(k), AFFINITY_SALT) % n,
            _ => self.routed.fetch_add(1, Ordering::Relaxed) % n,
        };
        i as usize
    }

    /// An idle connection to target `t`, if any.
    fn take_idle(&self, t: usize) -> Option<Conn> {
        self.idle.get(t)?.lock().pop()
    }

    fn put_idle(&self, t: usize, conn: Option<Conn>) {
        if let (Some(c), Some(pool)) = (conn, self.idle.get(t)) {
            pool.lock().push(c);
        }
    }
}

/// One timed stretch of load (the warmup, the measured phase, or a comparison slice).
struct Phase {
    start: Instant,
    deadline: Instant,
    /// Request budget (`None`: until the deadline).
    limit: Option<u64>,
    tickets: AtomicU64,
    record: bool,
    shards: Vec<Mutex<Recorder>>,
    unfinished: AtomicU64,
    live: Live,
}

/// Counters for the progress line.
#[derive(Default)]
struct Live {
    sent: AtomicU64,
    ok: AtomicU64,
    errors: AtomicU64,
    in_flight: AtomicU64,
}

struct PhaseResult {
    recorder: Recorder,
    elapsed: Duration,
    unfinished: u64,
}

impl Phase {
    /// Takes one request from the budget; false when it is spent.
    fn take_ticket(&self) -> bool {
        self.limit
            .is_none_or(|n| self.tickets.fetch_add(1, Ordering::Relaxed) < n)
    }

    fn shard(&self, i: usize) -> &Mutex<Recorder> {
        // `shards` is never empty (see `run_phase`).
        &self.shards[i % self.shards.len()]
    }

    /// Runs one request, bounded by the timeout and cancelled at the deadline. Returns false if
    /// the deadline cancelled it.
    async fn attempt(
        &self,
        ctx: &Ctx,
        conn: &mut Option<Conn>,
        (t, req): (usize, &Prepared),
        out: &mut Outcome,
    ) -> bool {
        let Some(target) = ctx.targets.get(t) else {
            return false;
        };
        self.live.in_flight.fetch_add(1, Ordering::Relaxed);
        self.live.sent.fetch_add(1, Ordering::Relaxed);
        let finished = tokio::select! {
            biased;
            () = tokio::time::sleep_until(self.deadline) => None,
            r = tokio::time::timeout(ctx.config.timeout, execute(target, conn, req, out)) => {
                Some(r.is_ok())
            }
        };
        out.target = t;
        self.live.in_flight.fetch_sub(1, Ordering::Relaxed);
        match finished {
            Some(true) => {
                if ctx.config.connection_per_request {
                    *conn = None;
                }
                true
            }
            Some(false) => {
                out.error = Some(ErrorClass::Timeout);
                *conn = None;
                true
            }
            None => {
                *conn = None;
                self.unfinished.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    fn finish(&self, shard: usize, start: Instant, out: &Outcome) {
        let end = Instant::now();
        if out.error.is_some() {
            self.live.errors.fetch_add(1, Ordering::Relaxed);
        } else {
            self.live.ok.fetch_add(1, Ordering::Relaxed);
        }
        if self.record {
            self.shard(shard).lock().record(start, end, out);
        }
    }

    fn record_lag(&self, shard: usize, due: Instant) {
        if self.record {
            let lag = crate::client::micros(Instant::now().saturating_duration_since(due));
            self.shard(shard).lock().send_lag.saturating_record(lag);
        }
    }

    fn drop_one(&self) {
        self.live.errors.fetch_add(1, Ordering::Relaxed);
        if self.record {
            self.shard(0).lock().record_error(ErrorClass::Dropped);
        }
    }
}

async fn run_phase(
    ctx: &Arc<Ctx>,
    duration: Duration,
    limit: Option<u64>,
    record: bool,
    label: &str,
) -> anyhow::Result<PhaseResult> {
    let shards = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(1, 8);
    let start = Instant::now();
    let phase = Arc::new(Phase {
        start,
        deadline: start + duration,
        limit,
        tickets: AtomicU64::new(0),
        record,
        shards: (0..shards)
            .map(|_| Recorder::new().map(Mutex::new))
            .collect::<Result<_, _>>()
            .context("histogram")?,
        unfinished: AtomicU64::new(0),
        live: Live::default(),
    });
    let progress = ctx
        .config
        .progress
        .then(|| Progress::start(phase.clone(), label.to_owned()));
    match ctx.config.load {
        LoadModel::Closed { concurrency } => closed_loop(ctx, &phase, concurrency).await,
        LoadModel::Open {
            rate,
            max_outstanding,
        } => open_loop(ctx, &phase, rate, max_outstanding).await,
    }
    let elapsed = Instant::now().min(phase.deadline) - start;
    if let Some(p) = progress {
        p.stop().await;
    }
    let mut recorder = Recorder::new().context("histogram")?;
    for shard in &phase.shards {
        recorder.merge(&shard.lock());
    }
    Ok(PhaseResult {
        recorder,
        elapsed,
        unfinished: phase.unfinished.load(Ordering::Relaxed),
    })
}

/// `concurrency` workers, each sending its next request when the previous one is done.
async fn closed_loop(ctx: &Arc<Ctx>, phase: &Arc<Phase>, concurrency: usize) {
    let mut workers = JoinSet::new();
    for w in 0..concurrency {
        workers.spawn(closed_worker(ctx.clone(), phase.clone(), w));
    }
    while workers.join_next().await.is_some() {}
}

async fn closed_worker(ctx: Arc<Ctx>, phase: Arc<Phase>, w: usize) {
    // The connection kept from the last request, and its target.
    let mut held: Option<(usize, Conn)> = None;
    let mut rng = SmallRng::seed_from_u64(ctx.config.seed ^ (w as u64).wrapping_mul(0x9E37_79B9));
    let mut out = Outcome::default();
    loop {
        if Instant::now() >= phase.deadline || !phase.take_ticket() {
            break;
        }
        let Some((t, req)) = ctx.next(&mut rng) else {
            break;
        };
        let mut conn = match held.take() {
            Some((ht, c)) if ht == t => Some(c),
            other => {
                if let Some((ht, c)) = other {
                    ctx.put_idle(ht, Some(c));
                }
                ctx.take_idle(t)
            }
        };
        let start = Instant::now();
        let finished = phase.attempt(&ctx, &mut conn, (t, &req), &mut out).await;
        held = conn.map(|c| (t, c));
        if !finished {
            break;
        }
        phase.finish(w, start, &out);
        if out.error == Some(ErrorClass::Connect) {
            tokio::time::sleep_until((Instant::now() + CONNECT_BACKOFF).min(phase.deadline)).await;
        }
    }
    if let Some((t, c)) = held {
        ctx.put_idle(t, Some(c));
    }
}

/// Requests due at `rate` per second from the start of the phase, each measured from when it
/// was due; at most `max_outstanding` in flight, the others dropped.
async fn open_loop(ctx: &Arc<Ctx>, phase: &Arc<Phase>, rate: f64, max_outstanding: usize) {
    let permits = Arc::new(Semaphore::new(max_outstanding));
    let mut requests = JoinSet::new();
    let mut rng = SmallRng::seed_from_u64(ctx.config.seed);
    // Its own generator, so that Poisson gaps do not shift the mix's choices.
    let mut gaps = SmallRng::seed_from_u64(mix(ctx.config.seed, 0x9015_5011));
    let mut i: u64 = 0;
    let mut at = 0.0_f64;
    loop {
        let due = phase.start + Duration::from_secs_f64(at);
        if due >= phase.deadline || !phase.take_ticket() {
            break;
        }
        i += 1;
        at = match ctx.config.arrivals {
            Arrivals::Uniform => i as f64 / rate,
            // Inverse transform of U in (0, 1]: an exponential gap of mean 1 / rate.
            Arrivals::Poisson => at - (1.0 - gaps.random::<f64>()).ln() / rate,
        };
        if due > Instant::now() {
            tokio::time::sleep_until(due).await;
        }
        while requests.try_join_next().is_some() {}
        let Some((t, req)) = ctx.next(&mut rng) else {
            break;
        };
        match permits.clone().try_acquire_owned() {
            Ok(permit) => {
                let (ctx, phase) = (ctx.clone(), phase.clone());
                let shard = i as usize;
                requests.spawn(async move {
                    let _permit = permit;
                    let mut conn = ctx.take_idle(t);
                    let mut out = Outcome::default();
                    phase.record_lag(shard, due);
                    if phase.attempt(&ctx, &mut conn, (t, &req), &mut out).await {
                        phase.finish(shard, due, &out);
                    }
                    ctx.put_idle(t, conn);
                });
            }
            Err(_) => phase.drop_one(),
        }
    }
    while requests.join_next().await.is_some() {}
}

/// The live line on stderr: elapsed time, requests, rate over the last second, errors.
struct Progress {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Progress {
    fn start(phase: Arc<Phase>, label: String) -> Self {
        let stop = CancellationToken::new();
        let token = stop.clone();
        // Ends at `stop`; the handle is awaited when the phase ends.
        #[allow(clippy::disallowed_methods)]
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            let mut last = (Instant::now(), 0u64);
            loop {
                tokio::select! {
                    () = token.cancelled() => break,
                    _ = tick.tick() => {}
                }
                let now = Instant::now();
                let live = &phase.live;
                let ok = live.ok.load(Ordering::Relaxed);
                let rate = (ok - last.1) as f64 / (now - last.0).as_secs_f64().max(1e-3);
                last = (now, ok);
                let mut err = std::io::stderr().lock();
                let _ = write!(
                    err,
                    "\r\x1b[2K{label}{:6.1}s  sent {}  ok {}  {rate:.0} req/s  errors {}  in flight {}",
                    (now - phase.start).as_secs_f64(),
                    live.sent.load(Ordering::Relaxed),
                    ok,
                    live.errors.load(Ordering::Relaxed),
                    live.in_flight.load(Ordering::Relaxed),
                );
                let _ = err.flush();
            }
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
        });
        Self { stop, task }
    }

    async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}
