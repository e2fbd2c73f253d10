//! `/v2/workers/{id}/drain`: a worker leaves without failing a request.
//!
//! An administrator first gets the plan (per instance: it moves, because other workers run its
//! model, or it would stop, because none does), then confirms the plan's count of stops. The
//! worker is then in GPUStack's `maintenance` with faden's drain fields: gateways send its
//! instances new requests only for models nothing else serves (the routing snapshot), so an
//! instance without a replacement keeps serving until one runs. A worker that stops drains
//! itself the same way with its own token, without a plan (it is leaving anyway).

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::auth::Principal;
use super::extract::{IdPath, parse_json};
use super::gpustack::Stored;
use super::{ApiError, ApiResult, AppState};
use std::collections::HashSet;

use crate::store::{self, Kind, Sql, StoreError, Tx};
use control_client::model::{
    DRAIN_BY_ADMIN, DRAIN_BY_WORKER, EventType, Maintenance, Model, ModelInstance, Timestamp,
    Worker,
};
use control_client::routing::RoutingSnapshot;

/// How long an administrator's drain may take before it reports what did not move.
pub const DEFAULT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30 * 60);

/// How long after its drain began a worker that does not count its requests (direct mode: the
/// gateways reach its engines themselves) is taken as drained, once none of its instances is
/// routed.
const UNCOUNTED_GRACE: chrono::TimeDelta = chrono::TimeDelta::seconds(30);

/// Body of `POST /v2/workers/{id}/drain` (all optional; an empty body asks for the plan).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DrainRequest {
    /// The plan's count of instances that would stop: the consent to drain.
    #[serde(default)]
    confirm_stops: Option<usize>,
    /// Seconds until the drain reports what did not move [default: 1800].
    #[serde(default)]
    deadline_seconds: Option<u64>,
    /// Shown as the maintenance message.
    #[serde(default)]
    message: Option<String>,
    /// The worker's own report: requests or relayed connections in flight.
    #[serde(default)]
    in_flight: Option<u64>,
}

/// What happens to one instance of the drained worker.
#[derive(Debug, Serialize)]
pub(super) struct InstancePlan {
    id: i64,
    name: String,
    model_name: Option<String>,
    /// `moves` (other workers run the model) or `would_stop` (none does).
    action: &'static str,
    /// Whether gateways still send it new requests.
    routed: bool,
    reason: String,
}

/// The answer of every drain call.
#[derive(Debug, Serialize)]
pub(super) struct DrainStatus {
    worker_id: i64,
    worker: String,
    /// `ready` (not draining), `draining` or `drained`.
    state: &'static str,
    /// Whether this call changed the worker.
    applied: bool,
    /// Instances that would stop: what `confirm_stops` must say.
    stops: usize,
    instances: Vec<InstancePlan>,
    maintenance: Option<Box<Maintenance>>,
    /// Past the deadline: one line per instance that has not moved, and why.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    not_moved: Vec<String>,
}

/// The plan and state of `worker`'s drain, as the store holds it now. What is routed is what
/// the gateways' snapshot routes: the same build, from the same rows.
async fn status(sql: &mut Sql, worker: &Worker, applied: bool) -> Result<DrainStatus, StoreError> {
    let mut workers: Vec<Worker> = store::list(sql, Kind::Workers, None).await?;
    for w in &mut workers {
        if w.id == worker.id {
            w.clone_from(worker);
        }
    }
    let instances: Vec<ModelInstance> = store::list(sql, Kind::ModelInstances, None).await?;
    let models: Vec<Model> = store::list(sql, Kind::Models, None).await?;
    let snapshot = RoutingSnapshot::build(&workers, &instances, &models, &[], None);
    let draining_workers: HashSet<i64> = workers
        .iter()
        .filter(|w| w.is_draining())
        .map(|w| w.id)
        .collect();
    let draining = worker.is_draining();
    let mut plans = Vec::new();
    for inst in instances.iter().filter(|i| i.worker_id == Some(worker.id)) {
        let route = inst.model_name.as_deref().and_then(|n| snapshot.route(n));
        let endpoints = route.map_or(&[][..], |r| &r.endpoints[..]);
        let routed = endpoints.iter().any(|e| e.instance_id == inst.id);
        let mut hosts: Vec<&str> = endpoints
            .iter()
            .filter(|e| e.worker_id != worker.id && !draining_workers.contains(&e.worker_id))
            .map(|e| e.worker_name.as_str())
            .collect();
        hosts.sort_unstable();
        hosts.dedup();
        let (action, reason) = if hosts.is_empty() {
            let reason = if draining {
                "no other instance of the model runs: it keeps serving until one does"
            } else {
                "no other instance of the model"
            };
            ("would_stop", reason.to_owned())
        } else {
            (
                "moves",
                format!("the model has running instances on {}", hosts.join(", ")),
            )
        };
        plans.push(InstancePlan {
            id: inst.id,
            name: inst.name.clone(),
            model_name: inst.model_name.clone(),
            action,
            routed,
            reason,
        });
    }
    let stops = plans.iter().filter(|p| p.action == "would_stop").count();
    let maintenance = worker.maintenance.clone();
    let routed = plans.iter().any(|p| p.routed);
    // A worker that counts nothing (direct mode) is drained a grace after its
    // drain began, once nothing of it is routed: what was sent before has had time to end.
    let counted_out = maintenance.as_ref().is_some_and(|m| match m.in_flight {
        Some(n) => n == 0,
        None => m
            .since
            .is_some_and(|t| t.0 + UNCOUNTED_GRACE <= Timestamp::now().0),
    });
    let state = match (draining, routed, counted_out) {
        (false, _, _) => "ready",
        (true, false, true) => "drained",
        _ => "draining",
    };
    let late = maintenance
        .as_ref()
        .and_then(|m| m.deadline)
        .is_some_and(|d| d <= Timestamp::now());
    let not_moved = if late && state == "draining" {
        plans
            .iter()
            .filter(|p| p.routed)
            .map(|p| {
                format!(
                    "instance {} ({}) has not moved: the replacement did not start",
                    p.id, p.name
                )
            })
            .collect()
    } else {
        Vec::new()
    };
    Ok(DrainStatus {
        worker_id: worker.id,
        worker: worker.name.clone(),
        state,
        applied,
        stops,
        instances: plans,
        maintenance,
        not_moved,
    })
}

async fn load(tx: &mut Tx, id: i64) -> ApiResult<Stored<Worker>> {
    store::get(tx.sql(), Kind::Workers, id)
        .await?
        .ok_or_else(|| worker_not_found(id))
}

fn worker_not_found(id: i64) -> ApiError {
    ApiError::not_found(format!("worker {id} not found"))
}

async fn save(tx: &mut Tx, worker: &mut Stored<Worker>) -> ApiResult<()> {
    worker.object.updated_at = Some(Timestamp::now());
    tx.sql()
        .execute(
            "UPDATE workers SET data = $1 WHERE id = $2",
            crate::args![
                serde_json::to_string(&*worker).map_err(StoreError::from)?,
                worker.object.id
            ],
        )
        .await?;
    tx.emit(
        Kind::Workers,
        EventType::Updated,
        worker.object.id,
        &*worker,
    )
    .await?;
    Ok(())
}

/// Who may drain worker `id`: an administrator, or the worker itself.
fn caller(principal: &Principal, id: i64) -> ApiResult<&'static str> {
    match principal {
        Principal::Worker { worker_id, .. } if *worker_id == id => Ok(DRAIN_BY_WORKER),
        p => p.require_admin().map(|()| DRAIN_BY_ADMIN),
    }
}

/// `GET /v2/workers/{id}/drain`: the plan, or how the drain stands.
pub(super) async fn get(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<axum::Json<DrainStatus>> {
    match principal {
        Principal::Worker { worker_id, .. } if worker_id == id => {}
        ref p => p.require_reader()?,
    }
    let answer = state
        .store
        .read(async move |conn| {
            let Some(worker) = store::get::<Stored<Worker>>(conn, Kind::Workers, id).await? else {
                return Ok(None);
            };
            status(conn, &worker.object, false).await.map(Some)
        })
        .await?
        .ok_or_else(|| worker_not_found(id))?;
    Ok(axum::Json(answer))
}

/// `POST /v2/workers/{id}/drain`: an administrator gets the plan, and drains with the plan's
/// count of stops confirmed (`confirm_stops`; a count that does not match is a 409 with the
/// plan); the worker itself drains at once and reports its requests in flight.
pub(super) async fn start(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
    body: Bytes,
) -> ApiResult<Response> {
    let by = caller(&principal, id)?;
    let request: DrainRequest = if body.iter().all(u8::is_ascii_whitespace) {
        DrainRequest::default()
    } else {
        parse_json(&body)?
    };
    let deadline = request
        .deadline_seconds
        .map_or(DEFAULT_DEADLINE, std::time::Duration::from_secs);
    let deadline = chrono::Duration::from_std(deadline)
        .map_err(|_| ApiError::invalid("deadline_seconds is too large"))?;
    let answer = state
        .store
        .write(
            async move |tx| -> ApiResult<Result<DrainStatus, DrainStatus>> {
                let mut worker = load(tx, id).await?;
                let plan = status(tx.sql(), &worker.object, false).await?;
                let draining = worker.object.is_draining();
                if by == DRAIN_BY_ADMIN && !draining {
                    match request.confirm_stops {
                        None => return Ok(Ok(plan)),
                        Some(n) if n != plan.stops => return Ok(Err(plan)),
                        Some(_) => {}
                    }
                }
                let now = Timestamp::now();
                let m = worker.object.maintenance.get_or_insert_with(Box::default);
                let taken_over =
                    by == DRAIN_BY_ADMIN && m.requested_by.as_deref() != Some(DRAIN_BY_ADMIN);
                if !m.enabled {
                    m.enabled = true;
                    m.requested_by = Some(by.to_owned());
                    m.since = Some(now);
                    m.deadline = Some(Timestamp(now.0 + deadline));
                    m.message = Some(request.message.clone().unwrap_or_else(|| match by {
                        DRAIN_BY_WORKER => "draining: the worker is stopping".to_owned(),
                        _ => "draining".to_owned(),
                    }));
                } else if by == DRAIN_BY_ADMIN {
                    // An administrator takes over a worker's own drain: it outlives a restart.
                    m.requested_by = Some(DRAIN_BY_ADMIN.to_owned());
                }
                let mut reported = false;
                if by == DRAIN_BY_WORKER && request.in_flight.is_some() {
                    reported = m.in_flight != request.in_flight;
                    m.in_flight = request.in_flight;
                }
                // A report that changes nothing is no event (a draining worker reports every beat).
                let changed = !draining || taken_over || reported;
                if changed {
                    save(tx, &mut worker).await?;
                }
                Ok(Ok(status(tx.sql(), &worker.object, changed).await?))
            },
        )
        .await?;
    Ok(match answer {
        Ok(status) => axum::Json(status).into_response(),
        Err(plan) => (http::StatusCode::CONFLICT, axum::Json(plan)).into_response(),
    })
}

/// `DELETE /v2/workers/{id}/drain`: ends the drain; the worker takes new requests again. A
/// worker may end only the drain it started itself (when it starts again).
pub(super) async fn end(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<Response> {
    let by = caller(&principal, id)?;
    let answer = state
        .store
        .write(async move |tx| -> ApiResult<DrainStatus> {
            let mut worker = load(tx, id).await?;
            let m = worker.object.maintenance.as_ref();
            let ends = m.is_some_and(|m| m.enabled)
                && (by == DRAIN_BY_ADMIN || m.and_then(|m| m.requested_by.as_deref()) == Some(by));
            if ends {
                worker.object.maintenance = None;
                save(tx, &mut worker).await?;
            }
            Ok(status(tx.sql(), &worker.object, ends).await?)
        })
        .await?;
    Ok(axum::Json(answer).into_response())
}
