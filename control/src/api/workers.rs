//! `/v2/workers`: registration with a cluster token, heartbeats, listing, deletion, and the
//! monitor that marks silent workers `not_ready`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

use super::auth::Principal;
use super::extract::{IdPath, Query};
use super::gpustack::{self, GpuStackBody, GpuStackFields, Stored};
use super::{
    ApiError, ApiResult, AppState, check_name, get_or_404, list_or_watch, problems_to_error,
};
use crate::args;
use crate::store::{self, Kind, Leadership, Store, StoreError, Tx};
use control_client::model::{
    Cluster, DEFAULT_WORKER_PORT, EventType, MetricsPort, ModelInstance, ProxyMode, Timestamp,
    Worker, WorkerState,
};
use control_client::tokens;

/// Body of `POST /v2/workers`. GPUStack's other registration fields (status, version…) are kept
/// beside the worker ([`gpustack::WORKER`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Registration {
    name: String,
    #[serde(default)]
    hostname: Option<String>,
    ip: String,
    #[serde(default)]
    ifname: Option<String>,
    #[serde(default)]
    advertise_address: Option<String>,
    #[serde(default)]
    port: Option<u16>,
    #[serde(default)]
    metrics_port: Option<MetricsPort>,
    #[serde(default)]
    proxy_mode: Option<ProxyMode>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    worker_uuid: Option<String>,
    /// Required when an administrator (not a registration token) registers a worker.
    #[serde(default)]
    cluster_id: Option<i64>,
    /// The server writes the worker's state message.
    #[serde(default, rename = "state_message")]
    _state_message: Option<IgnoredAny>,
    /// The server keeps the maintenance (the drain) across registrations, as GPUStack does.
    #[serde(default, rename = "maintenance")]
    _maintenance: Option<IgnoredAny>,
}

impl GpuStackFields for Registration {
    const GPUSTACK: &'static [&'static str] = gpustack::WORKER;
}

/// Body of `POST /v2/worker-status` (GPUStack's `WorkerStatusPublic`): what the data plane
/// uses of it updates the worker; the rest is kept beside it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StatusReport {
    #[serde(default)]
    hostname: Option<String>,
    #[serde(default)]
    ip: Option<String>,
    #[serde(default)]
    ifname: Option<String>,
    #[serde(default)]
    advertise_address: Option<String>,
    #[serde(default)]
    port: Option<u16>,
    #[serde(default)]
    metrics_port: Option<MetricsPort>,
    #[serde(default)]
    proxy_mode: Option<ProxyMode>,
    #[serde(default, rename = "worker_uuid")]
    _worker_uuid: Option<IgnoredAny>,
    #[serde(default, rename = "state_message")]
    _state_message: Option<IgnoredAny>,
    #[serde(default, rename = "maintenance")]
    _maintenance: Option<IgnoredAny>,
}

impl GpuStackFields for StatusReport {
    const GPUSTACK: &'static [&'static str] = gpustack::WORKER;
}

fn validate(r: &Registration) -> ApiResult<()> {
    let mut problems = Vec::new();
    check_name("name", &r.name, &mut problems);
    check_address(
        Some(&r.ip),
        r.advertise_address.as_deref(),
        r.port,
        &mut problems,
    );
    problems_to_error(problems)
}

fn check_address(
    ip: Option<&str>,
    advertise_address: Option<&str>,
    port: Option<u16>,
    problems: &mut Vec<String>,
) {
    if let Some(ip) = ip
        && ip.parse::<IpAddr>().is_err()
    {
        problems.push(format!("ip {ip:?} is not an IP address"));
    }
    if let Some(a) = advertise_address.filter(|a| !a.is_empty()) {
        let bad = a.contains(['/', ' ', '@', '?', '#']) || a.chars().any(char::is_control);
        if bad || a.len() > 253 {
            problems.push(format!(
                "advertise_address {a:?} must be a host name or an IP address"
            ));
        }
    }
    // The metrics port's range is checked as it is read (`MetricsPort`).
    if port == Some(0) {
        problems.push("port must be between 1 and 65535".to_owned());
    }
}

pub(super) async fn register(
    State(state): State<AppState>,
    principal: Principal,
    GpuStackBody {
        body: input,
        gpustack: reported,
    }: GpuStackBody<Registration>,
) -> ApiResult<Response> {
    let cluster_id = match (&principal, input.cluster_id) {
        (Principal::Registration { cluster_id }, None) => *cluster_id,
        (Principal::Registration { cluster_id }, Some(asked)) if asked == *cluster_id => asked,
        (Principal::Registration { .. }, Some(_)) => {
            return Err(ApiError::forbidden(
                "the registration token belongs to another cluster",
            ));
        }
        (p, Some(asked)) if p.is_admin() => asked,
        (p, None) if p.is_admin() => {
            return Err(ApiError::forbidden(
                "Missing cluster_id for worker registration",
            ));
        }
        _ => {
            return Err(ApiError::forbidden(
                "registering a worker needs the cluster registration token",
            ));
        }
    };
    validate(&input)?;
    let key = tokens::generate(tokens::WORKER_TOKEN_PREFIX);
    let token = key.value.clone();
    let (worker, cluster) = state
        .store
        .write(async move |tx| -> ApiResult<(Stored<Worker>, Cluster)> {
            let cluster: Cluster = store::get(tx.sql(), Kind::Clusters, cluster_id)
                .await?
                .ok_or_else(|| ApiError::invalid(format!("cluster {cluster_id} not found")))?;
            let old: Option<Stored<Worker>> = tx
                .sql()
                .query_opt(
                    "SELECT data FROM workers WHERE cluster_id = $1 AND name = $2",
                    args![cluster_id, input.name],
                )
                .await?
                .map(|row| -> Result<_, StoreError> {
                    Ok(serde_json::from_str(&row.get::<String>(0)?)?)
                })
                .transpose()?;
            let id = match &old {
                Some(w) => w.object.id,
                None => {
                    tx.sql()
                        .insert(
                            "INSERT INTO workers (cluster_id, name, data) VALUES ($1, $2, '{}') \
                         RETURNING id",
                            args![cluster_id, input.name],
                        )
                        .await?
                }
            };
            let worker = Stored {
                object: build_worker(id, cluster_id, input, old.as_ref().map(|o| &o.object)),
                gpustack: with_status(reported),
            };
            // A re-registration rotates the token: only a digest is kept, so the old one cannot
            // be shown again. Same row, same id.
            tx.sql()
                .execute(
                    "UPDATE workers SET token_access_id = $1, token_digest = $2 WHERE id = $3",
                    args![key.access_id, key.digest.as_slice(), id],
                )
                .await?;
            let kind = if old.is_some() {
                EventType::Updated
            } else {
                EventType::Created
            };
            save(tx, &worker, kind).await?;
            Ok((worker, cluster))
        })
        .await?;
    let mut body = serde_json::to_value(&worker).map_err(StoreError::from)?;
    if let Value::Object(map) = &mut body {
        map.insert("token".to_owned(), Value::String(token));
        map.insert(
            "worker_config".to_owned(),
            cluster.worker_config.unwrap_or(Value::Null),
        );
    }
    Ok(axum::Json(body).into_response())
}

/// GPUStack's worker answers require `status` (it may be null).
fn with_status(mut gpustack: Map<String, Value>) -> Map<String, Value> {
    gpustack.entry("status").or_insert(Value::Null);
    gpustack
}

/// The worker's own RFC 4122 uuid when it sent one (GPUStack workers do, and their tunnel
/// client parses it), else the one it had, else a new random one.
fn worker_uuid(sent: Option<String>, old: Option<&Worker>) -> String {
    let valid = |u: &String| uuid::Uuid::try_parse(u).is_ok();
    sent.filter(valid)
        .or_else(|| old.map(|w| w.worker_uuid.clone()).filter(valid))
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
}

fn build_worker(id: i64, cluster_id: i64, r: Registration, old: Option<&Worker>) -> Worker {
    let now = Timestamp::now();
    let worker_uuid = worker_uuid(r.worker_uuid, old);
    let mut labels = r.labels.unwrap_or_default();
    labels.insert("worker-name".to_owned(), r.name.clone());
    Worker {
        id,
        hostname: r.hostname.unwrap_or_else(|| r.name.clone()),
        name: r.name,
        labels,
        cluster_id,
        ip: r.ip,
        // GPUStack's answers require it (a string).
        ifname: Some(r.ifname.unwrap_or_default()),
        advertise_address: r.advertise_address.filter(|a| !a.is_empty()),
        port: r.port.unwrap_or(DEFAULT_WORKER_PORT),
        metrics_port: r.metrics_port.unwrap_or_default(),
        worker_uuid,
        // Ready only once it heartbeats.
        state: old.map_or(WorkerState::NotReady, |w| w.state),
        state_message: old.and_then(|w| w.state_message.clone()),
        heartbeat_time: old.and_then(|w| w.heartbeat_time),
        proxy_mode: r.proxy_mode.unwrap_or(ProxyMode::Worker),
        proxy_address: old.and_then(|w| w.proxy_address.clone()),
        maintenance: old.and_then(|w| w.maintenance.clone()),
        created_at: Some(old.and_then(|w| w.created_at).unwrap_or(now)),
        updated_at: Some(now),
    }
}

async fn save(tx: &mut Tx, worker: &Stored<Worker>, kind: EventType) -> Result<(), StoreError> {
    write_row(tx, worker).await?;
    tx.emit(Kind::Workers, kind, worker.object.id, worker).await
}

/// Stores the row without a watch event: for changes no watcher needs (heartbeat times, the
/// status GPUStack workers report), so that thousands of workers do not flood every watcher.
/// The state and the last heartbeat also go to their columns, which the monitor reads.
async fn write_row(tx: &mut Tx, worker: &Stored<Worker>) -> Result<(), StoreError> {
    let w = &worker.object;
    let state = serde_json::to_value(w.state)?;
    let heartbeat_at = w.heartbeat_time.map(|t| t.0.timestamp_millis());
    tx.sql()
        .execute(
            "UPDATE workers SET data = $1, state = $2, heartbeat_at = $3 WHERE id = $4",
            args![
                serde_json::to_string(worker)?,
                state.as_str().unwrap_or_default(),
                heartbeat_at,
                w.id
            ],
        )
        .await?;
    Ok(())
}

async fn load(tx: &mut Tx, worker_id: i64) -> ApiResult<Stored<Worker>> {
    store::get(tx.sql(), Kind::Workers, worker_id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("worker {worker_id} not found")))
}

/// `POST /v2/worker-heartbeat`: the worker is alive. 204, or, while the worker drains, 200
/// with its `maintenance`.
pub(super) async fn heartbeat(
    State(state): State<AppState>,
    principal: Principal,
) -> ApiResult<Response> {
    let worker_id = own_worker(&principal, "heartbeats")?;
    let maintenance = state
        .store
        .write(async move |tx| -> ApiResult<_> {
            let worker = load(tx, worker_id).await?;
            let maintenance = worker.object.maintenance.clone().filter(|m| m.enabled);
            beat(tx, worker, false).await?;
            Ok(maintenance)
        })
        .await?;
    // A draining worker hears of it here, and then reports what it has in flight.
    Ok(match maintenance {
        Some(m) => axum::Json(serde_json::json!({ "maintenance": m })).into_response(),
        None => http::StatusCode::NO_CONTENT.into_response(),
    })
}

/// `POST /v2/worker-status` (GPUStack's `WorkerStatusPublic`, every 30 s): a heartbeat that
/// also says where the worker is and how to reach it. A change of those is a watch event (the
/// gateway routes by them); the rest of the status is kept for reads.
pub(super) async fn status(
    State(state): State<AppState>,
    principal: Principal,
    GpuStackBody {
        body: report,
        gpustack: reported,
    }: GpuStackBody<StatusReport>,
) -> ApiResult<Response> {
    let worker_id = own_worker(&principal, "status reports")?;
    let mut problems = Vec::new();
    check_address(
        report.ip.as_deref(),
        report.advertise_address.as_deref(),
        report.port,
        &mut problems,
    );
    problems_to_error(problems)?;
    state
        .store
        .write(async move |tx| -> ApiResult<()> {
            let mut worker = load(tx, worker_id).await?;
            let before = worker.object.clone();
            let w = &mut worker.object;
            let StatusReport {
                hostname,
                ip,
                ifname,
                advertise_address,
                port,
                metrics_port,
                proxy_mode,
                ..
            } = report;
            w.hostname = hostname.unwrap_or(std::mem::take(&mut w.hostname));
            w.ip = ip.unwrap_or(std::mem::take(&mut w.ip));
            w.ifname = ifname.or(w.ifname.take());
            if let Some(a) = advertise_address {
                w.advertise_address = Some(a).filter(|a| !a.is_empty());
            }
            w.port = port.unwrap_or(w.port);
            w.metrics_port = metrics_port.unwrap_or(w.metrics_port);
            w.proxy_mode = proxy_mode.unwrap_or(w.proxy_mode);
            let moved = *w != before;
            worker.gpustack.extend(reported);
            beat(tx, worker, moved).await
        })
        .await?;
    Ok(http::StatusCode::NO_CONTENT.into_response())
}

fn own_worker(principal: &Principal, what: &str) -> ApiResult<i64> {
    match principal {
        Principal::Worker { worker_id, .. } => Ok(*worker_id),
        _ => Err(ApiError::forbidden(format!(
            "{what} need the worker's own token"
        ))),
    }
}

/// Records a heartbeat: a worker that was not ready becomes ready (an event); otherwise the row
/// is written without one unless `changed` says watchers need it.
async fn beat(tx: &mut Tx, mut worker: Stored<Worker>, changed: bool) -> ApiResult<()> {
    let w = &mut worker.object;
    let now = Timestamp::now();
    w.heartbeat_time = Some(now);
    let event = changed || w.state != WorkerState::Ready;
    if w.state != WorkerState::Ready {
        w.state = WorkerState::Ready;
        w.state_message = None;
    }
    if event {
        w.updated_at = Some(now);
        save(tx, &worker, EventType::Updated).await?;
    } else {
        write_row(tx, &worker).await?;
    }
    Ok(())
}

pub(super) async fn list(
    State(state): State<AppState>,
    principal: Principal,
    Query(query): Query,
) -> ApiResult<Response> {
    // A worker sees itself only.
    let own = principal.worker_or_reader()?;
    let (id, cluster) = (query.id, query.cluster_id);
    list_or_watch(
        &state,
        Kind::Workers,
        &query,
        own.is_some(),
        move |w: &Stored<Worker>| {
            let w = &w.object;
            own.is_none_or(|me| w.id == me)
                && id.is_none_or(|id| w.id == id)
                && cluster.is_none_or(|c| w.cluster_id == c)
        },
    )
    .await
}

pub(super) async fn get_one(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<axum::Json<Stored<Worker>>> {
    match principal {
        Principal::Worker { worker_id, .. } if worker_id == id => {}
        ref p => p.require_reader()?,
    }
    get_or_404::<Stored<Worker>>(&state, Kind::Workers, id, "worker")
        .await
        .map(axum::Json)
}

pub(super) async fn delete(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<Response> {
    principal.require_admin()?;
    state
        .store
        .write(async move |tx| -> ApiResult<()> {
            let worker = load(tx, id).await?;
            // Its instances go with it: nothing can reach them any more.
            let instances: Vec<ModelInstance> =
                store::list(tx.sql(), Kind::ModelInstances, Some(("worker_id", id))).await?;
            for inst in instances {
                tx.sql()
                    .execute("DELETE FROM model_instances WHERE id = $1", args![inst.id])
                    .await?;
                tx.emit(Kind::ModelInstances, EventType::Deleted, inst.id, &inst)
                    .await?;
            }
            tx.sql()
                .execute("DELETE FROM workers WHERE id = $1", args![id])
                .await?;
            tx.emit(Kind::Workers, EventType::Deleted, id, &worker)
                .await?;
            Ok(())
        })
        .await?;
    Ok(http::StatusCode::NO_CONTENT.into_response())
}

/// Records where a worker's tunnel ends (`Some`: the owner's proxy address, when its tunnel
/// comes up) or that it ended (`None`). Ending clears only `owner`'s own record: when the worker
/// has meanwhile connected through another server, that newer tunnel's record stays.
pub async fn set_proxy_address(
    store: &Store,
    worker_id: i64,
    owner: String,
    up: bool,
) -> Result<bool, StoreError> {
    store
        .write(async move |tx| -> Result<bool, StoreError> {
            let Some(mut worker) =
                store::get::<Stored<Worker>>(tx.sql(), Kind::Workers, worker_id).await?
            else {
                return Ok(false);
            };
            let current = &worker.object.proxy_address;
            let proxy_address = match (up, current) {
                (true, _) => Some(owner),
                (false, Some(other)) if *other != owner => Some(other.clone()),
                (false, _) => None,
            };
            if *current != proxy_address {
                worker.object.proxy_address = proxy_address;
                worker.object.updated_at = Some(Timestamp::now());
                save(tx, &worker, EventType::Updated).await?;
            }
            Ok(true)
        })
        .await
}

/// Clears the `proxy_address` of every worker (`owner` `None`) or of those whose tunnel ended
/// on `owner` (at a server's start: none of its tunnels is up yet).
pub async fn clear_proxy_addresses(store: &Store, owner: Option<&str>) -> Result<(), StoreError> {
    let owner = owner.map(str::to_owned);
    store
        .write(async move |tx| -> Result<(), StoreError> {
            let workers: Vec<Stored<Worker>> = store::list(tx.sql(), Kind::Workers, None).await?;
            let stale = |w: &Stored<Worker>| match (&w.object.proxy_address, &owner) {
                (None, _) => false,
                (Some(_), None) => true,
                (Some(at), Some(owner)) => at == owner,
            };
            for mut w in workers.into_iter().filter(stale) {
                w.object.proxy_address = None;
                w.object.updated_at = Some(Timestamp::now());
                save(tx, &w, EventType::Updated).await?;
            }
            Ok(())
        })
        .await
}

/// Marks `ready` workers whose last heartbeat is older than `timeout` as `not_ready`, checking a
/// few times per timeout period until `shutdown` fires. A worker is marked at the second check
/// that finds it silent, never at the first: one late heartbeat takes nothing out of routing.
pub fn spawn_heartbeat_monitor(
    store: Store,
    timeout: Duration,
    leadership: Leadership,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let period = (timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    let timeout = chrono::Duration::from_std(timeout).unwrap_or(chrono::Duration::MAX);
    // Ends at `shutdown`; the caller keeps the handle.
    net::task::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // When this server last checked (while it held the role).
        let mut last_check: Option<chrono::DateTime<Utc>> = None;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            // On a shared database one server at a time runs it (see `store::lease`).
            if !leadership.is_held() {
                last_check = None;
                continue;
            }
            let now = Utc::now();
            // No cutoff for a timeout beyond the calendar: nobody is silent that long.
            if let Some(cutoff) = last_check.and_then(|last| last.checked_sub_signed(timeout))
                && let Err(e) = expire_silent_workers(&store, cutoff).await
            {
                tracing::warn!(error = %e, "heartbeat monitor failed");
            }
            last_check = Some(now);
        }
    })
}

/// Marks the `ready` workers silent since before `cutoff` `not_ready`: those that the last check
/// (at `cutoff` + timeout) found silent already, and that have not beaten since.
async fn expire_silent_workers(
    store: &Store,
    cutoff: chrono::DateTime<Utc>,
) -> Result<(), StoreError> {
    let cutoff = cutoff.timestamp_millis();
    store
        .write(async move |tx| -> Result<_, StoreError> {
            let rows = tx
                .sql()
                .query(
                    "UPDATE workers SET state = 'not_ready' \
                     WHERE state = 'ready' AND (heartbeat_at IS NULL OR heartbeat_at < $1) \
                     RETURNING data",
                    args![cutoff],
                )
                .await?;
            for row in rows {
                let mut stored: Stored<Worker> = serde_json::from_str(&row.get::<String>(0)?)?;
                let w = &mut stored.object;
                let when = w
                    .heartbeat_time
                    .map_or("never".to_owned(), |t| t.0.to_rfc3339());
                w.state = WorkerState::NotReady;
                w.state_message = Some(format!("Heartbeat lost (last heartbeat: {when})"));
                w.updated_at = Some(Timestamp::now());
                tracing::info!(worker_id = w.id, worker = %w.name, "worker heartbeat lost");
                save(tx, &stored, EventType::Updated).await?;
            }
            Ok(())
        })
        .await
}
