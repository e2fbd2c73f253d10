//! `/v2/workers`: registration with a cluster token, heartbeats, listing, deletion, and the
//! monitor that marks silent workers `not_ready`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use rusqlite::{OptionalExtension, params};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::auth::Principal;
use super::extract::{IdPath, JsonBody, Query};
use super::{
    ApiError, ApiResult, AppState, check_name, get_or_404, list_or_watch, problems_to_error,
};
use crate::model::{
    Cluster, DEFAULT_WORKER_METRICS_PORT, DEFAULT_WORKER_PORT, EventType, ModelInstance, ProxyMode,
    Timestamp, Worker, WorkerState,
};
use crate::store::{self, Kind, Store, StoreError, Tx};
use crate::tokens;

/// Body of `POST /v2/workers`. GPUStack workers send more (status, version…): accepted, ignored.
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
    metrics_port: Option<u16>,
    #[serde(default)]
    proxy_mode: Option<ProxyMode>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    worker_uuid: Option<String>,
    /// Required when an administrator (not a registration token) registers a worker.
    #[serde(default)]
    cluster_id: Option<i64>,
    // GPUStack worker fields, ignored.
    #[serde(default, rename = "status")]
    _status: Option<IgnoredAny>,
    #[serde(default, rename = "worker_version")]
    _worker_version: Option<IgnoredAny>,
    #[serde(default, rename = "system_reserved")]
    _system_reserved: Option<IgnoredAny>,
    #[serde(default, rename = "external_id")]
    _external_id: Option<IgnoredAny>,
}

fn validate(r: &Registration) -> ApiResult<()> {
    let mut problems = Vec::new();
    check_name("name", &r.name, &mut problems);
    if r.ip.parse::<IpAddr>().is_err() {
        problems.push(format!("ip {:?} is not an IP address", r.ip));
    }
    if let Some(a) = r.advertise_address.as_deref().filter(|a| !a.is_empty()) {
        let bad = a.contains(['/', ' ', '@', '?', '#']) || a.chars().any(char::is_control);
        if bad || a.len() > 253 {
            problems.push(format!(
                "advertise_address {a:?} must be a host name or an IP address"
            ));
        }
    }
    for (field, port) in [("port", r.port), ("metrics_port", r.metrics_port)] {
        if port == Some(0) {
            problems.push(format!("{field} must be between 1 and 65535"));
        }
    }
    problems_to_error(problems)
}

pub(super) async fn register(
    State(state): State<AppState>,
    principal: Principal,
    JsonBody(input): JsonBody<Registration>,
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
        .write(move |tx| -> ApiResult<(Worker, Cluster)> {
            let cluster: Cluster = store::get(tx.conn(), Kind::Clusters, cluster_id)?
                .ok_or_else(|| ApiError::invalid(format!("cluster {cluster_id} not found")))?;
            let existing: Option<(i64, String)> = tx
                .conn()
                .query_row(
                    "SELECT id, data FROM workers WHERE cluster_id = ?1 AND name = ?2",
                    params![cluster_id, input.name],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()
                .map_err(StoreError::from)?;
            let old: Option<Worker> = existing
                .map(|(_, data)| serde_json::from_str(&data))
                .transpose()
                .map_err(StoreError::from)?;
            let id = match &old {
                Some(w) => w.id,
                None => {
                    tx.conn()
                        .execute(
                            "INSERT INTO workers (cluster_id, name, data) VALUES (?1, ?2, '{}')",
                            params![cluster_id, input.name],
                        )
                        .map_err(StoreError::from)?;
                    tx.conn().last_insert_rowid()
                }
            };
            let worker = build_worker(id, cluster_id, input, old.as_ref());
            // A re-registration rotates the token: only a digest is kept, so the old one cannot
            // be shown again. Same row, same id.
            tx.conn()
                .execute(
                    "UPDATE workers SET token_access_id = ?1, token_digest = ?2 WHERE id = ?3",
                    params![key.access_id, key.digest.as_slice(), id],
                )
                .map_err(StoreError::from)?;
            let kind = if old.is_some() {
                EventType::Updated
            } else {
                EventType::Created
            };
            save(tx, &worker, kind)?;
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

fn build_worker(id: i64, cluster_id: i64, r: Registration, old: Option<&Worker>) -> Worker {
    let now = Timestamp::now();
    let worker_uuid = r
        .worker_uuid
        .filter(|u| !u.is_empty())
        .or_else(|| old.map(|w| w.worker_uuid.clone()).filter(|u| !u.is_empty()))
        .unwrap_or_else(|| tokens::generate("u").access_id);
    let mut labels = r.labels.unwrap_or_default();
    labels.insert("worker-name".to_owned(), r.name.clone());
    Worker {
        id,
        hostname: r.hostname.unwrap_or_else(|| r.name.clone()),
        name: r.name,
        labels,
        cluster_id,
        ip: r.ip,
        ifname: r.ifname,
        advertise_address: r.advertise_address.filter(|a| !a.is_empty()),
        port: r.port.unwrap_or(DEFAULT_WORKER_PORT),
        metrics_port: r.metrics_port.unwrap_or(DEFAULT_WORKER_METRICS_PORT),
        worker_uuid,
        // Ready only once it heartbeats.
        state: old.map_or(WorkerState::NotReady, |w| w.state),
        state_message: old.and_then(|w| w.state_message.clone()),
        heartbeat_time: old.and_then(|w| w.heartbeat_time),
        proxy_mode: r.proxy_mode.unwrap_or(ProxyMode::Worker),
        proxy_address: old.and_then(|w| w.proxy_address.clone()),
        created_at: Some(old.and_then(|w| w.created_at).unwrap_or(now)),
        updated_at: Some(now),
    }
}

fn save(tx: &mut Tx<'_>, worker: &Worker, kind: EventType) -> Result<(), StoreError> {
    tx.conn().execute(
        "UPDATE workers SET data = ?1 WHERE id = ?2",
        params![serde_json::to_string(worker)?, worker.id],
    )?;
    tx.emit(Kind::Workers, kind, worker.id, worker)
}

/// `POST /v2/worker-heartbeat` (and GPUStack's `/v2/worker-status`): the worker is alive.
pub(super) async fn heartbeat(
    State(state): State<AppState>,
    principal: Principal,
) -> ApiResult<Response> {
    let Principal::Worker { worker_id, .. } = principal else {
        return Err(ApiError::forbidden(
            "heartbeats need the worker's own token",
        ));
    };
    state
        .store
        .write(move |tx| -> ApiResult<()> {
            let mut worker: Worker = store::get(tx.conn(), Kind::Workers, worker_id)?
                .ok_or_else(|| ApiError::not_found(format!("worker {worker_id} not found")))?;
            worker.heartbeat_time = Some(Timestamp::now());
            if worker.state == WorkerState::Ready {
                // Only the time changed: persist it without an event, so that thousands of
                // heartbeats do not flood every watcher.
                tx.conn()
                    .execute(
                        "UPDATE workers SET data = ?1 WHERE id = ?2",
                        params![
                            serde_json::to_string(&worker).map_err(StoreError::from)?,
                            worker_id
                        ],
                    )
                    .map_err(StoreError::from)?;
            } else {
                worker.state = WorkerState::Ready;
                worker.state_message = None;
                worker.updated_at = Some(Timestamp::now());
                save(tx, &worker, EventType::Updated)?;
            }
            Ok(())
        })
        .await?;
    Ok(http::StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn list(
    State(state): State<AppState>,
    principal: Principal,
    Query(query): Query,
) -> ApiResult<Response> {
    // A worker sees itself only.
    let own = principal.worker_or_reader()?;
    let watchable = match own {
        Some(_) => Err(ApiError::forbidden("workers cannot watch the worker list")),
        None => Ok(()),
    };
    let cluster = query.cluster_id;
    list_or_watch(
        &state,
        Kind::Workers,
        &query,
        watchable,
        move |w: &Worker| {
            own.is_none_or(|id| w.id == id) && cluster.is_none_or(|c| w.cluster_id == c)
        },
    )
    .await
}

pub(super) async fn get_one(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<axum::Json<Worker>> {
    match principal {
        Principal::Worker { worker_id, .. } if worker_id == id => {}
        ref p => p.require_reader()?,
    }
    get_or_404::<Worker>(&state, Kind::Workers, id, "worker")
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
        .write(move |tx| -> ApiResult<()> {
            let worker: Worker = store::get(tx.conn(), Kind::Workers, id)?
                .ok_or_else(|| ApiError::not_found(format!("worker {id} not found")))?;
            // Its instances go with it: nothing can reach them any more.
            let instances: Vec<ModelInstance> =
                store::list(tx.conn(), Kind::ModelInstances, Some(("worker_id", id)))?;
            for inst in instances {
                tx.conn()
                    .execute(
                        "DELETE FROM model_instances WHERE id = ?1",
                        params![inst.id],
                    )
                    .map_err(StoreError::from)?;
                tx.emit(Kind::ModelInstances, EventType::Deleted, inst.id, &inst)?;
            }
            tx.conn()
                .execute("DELETE FROM workers WHERE id = ?1", params![id])
                .map_err(StoreError::from)?;
            tx.emit(Kind::Workers, EventType::Deleted, id, &worker)?;
            Ok(())
        })
        .await?;
    Ok(http::StatusCode::NO_CONTENT.into_response())
}

/// Sets or clears a worker's `proxy_address` (the tunnel server calls this while a tunnel is up).
pub async fn set_proxy_address(
    store: &Store,
    worker_id: i64,
    proxy_address: Option<String>,
) -> Result<bool, StoreError> {
    store
        .write(move |tx| -> Result<bool, StoreError> {
            let Some(mut worker) = store::get::<Worker>(tx.conn(), Kind::Workers, worker_id)?
            else {
                return Ok(false);
            };
            if worker.proxy_address != proxy_address {
                worker.proxy_address = proxy_address;
                worker.updated_at = Some(Timestamp::now());
                save(tx, &worker, EventType::Updated)?;
            }
            Ok(true)
        })
        .await
}

/// Clears every worker's `proxy_address` (at server start: no tunnel is up yet).
pub async fn clear_proxy_addresses(store: &Store) -> Result<(), StoreError> {
    store
        .write(|tx| -> Result<(), StoreError> {
            let workers: Vec<Worker> = store::list(tx.conn(), Kind::Workers, None)?;
            for mut w in workers.into_iter().filter(|w| w.proxy_address.is_some()) {
                w.proxy_address = None;
                w.updated_at = Some(Timestamp::now());
                save(tx, &w, EventType::Updated)?;
            }
            Ok(())
        })
        .await
}

/// Marks `ready` workers whose last heartbeat is older than `timeout` as `not_ready`, checking a
/// few times per timeout period until `shutdown` fires.
pub fn spawn_heartbeat_monitor(
    store: Store,
    timeout: Duration,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let period = (timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    // Ends at `shutdown`; the caller keeps the handle.
    net::task::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(e) = expire_silent_workers(&store, timeout).await {
                tracing::warn!(error = %e, "heartbeat monitor failed");
            }
        }
    })
}

async fn expire_silent_workers(store: &Store, timeout: Duration) -> Result<(), StoreError> {
    let timeout = chrono::Duration::from_std(timeout).unwrap_or(chrono::Duration::MAX);
    store
        .write(move |tx| -> Result<(), StoreError> {
            let now = Utc::now();
            let workers: Vec<Worker> = store::list(tx.conn(), Kind::Workers, None)?;
            for mut w in workers {
                let last = w.heartbeat_time.map(|t| t.0);
                let silent = last.is_none_or(|t| now.signed_duration_since(t) > timeout);
                if w.state == WorkerState::Ready && silent {
                    let when = last.map_or("never".to_owned(), |t| t.to_rfc3339());
                    w.state = WorkerState::NotReady;
                    w.state_message = Some(format!("Heartbeat lost (last heartbeat: {when})"));
                    w.updated_at = Some(Timestamp::now());
                    tracing::info!(worker_id = w.id, worker = %w.name, "worker heartbeat lost");
                    save(tx, &w, EventType::Updated)?;
                }
            }
            Ok(())
        })
        .await
}
