//! `/v2/worker-load`: the engines' load, carried from the workers to the gateways in memory.
//!
//! - `POST` (a worker, with its worker token): one long request whose body streams lines of
//!   readings of the worker's own instances ([`control_client::engine_load::wire`]). Each line
//!   goes to the [`LoadHub`], whose one task writes the server's [`EngineLoads`] (what the
//!   server's own gateway reads). A reading of an instance of another worker ends the stream
//!   with 403; one of an instance the server does not know (deleted meanwhile) is dropped.
//! - `GET` (data-plane keys and admins): the fresh readings as one line; with `?watch=true`, a
//!   stream of lines, the whole table first, then every [`WATCH_INTERVAL`] the readings that
//!   changed (or are about to look old), an empty line at least every
//!   [`control_client::engine_load::KEEPALIVE`].
//!
//! Nothing of this goes through the store or its event log: a reading is worth something for
//! two seconds ([`control_client::engine_load::MAX_AGE`]), and workers send one every 100 ms.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{StatusCode, header};
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;

use super::auth::Principal;
use super::extract::Query;
use super::{ApiError, ApiResult, AppState};
use crate::args;
use crate::store::Store;
use control_client::engine_load::wire::{Lines, LoadLine, MAX_LINE_BYTES, WireReading};
use control_client::engine_load::{EngineLoad, EngineLoads, KEEPALIVE, MAX_AGE, Reading};

/// A report stream silent this long (workers write at least every
/// [`control_client::engine_load::KEEPALIVE`]) is ended.
pub const REPORT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a watcher gets the readings that changed.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(100);
/// A reading whose load did not change is sent again once the copy the watcher holds is this
/// old, so that it never goes stale there while the worker keeps reporting it.
const REFRESH: Duration = Duration::from_millis(500);
/// A watcher that took longer than this to take a line is dropped: lines are made when the
/// connection can take one (nothing is queued per watcher), so a slow reader only ever holds
/// one, and one that stopped reading is let go when it comes back.
const SLOW_WATCHER: Duration = Duration::from_secs(10);
/// Batches of readings waiting for the hub's writer; beyond, a batch is dropped (the next one
/// follows within 100 ms).
const HUB_QUEUE: usize = 1024;
/// Instances whose owner one report stream remembers (it asks the store once per instance).
const MAX_OWNERS: usize = 4096;

/// Where the readings of every worker meet: one writer task owns the updates of the table.
#[derive(Debug)]
pub struct LoadHub {
    loads: Arc<EngineLoads>,
    batches: mpsc::Sender<Vec<(i64, Reading)>>,
}

impl LoadHub {
    /// The hub of `loads` and its writer, which ends at `shutdown`.
    pub fn start(
        loads: Arc<EngineLoads>,
        shutdown: CancellationToken,
    ) -> (Arc<Self>, JoinHandle<()>) {
        let (batches, received) = mpsc::channel(HUB_QUEUE);
        // Ends at `shutdown` (or when every sender is gone); the server awaits the handle.
        let writer = net::task::spawn(write(loads.clone(), received, shutdown));
        (Arc::new(Self { loads, batches }), writer)
    }

    /// The table the hub writes.
    pub fn loads(&self) -> &Arc<EngineLoads> {
        &self.loads
    }

    fn offer(&self, batch: Vec<(i64, Reading)>) {
        if self.batches.try_send(batch).is_err() {
            tracing::debug!("engine load readings dropped: the writer lags");
        }
    }
}

/// Applies batches as they come, all that wait at once in one update; drops stale readings
/// every second even when nothing comes.
async fn write(
    loads: Arc<EngineLoads>,
    mut received: mpsc::Receiver<Vec<(i64, Reading)>>,
    shutdown: CancellationToken,
) {
    let mut expiry = tokio::time::interval(MAX_AGE / 2);
    expiry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut batches = Vec::new();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            n = received.recv_many(&mut batches, 256) => {
                if n == 0 {
                    return;
                }
                loads.update(batches.drain(..).flatten(), Instant::now());
            }
            _ = expiry.tick() => loads.update([], Instant::now()),
        }
    }
}

/// Whose an instance is, as one report stream learnt it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    Reporter,
    Other,
    /// Not in the store (deleted, or never was).
    Nobody,
}

async fn owner(store: &Store, worker_id: i64, instance_id: i64) -> ApiResult<Owner> {
    let found = store
        .read(async move |sql| {
            sql.query_opt(
                "SELECT worker_id FROM model_instances WHERE id = $1",
                args![instance_id],
            )
            .await?
            .map(|row| row.get::<Option<i64>>(0))
            .transpose()
        })
        .await?;
    Ok(match found {
        None => Owner::Nobody,
        Some(Some(w)) if w == worker_id => Owner::Reporter,
        Some(_) => Owner::Other,
    })
}

/// `POST /v2/worker-load`: a worker's stream of readings.
pub(super) async fn report(
    State(state): State<AppState>,
    principal: Principal,
    body: Body,
) -> ApiResult<Response> {
    let Principal::Worker { worker_id, .. } = principal else {
        return Err(ApiError::forbidden(
            "only a worker reports engine load, with its own worker token",
        ));
    };
    let mut owners: HashMap<i64, Owner> = HashMap::new();
    let mut lines = Lines::new(MAX_LINE_BYTES);
    let mut body = body;
    loop {
        let frame = tokio::select! {
            () = state.shutdown.cancelled() => return Ok(StatusCode::NO_CONTENT.into_response()),
            frame = timeout(REPORT_IDLE_TIMEOUT, body.frame()) => frame,
        };
        let data = match frame {
            Err(_) => {
                return Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    format!("no line for {REPORT_IDLE_TIMEOUT:?}"),
                ));
            }
            Ok(None) => return Ok(StatusCode::NO_CONTENT.into_response()),
            Ok(Some(Err(e))) => {
                return Err(ApiError::bad_request(format!("reading the body: {e}")));
            }
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => data,
                Err(_) => continue,
            },
        };
        let too_long = |e: control_client::engine_load::wire::LineTooLong| {
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, e.to_string())
        };
        lines.push(&data).map_err(too_long)?;
        while let Some(line) = lines.next_line().map_err(too_long)? {
            let line = LoadLine::parse(&line)
                .map_err(|e| ApiError::bad_request(format!("malformed line: {e}")))?;
            let mut batch = Vec::with_capacity(line.readings.len());
            for wire in &line.readings {
                let known = owners.get(&wire.id).copied();
                let whose = match known {
                    Some(whose) => whose,
                    None => {
                        let whose = owner(&state.store, worker_id, wire.id).await?;
                        if owners.len() >= MAX_OWNERS {
                            owners.clear();
                        }
                        owners.insert(wire.id, whose);
                        whose
                    }
                };
                match whose {
                    Owner::Reporter => {
                        if let Some(reading) = wire.reading(Instant::now()) {
                            batch.push((wire.id, reading));
                        }
                    }
                    Owner::Other => {
                        tracing::warn!(
                            worker_id,
                            instance_id = wire.id,
                            "a worker reported the load of another worker's instance"
                        );
                        return Err(ApiError::forbidden(format!(
                            "instance {} is not this worker's",
                            wire.id
                        )));
                    }
                    Owner::Nobody => {}
                }
            }
            if !batch.is_empty() {
                state.loads.offer(batch);
            }
        }
    }
}

/// `GET /v2/worker-load[?watch=true]`: the table, once or as a stream.
pub(super) async fn read(
    State(state): State<AppState>,
    principal: Principal,
    Query(query): Query,
) -> ApiResult<Response> {
    principal.require_reader()?;
    let loads = state.loads.loads().clone();
    let ndjson = |body: Body| {
        Response::builder()
            .header(header::CONTENT_TYPE, "application/x-ndjson")
            .header(header::CACHE_CONTROL, "no-cache")
            .header("x-accel-buffering", "no")
            .body(body)
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
    };
    if query.watch != Some(true) {
        let mut watcher = Watcher::new(loads, state.shutdown.clone());
        return ndjson(Body::from(watcher.line(Instant::now())));
    }
    let watcher = Watcher::new(loads, state.shutdown.clone());
    ndjson(Body::from_stream(futures_util::stream::unfold(
        watcher,
        Watcher::next,
    )))
}

/// One watcher's view: what it was last sent.
struct Watcher {
    loads: Arc<EngineLoads>,
    /// By instance: the load sent and the `taken` it was sent with.
    sent: HashMap<i64, (EngineLoad, Instant)>,
    /// No line yet: the first one is the whole table, at once.
    first: bool,
    next: Instant,
    last_line: Instant,
    shutdown: CancellationToken,
}

impl Watcher {
    fn new(loads: Arc<EngineLoads>, shutdown: CancellationToken) -> Self {
        let now = Instant::now();
        Self {
            loads,
            sent: HashMap::new(),
            first: true,
            next: now,
            last_line: now,
            shutdown,
        }
    }

    /// The readings the watcher does not hold as they are now.
    fn line(&mut self, now: Instant) -> Bytes {
        let all = self.loads.all();
        self.sent
            .retain(|id, _| all.get(id).is_some_and(|r| r.is_fresh(now)));
        let mut readings = Vec::new();
        for (id, reading) in all.iter().filter(|(_, r)| r.is_fresh(now)) {
            let due = match self.sent.get(id) {
                None => true,
                Some((load, taken)) => {
                    *load != reading.load
                        || (reading.taken > *taken
                            && now.saturating_duration_since(*taken) >= REFRESH)
                }
            };
            if due {
                self.sent.insert(*id, (reading.load, reading.taken));
                readings.push(WireReading::new(*id, reading, now));
            }
        }
        readings.sort_unstable_by_key(|r| r.id);
        LoadLine { readings }.to_bytes()
    }

    async fn next(mut self) -> Option<(Result<Bytes, Infallible>, Self)> {
        loop {
            if !self.first {
                let late = Instant::now().saturating_duration_since(self.next);
                if late > SLOW_WATCHER {
                    tracing::info!(?late, "engine load watcher too slow; dropping it");
                    return None;
                }
                tokio::select! {
                    () = self.shutdown.cancelled() => return None,
                    () = tokio::time::sleep_until(self.next) => {}
                }
            }
            let now = Instant::now();
            self.next = now + WATCH_INTERVAL;
            let line = self.line(now);
            let empty = line.as_ref() == b"{\"readings\":[]}\n";
            if self.first || !empty || now.saturating_duration_since(self.last_line) >= KEEPALIVE {
                self.first = false;
                self.last_line = now;
                return Some((Ok(line), self));
            }
        }
    }
}
