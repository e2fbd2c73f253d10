//! The engines' load, read where they run and sent to every server.
//!
//! [`scrape`] reads `GET http://127.0.0.1:<port>/metrics` of each local instance every
//! interval (100 ms by default), on its own schedule and its own connection, at most
//! [`MAX_IN_FLIGHT`] at once: a slow engine holds back no other, and nothing of it is on the
//! request path. What it reads ([`control_client::engine_load::parse`]) goes into the worker's
//! own [`EngineLoads`].
//!
//! An engine whose page cannot be read (no `/metrics`, refused, a page without load) is still
//! served; after [`SLOW_AFTER`] failures in a row it is read every [`SLOW_RETRY`] only, logged
//! once. A page that comes late is not such a failure: an engine busy with its batches answers
//! its metrics late exactly when its load matters, so it is read again at the next interval. A restarted engine has lost its cache: the reading's `epoch` changes when
//! the engine's counters go back, its process start time changes, or it refused connections
//! since the last reading. Epochs start at the worker's start time (milliseconds since the
//! Unix epoch), so a restarted worker never repeats one.
//!
//! [`report`] streams the readings to one server: one long `POST /v2/worker-load` whose body is
//! a line per interval ([`control_client::engine_load::wire`]), reopened after a failure with
//! a growing, jittered pause. A server that answers 404 or 405 has no such endpoint (GPUStack):
//! it is asked again only after [`NOT_OFFERED_RETRY`].

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::CancellationToken;

use control_client::engine_load::parse::{self, EngineMetrics, MAX_PAGE_BYTES};
use control_client::engine_load::wire::{LoadLine, WireReading};
use control_client::engine_load::{EngineLoad, EngineLoads, KEEPALIVE, Reading};
use control_client::tls::ApiConnector;
use net::backoff::Backoff;

/// The default reading interval (`--engine-metrics-interval`).
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(100);
/// Engines read at once, at most.
pub const MAX_IN_FLIGHT: usize = 16;
/// Failures in a row after which an engine is read every [`SLOW_RETRY`] only.
pub const SLOW_AFTER: u32 = 3;
/// How often an engine whose page cannot be read is tried.
pub const SLOW_RETRY: Duration = Duration::from_secs(10);
/// How often a server without `/v2/worker-load` (404) is tried.
pub const NOT_OFFERED_RETRY: Duration = Duration::from_secs(600);
/// A report stream that lasted this long counts as working: the next failure starts the
/// backoff over.
const REPORT_PROVEN: Duration = Duration::from_secs(10);

/// How one read of an engine went.
#[derive(Debug)]
enum Scraped {
    Page(EngineMetrics),
    /// Nothing listens (the connect failed): the process is gone, or not up yet.
    Refused(String),
    /// No page within the read limit: the engine is busy, not broken.
    Late(String),
    /// Any other failure: a status, a page without load.
    Failed(String),
}

/// The engine-page client: plain HTTP to 127.0.0.1, one kept-alive connection per engine.
type PageClient = Client<HttpConnector, Empty<Bytes>>;

fn page_client() -> PageClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(1)));
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(http)
}

async fn read_page(client: &PageClient, port: u16, limit: Duration) -> Scraped {
    let request = match Request::get(format!("http://127.0.0.1:{port}/metrics")).body(Empty::new())
    {
        Ok(request) => request,
        Err(e) => return Scraped::Failed(e.to_string()),
    };
    let exchange = async {
        let response = match client.request(request).await {
            Ok(response) => response,
            Err(e) if e.is_connect() => return Scraped::Refused(e.to_string()),
            Err(e) => return Scraped::Failed(e.to_string()),
        };
        let status = response.status();
        if !status.is_success() {
            return Scraped::Failed(format!("GET /metrics answered {status}"));
        }
        match Limited::new(response.into_body(), MAX_PAGE_BYTES)
            .collect()
            .await
        {
            Ok(page) => {
                let metrics = parse::parse(&page.to_bytes());
                if metrics.has_load() {
                    Scraped::Page(metrics)
                } else {
                    Scraped::Failed("the page has no waiting or running count".to_owned())
                }
            }
            Err(e) => Scraped::Failed(format!("reading the page: {e}")),
        }
    };
    timeout(limit, exchange)
        .await
        .unwrap_or_else(|_| Scraped::Late(format!("no page within {limit:?}")))
}

/// What the scraper knows of one instance.
#[derive(Debug)]
struct Tracked {
    port: u16,
    next: Instant,
    in_flight: bool,
    /// The last page read, to tell a restart.
    last: Option<EngineMetrics>,
    epoch: u64,
    /// A connect failed since the last page: the next page is a new process.
    refused: bool,
    failures: u32,
}

impl Tracked {
    fn new(port: u16, epoch: u64, now: Instant) -> Self {
        Self {
            port,
            next: now,
            in_flight: false,
            last: None,
            epoch,
            refused: false,
            failures: 0,
        }
    }

    /// Counts a failed read; after [`SLOW_AFTER`] in a row, reads every [`SLOW_RETRY`] only.
    fn failed(
        &mut self,
        id: i64,
        reason: &str,
        started: Instant,
        interval: Duration,
        now: Instant,
    ) {
        self.failures = self.failures.saturating_add(1);
        if self.failures < SLOW_AFTER {
            tracing::debug!(instance_id = id, port = self.port, error = %reason, "engine metrics");
            self.next = (started + interval).max(now);
            return;
        }
        if self.failures == SLOW_AFTER {
            tracing::info!(
                instance_id = id,
                port = self.port,
                error = %reason,
                retry_every = ?SLOW_RETRY,
                "cannot read the engine's metrics; routing it without its load"
            );
        }
        self.next = now + SLOW_RETRY;
    }

    /// Takes a read that started at `started`; returns the reading to publish, if any.
    fn take(
        &mut self,
        id: i64,
        scraped: Scraped,
        started: Instant,
        interval: Duration,
    ) -> Option<EngineLoad> {
        let now = Instant::now();
        self.in_flight = false;
        let metrics = match scraped {
            Scraped::Page(metrics) => metrics,
            Scraped::Refused(reason) => {
                self.refused = true;
                self.failed(id, &reason, started, interval, now);
                return None;
            }
            Scraped::Failed(reason) => {
                self.failed(id, &reason, started, interval, now);
                return None;
            }
            Scraped::Late(reason) => {
                tracing::debug!(instance_id = id, port = self.port, error = %reason, "engine metrics");
                self.next = (started + interval).max(now);
                return None;
            }
        };
        let restarted = self.refused
            || self
                .last
                .as_ref()
                .is_some_and(|before| metrics.restarted_since(before));
        if restarted && self.last.is_some() {
            self.epoch += 1;
            tracing::info!(instance_id = id, epoch = self.epoch, "the engine restarted");
        }
        if self.failures >= SLOW_AFTER {
            tracing::info!(
                instance_id = id,
                port = self.port,
                "the engine's metrics read again"
            );
        }
        self.refused = false;
        self.failures = 0;
        self.last = Some(metrics);
        self.next = (started + interval).max(now);
        Some(EngineLoad {
            waiting: metrics.waiting.unwrap_or(0),
            running: metrics.running.unwrap_or(0),
            kv_usage: metrics.kv_usage,
            block_size: metrics.block_size,
            num_blocks: metrics.num_blocks,
            epoch: self.epoch,
        })
    }
}

/// How long one read of an engine's page may take.
pub fn read_limit(interval: Duration) -> Duration {
    (interval * 5).max(Duration::from_secs(2))
}

/// Milliseconds since the Unix epoch: the first epoch of every instance.
fn first_epoch() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(1))
}

/// Reads the engines of `instances` (instance id → local port) every `interval` into `loads`,
/// until `shutdown`.
pub async fn scrape(
    mut instances: watch::Receiver<HashMap<i64, u16>>,
    loads: Arc<EngineLoads>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let client = page_client();
    // A read may take up to five intervals, and never less than two seconds: a CPU engine's API
    // server under load answers its page seconds late.
    let limit = read_limit(interval);
    let base_epoch = first_epoch();
    let mut tracked: HashMap<i64, Tracked> = HashMap::new();
    let mut reads: JoinSet<(i64, Scraped, Instant)> = JoinSet::new();
    loop {
        let now = Instant::now();
        {
            let wanted = instances.borrow_and_update();
            tracked.retain(|id, t| wanted.get(id) == Some(&t.port));
            for (id, port) in wanted.iter() {
                tracked
                    .entry(*id)
                    .or_insert_with(|| Tracked::new(*port, base_epoch, now));
            }
        }
        for (id, t) in &mut tracked {
            if reads.len() >= MAX_IN_FLIGHT {
                break;
            }
            if !t.in_flight && t.next <= now {
                t.in_flight = true;
                let (client, id, port) = (client.clone(), *id, t.port);
                reads.spawn(async move { (id, read_page(&client, port, limit).await, now) });
            }
        }
        let wake = tracked
            .values()
            .filter(|t| !t.in_flight)
            .map(|t| t.next)
            .min()
            .unwrap_or(now + interval.max(Duration::from_millis(100)));
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = instances.changed() => if changed.is_err() { return },
            Some(done) = reads.join_next(), if !reads.is_empty() => {
                let Ok((id, scraped, started)) = done else { continue };
                let Some(t) = tracked.get_mut(&id) else { continue };
                if let Some(load) = t.take(id, scraped, started, interval) {
                    let now = Instant::now();
                    loads.update([(id, Reading { load, taken: now })], now);
                }
            }
            () = sleep_until(wake), if reads.len() < MAX_IN_FLIGHT => {}
        }
    }
}

/// A report stream's body: the lines, fed through a channel.
#[derive(Debug)]
pub struct LineBody(mpsc::Receiver<Bytes>);

impl Body for LineBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|line| line.map(|l| Ok(Frame::data(l))))
    }
}

/// The client of the report streams.
pub type ReportClient = Client<ApiConnector, LineBody>;

/// A client for [`report`]: `tls` for `https` servers.
pub fn report_client(tls: Option<Arc<rustls::ClientConfig>>) -> ReportClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .build(ApiConnector::new(http, tls))
}

/// Where and how to report.
#[derive(Clone)]
pub struct Report {
    pub client: ReportClient,
    /// The server's API, `http(s)://host:port`.
    pub server_url: String,
    /// The worker token.
    pub token: String,
    pub interval: Duration,
}

impl std::fmt::Debug for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Report")
            .field("server_url", &self.server_url)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// How a report stream ended.
enum Ended {
    Status(StatusCode),
    Failed(String),
    Shutdown,
}

/// Streams the fresh readings of `loads` to one server, a line per interval, until
/// `shutdown`.
pub async fn report(report: Report, loads: Arc<EngineLoads>, shutdown: CancellationToken) {
    let server = report.server_url.trim_end_matches('/').to_owned();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
    let mut not_offered = false;
    loop {
        let started = Instant::now();
        let ended = stream(&report, &server, &loads, &shutdown).await;
        let pause = match ended {
            Ended::Shutdown => return,
            // 405: a server whose web UI takes every GET path.
            Ended::Status(StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED) => {
                if !not_offered {
                    tracing::info!(
                        %server,
                        retry_in = ?NOT_OFFERED_RETRY,
                        "the server takes no engine load reports (a GPUStack server?)"
                    );
                }
                not_offered = true;
                NOT_OFFERED_RETRY
            }
            ended => {
                if started.elapsed() >= REPORT_PROVEN {
                    backoff.reset();
                }
                let reason = match ended {
                    Ended::Status(status) => format!("the server answered {status}"),
                    Ended::Failed(e) => e,
                    Ended::Shutdown => String::new(),
                };
                if backoff.attempt() == 0 {
                    tracing::warn!(%server, error = %reason, "engine load report stream ended");
                } else {
                    tracing::debug!(%server, error = %reason, "engine load report stream ended");
                }
                backoff.next_delay()
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = sleep(pause) => {}
        }
    }
}

/// One report stream, until it ends.
async fn stream(
    report: &Report,
    server: &str,
    loads: &EngineLoads,
    shutdown: &CancellationToken,
) -> Ended {
    let (lines, body) = mpsc::channel(2);
    let request = Request::builder()
        .method(Method::POST)
        .uri(format!("{server}/v2/worker-load"))
        .header(
            http::header::AUTHORIZATION,
            format!("Bearer {}", report.token),
        )
        .header(http::header::CONTENT_TYPE, "application/x-ndjson")
        .body(LineBody(body));
    let request = match request {
        Ok(request) => request,
        Err(e) => return Ended::Failed(e.to_string()),
    };
    let mut response = std::pin::pin!(report.client.request(request));
    let mut tick = tokio::time::interval(report.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_line: Option<Instant> = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return Ended::Shutdown,
            answer = &mut response => return match answer {
                Ok(answer) => Ended::Status(answer.status()),
                Err(e) => Ended::Failed(e.to_string()),
            },
            _ = tick.tick() => {
                let now = Instant::now();
                let all = loads.all();
                let mut readings: Vec<WireReading> = all
                    .iter()
                    .filter(|(_, r)| r.is_fresh(now))
                    .map(|(id, r)| WireReading::new(*id, r, now))
                    .collect();
                let quiet = last_line.is_some_and(|at| now.duration_since(at) < KEEPALIVE);
                if readings.is_empty() && quiet {
                    continue;
                }
                readings.sort_unstable_by_key(|r| r.id);
                // Full: the server reads slowly; this line is skipped, the next one says more.
                if let Err(mpsc::error::TrySendError::Closed(_)) =
                    lines.try_send(LoadLine { readings }.to_bytes())
                {
                    // The request is over; its answer follows.
                    continue;
                }
                last_line = Some(now);
            }
        }
    }
}

/// Reads the engines of `instances` every `interval` and reports them to each of
/// `server_urls` with the worker `token`, in tasks of `tasks` that end at `shutdown`.
pub fn start(
    tasks: &mut JoinSet<()>,
    instances: watch::Receiver<HashMap<i64, u16>>,
    server_urls: &[String],
    token: &str,
    tls: Option<Arc<rustls::ClientConfig>>,
    interval: Duration,
    shutdown: &CancellationToken,
) {
    let loads = EngineLoads::new();
    tasks.spawn(scrape(instances, loads.clone(), interval, shutdown.clone()));
    let client = report_client(tls);
    for url in server_urls {
        let report_to = Report {
            client: client.clone(),
            server_url: url.clone(),
            token: token.to_owned(),
            interval,
        };
        tasks.spawn(report(report_to, loads.clone(), shutdown.clone()));
    }
}
