//! `/v2/models` and `/v2/model-instances`.
//!
//! Administrators manage both. A worker, with its own token, may create and update instances on
//! itself only (it reports what it runs); data-plane keys read.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::IgnoredAny;

use super::auth::Principal;
use super::extract::{IdPath, Query};
use super::gpustack::{self, GpuStackBody, GpuStackFields, Stored};
use super::{
    ApiError, ApiResult, AppState, check_name, get_or_404, list_or_watch, problems_to_error,
};
use crate::args;
use crate::store::{self, Kind, StoreError, Tx};
use control_client::model::{EventType, InstanceState, Model, ModelInstance, Timestamp, Worker};

/// Body of model `POST`/`PUT` (PUT replaces).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ModelInput {
    name: String,
    #[serde(default)]
    cluster_id: Option<i64>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    replicas: Option<u32>,
    /// How gateways route its requests (`cache_aware` or `least_loaded`); unset: each
    /// gateway's `--route-policy`.
    #[serde(default)]
    route_policy: Option<control_client::model::RoutePolicy>,
    #[serde(default, rename = "id")]
    _id: Option<IgnoredAny>,
    #[serde(default, rename = "ready_replicas")]
    _ready_replicas: Option<IgnoredAny>,
    #[serde(default, rename = "created_at")]
    _created_at: Option<IgnoredAny>,
    #[serde(default, rename = "updated_at")]
    _updated_at: Option<IgnoredAny>,
}

impl GpuStackFields for ModelInput {
    const GPUSTACK: &'static [&'static str] = gpustack::MODEL;
}

fn model_not_found(id: i64) -> ApiError {
    ApiError::not_found(format!("model {id} not found"))
}

fn model_name_taken(name: &str) -> ApiError {
    ApiError::conflict(format!("a model named {name:?} already exists"))
}

async fn write_model(
    tx: &mut Tx,
    id: Option<i64>,
    GpuStackBody {
        body: input,
        gpustack,
    }: GpuStackBody<ModelInput>,
) -> ApiResult<Stored<Model>> {
    let mut problems = Vec::new();
    check_name("name", &input.name, &mut problems);
    problems_to_error(problems)?;
    if let Some(c) = input.cluster_id
        && store::get::<serde_json::Value>(tx.sql(), Kind::Clusters, c)
            .await?
            .is_none()
    {
        return Err(
            ApiError::invalid(format!("cluster_id {c}: no such cluster"))
                .with("field", "cluster_id"),
        );
    }
    let now = Timestamp::now();
    let (id, created, event) = match id {
        Some(id) => {
            let old: Model = store::get(tx.sql(), Kind::Models, id)
                .await?
                .ok_or_else(|| model_not_found(id))?;
            (id, old.created_at, EventType::Updated)
        }
        None => {
            let id = tx
                .sql()
                .insert(
                    "INSERT INTO models (name, cluster_id, data) VALUES ($1, $2, '{}') RETURNING id",
                    args![input.name, input.cluster_id],
                ).await
                .map_err(|e| unique_or(e, &input.name))?;
            (id, None, EventType::Created)
        }
    };
    let model = Model {
        id,
        name: input.name,
        cluster_id: input.cluster_id,
        description: input.description,
        replicas: input.replicas,
        ready_replicas: None,
        route_policy: input.route_policy,
        created_at: Some(created.unwrap_or(now)),
        updated_at: Some(now),
    };
    let model = Stored {
        object: model,
        gpustack,
    };
    tx.sql()
        .execute(
            "UPDATE models SET name = $1, cluster_id = $2, data = $3 WHERE id = $4",
            args![
                model.object.name,
                model.object.cluster_id,
                serde_json::to_string(&model).map_err(StoreError::from)?,
                id
            ],
        )
        .await
        .map_err(|e| unique_or(e, &model.object.name))?;
    tx.emit(Kind::Models, event, id, &model).await?;
    Ok(model)
}

fn unique_or(e: StoreError, name: &str) -> ApiError {
    if e.is_unique_violation() {
        model_name_taken(name)
    } else {
        e.into()
    }
}

pub(super) async fn create_model(
    State(state): State<AppState>,
    principal: Principal,
    input: GpuStackBody<ModelInput>,
) -> ApiResult<axum::Json<Stored<Model>>> {
    principal.require_admin()?;
    let model = state
        .store
        .write(async move |tx| write_model(tx, None, input).await)
        .await?;
    Ok(axum::Json(model))
}

pub(super) async fn replace_model(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
    input: GpuStackBody<ModelInput>,
) -> ApiResult<axum::Json<Stored<Model>>> {
    principal.require_admin()?;
    let model = state
        .store
        .write(async move |tx| write_model(tx, Some(id), input).await)
        .await?;
    Ok(axum::Json(model))
}

pub(super) async fn list_models(
    State(state): State<AppState>,
    principal: Principal,
    Query(query): Query,
) -> ApiResult<Response> {
    // Workers read (and watch) models too: they serve instances of them.
    principal.worker_or_reader()?;
    let (id, cluster) = (query.id, query.cluster_id);
    list_or_watch(
        &state,
        Kind::Models,
        &query,
        false,
        move |m: &Stored<Model>| {
            let m = &m.object;
            id.is_none_or(|id| m.id == id) && cluster.is_none_or(|c| m.cluster_id == Some(c))
        },
    )
    .await
}

pub(super) async fn get_model(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<axum::Json<Stored<Model>>> {
    if !matches!(principal, Principal::Worker { .. }) {
        principal.require_reader()?;
    }
    get_or_404::<Stored<Model>>(&state, Kind::Models, id, "model")
        .await
        .map(axum::Json)
}

pub(super) async fn delete_model(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<Response> {
    principal.require_admin()?;
    state
        .store
        .write(async move |tx| -> ApiResult<()> {
            let model: Model = store::get(tx.sql(), Kind::Models, id)
                .await?
                .ok_or_else(|| model_not_found(id))?;
            let instances: Vec<ModelInstance> =
                store::list(tx.sql(), Kind::ModelInstances, Some(("model_id", id))).await?;
            for inst in instances {
                delete_instance_row(tx, &inst).await?;
            }
            tx.sql()
                .execute("DELETE FROM models WHERE id = $1", args![id])
                .await?;
            tx.emit(Kind::Models, EventType::Deleted, id, &model)
                .await?;
            Ok(())
        })
        .await?;
    Ok(http::StatusCode::NO_CONTENT.into_response())
}

/// Body of instance `POST`/`PUT` (PUT replaces).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct InstanceInput {
    /// The model; a worker may name it by `model_name` instead.
    #[serde(default)]
    model_id: Option<i64>,
    #[serde(default)]
    model_name: Option<String>,
    #[serde(default)]
    worker_id: Option<i64>,
    #[serde(default)]
    port: Option<u16>,
    #[serde(default)]
    state: Option<InstanceState>,
    #[serde(default)]
    state_message: Option<String>,
    #[serde(default)]
    name: Option<String>,
    // Derived or read-only, ignored.
    #[serde(default, rename = "id")]
    _id: Option<IgnoredAny>,
    #[serde(default, rename = "cluster_id")]
    _cluster_id: Option<IgnoredAny>,
    #[serde(default, rename = "created_at")]
    _created_at: Option<IgnoredAny>,
    #[serde(default, rename = "updated_at")]
    _updated_at: Option<IgnoredAny>,
}

impl GpuStackFields for InstanceInput {
    const GPUSTACK: &'static [&'static str] = gpustack::INSTANCE;
}

fn instance_not_found(id: i64) -> ApiError {
    ApiError::not_found(format!("model instance {id} not found"))
}

/// Which worker's instances the caller may write: `None` for administrators.
fn instance_writer(principal: &Principal) -> ApiResult<Option<i64>> {
    match principal {
        Principal::Worker { worker_id, .. } => Ok(Some(*worker_id)),
        p => p.require_admin().map(|()| None),
    }
}

async fn write_instance(
    tx: &mut Tx,
    id: Option<i64>,
    own: Option<i64>,
    GpuStackBody {
        body: input,
        gpustack,
    }: GpuStackBody<InstanceInput>,
) -> ApiResult<Stored<ModelInstance>> {
    let old: Option<ModelInstance> = match id {
        Some(id) => Some(
            store::get(tx.sql(), Kind::ModelInstances, id)
                .await?
                .ok_or_else(|| instance_not_found(id))?,
        ),
        None => None,
    };
    // A worker writes its own instances only, and cannot move one to another worker.
    let worker_id = input.worker_id.or(own);
    if let Some(me) = own {
        let owned_before = old.as_ref().is_none_or(|o| o.worker_id == Some(me));
        if !owned_before || worker_id != Some(me) {
            return Err(ApiError::forbidden(
                "a worker may only write its own model instances",
            ));
        }
    }
    let state = input.state.unwrap_or(InstanceState::Pending);
    let mut problems = Vec::new();
    if state == InstanceState::Other {
        problems.push(
            "state must be one of pending, analyzing, scheduled, initializing, downloading, \
             starting, running, draining, error, unreachable"
                .to_owned(),
        );
    }
    if input.port == Some(0) {
        problems.push("port must be between 1 and 65535".to_owned());
    }
    if state == InstanceState::Running && (input.port.is_none() || worker_id.is_none()) {
        problems.push("a running instance needs a worker_id and a port".to_owned());
    }
    problems_to_error(problems)?;
    let model = instance_model(tx, &input, own.is_some()).await?;
    let worker: Option<Worker> = match worker_id {
        Some(w) => Some(
            store::get(tx.sql(), Kind::Workers, w)
                .await?
                .ok_or_else(|| {
                    ApiError::invalid(format!("worker_id {w}: no such worker"))
                        .with("field", "worker_id")
                })?,
        ),
        None => None,
    };
    let (id, event) = match id {
        Some(id) => (id, EventType::Updated),
        None => {
            let id = tx
                .sql()
                .insert(
                    "INSERT INTO model_instances (model_id, worker_id, data) \
                 VALUES ($1, $2, '{}') RETURNING id",
                    args![model.id(), worker_id],
                )
                .await?;
            (id, EventType::Created)
        }
    };
    let now = Timestamp::now();
    let (model_id, model_name, model_cluster) = match model {
        InstanceModel::Known(m) => (m.id, m.name, m.cluster_id),
        InstanceModel::Orphan(name) => (ORPHAN_MODEL_ID, name, None),
    };
    let state_message = match model_id {
        ORPHAN_MODEL_ID => Some(ORPHAN_MESSAGE.to_owned()),
        _ => input.state_message,
    };
    let inst = ModelInstance {
        id,
        name: input
            .name
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| format!("{model_name}-{id}")),
        model_id,
        model_name: Some(model_name),
        worker_id,
        port: input.port,
        state,
        state_message,
        cluster_id: model_cluster.or(worker.map(|w| w.cluster_id)),
        created_at: Some(old.and_then(|o| o.created_at).unwrap_or(now)),
        updated_at: Some(now),
    };
    let inst = Stored {
        object: inst,
        gpustack,
    };
    tx.sql()
        .execute(
            "UPDATE model_instances SET model_id = $1, worker_id = $2, data = $3 WHERE id = $4",
            args![
                Some(inst.object.model_id).filter(|&m| m != ORPHAN_MODEL_ID),
                inst.object.worker_id,
                serde_json::to_string(&inst).map_err(StoreError::from)?,
                id
            ],
        )
        .await?;
    tx.emit(Kind::ModelInstances, event, id, &inst).await?;
    Ok(inst)
}

/// The `model_id` of an orphan on the wire (its row has none): its model was deleted while its
/// worker was away, and the worker still serves it under its model's name.
pub(super) const ORPHAN_MODEL_ID: i64 = 0;

/// The state message of an orphan.
pub(super) const ORPHAN_MESSAGE: &str = "orphaned: its model no longer exists; it is served \
     under its model's name until it is adopted (POST /v2/model-instances/{id}/adopt) or deleted";

/// What an instance belongs to.
pub(super) enum InstanceModel {
    Known(Model),
    /// No model of this name: an orphan (only a worker reports one).
    Orphan(String),
}

impl InstanceModel {
    fn id(&self) -> Option<i64> {
        match self {
            InstanceModel::Known(m) => Some(m.id),
            InstanceModel::Orphan(_) => None,
        }
    }
}

/// The model an instance names, by id, or by name (what a worker reports); a worker that
/// names a model that does not exist reports an orphan.
async fn instance_model(
    tx: &mut Tx,
    input: &InstanceInput,
    by_worker: bool,
) -> ApiResult<InstanceModel> {
    if let Some(id) = input.model_id.filter(|&id| id != ORPHAN_MODEL_ID) {
        let model: Model = store::get(tx.sql(), Kind::Models, id)
            .await?
            .ok_or_else(|| {
                ApiError::invalid(format!("model_id {id}: no such model")).with("field", "model_id")
            })?;
        return Ok(InstanceModel::Known(model));
    }
    let Some(name) = input.model_name.as_deref().filter(|n| !n.is_empty()) else {
        return Err(
            ApiError::invalid("model_id (or model_name) is required").with("field", "model_id")
        );
    };
    match model_by_name(tx, name).await? {
        Some(model) => Ok(InstanceModel::Known(model)),
        None if by_worker => Ok(InstanceModel::Orphan(name.to_owned())),
        None => Err(
            ApiError::invalid(format!("model_name {name:?}: no such model"))
                .with("field", "model_name"),
        ),
    }
}

/// The model named `name`, if any.
pub(super) async fn model_by_name(tx: &mut Tx, name: &str) -> Result<Option<Model>, StoreError> {
    tx.sql()
        .query_opt("SELECT data FROM models WHERE name = $1", args![name])
        .await?
        .map(|row| -> Result<Model, StoreError> {
            Ok(serde_json::from_str(&row.get::<String>(0)?)?)
        })
        .transpose()
}

async fn delete_instance_row(tx: &mut Tx, inst: &ModelInstance) -> Result<(), StoreError> {
    tx.sql()
        .execute("DELETE FROM model_instances WHERE id = $1", args![inst.id])
        .await?;
    tx.emit(Kind::ModelInstances, EventType::Deleted, inst.id, inst)
        .await
}

pub(super) async fn create_instance(
    State(state): State<AppState>,
    principal: Principal,
    input: GpuStackBody<InstanceInput>,
) -> ApiResult<axum::Json<Stored<ModelInstance>>> {
    let own = instance_writer(&principal)?;
    let inst = state
        .store
        .write(async move |tx| write_instance(tx, None, own, input).await)
        .await?;
    Ok(axum::Json(inst))
}

pub(super) async fn replace_instance(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
    input: GpuStackBody<InstanceInput>,
) -> ApiResult<axum::Json<Stored<ModelInstance>>> {
    let own = instance_writer(&principal)?;
    let inst = state
        .store
        .write(async move |tx| write_instance(tx, Some(id), own, input).await)
        .await?;
    Ok(axum::Json(inst))
}

pub(super) async fn delete_instance(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<Response> {
    let own = instance_writer(&principal)?;
    state
        .store
        .write(async move |tx| -> ApiResult<()> {
            let inst: ModelInstance = store::get(tx.sql(), Kind::ModelInstances, id)
                .await?
                .ok_or_else(|| instance_not_found(id))?;
            if own.is_some_and(|me| inst.worker_id != Some(me)) {
                return Err(ApiError::forbidden(
                    "a worker may only delete its own model instances",
                ));
            }
            delete_instance_row(tx, &inst).await?;
            Ok(())
        })
        .await?;
    Ok(http::StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn list_instances(
    State(state): State<AppState>,
    principal: Principal,
    Query(query): Query,
) -> ApiResult<Response> {
    // A worker sees its own instances; readers see all.
    let own = principal.worker_or_reader()?;
    let (id, model, worker) = (query.id, query.model_id, query.worker_id);
    let orphaned = query.orphaned;
    list_or_watch(
        &state,
        Kind::ModelInstances,
        &query,
        own.is_some(),
        move |i: &Stored<ModelInstance>| {
            let i = &i.object;
            own.is_none_or(|me| i.worker_id == Some(me))
                && id.is_none_or(|id| i.id == id)
                && model.is_none_or(|m| i.model_id == m)
                && worker.is_none_or(|w| i.worker_id == Some(w))
                && orphaned.is_none_or(|o| o == (i.model_id == ORPHAN_MODEL_ID))
        },
    )
    .await
}

pub(super) async fn get_instance(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<axum::Json<Stored<ModelInstance>>> {
    let own = match principal {
        Principal::Worker { worker_id, .. } => Some(worker_id),
        ref p => {
            p.require_reader()?;
            None
        }
    };
    let inst = state
        .store
        .read(async move |conn| {
            store::get::<Stored<ModelInstance>>(conn, Kind::ModelInstances, id).await
        })
        .await?
        .filter(|i| own.is_none_or(|me| i.object.worker_id == Some(me)))
        .ok_or_else(|| instance_not_found(id))?;
    Ok(axum::Json(inst))
}

/// Body of `POST /v2/model-instances/{id}/adopt` (optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AdoptInput {
    /// The model to bind the orphan to [default: the model of its name, created if none].
    #[serde(default)]
    model_id: Option<i64>,
}

/// `POST /v2/model-instances/{id}/adopt`: binds an orphan to a model: the one given, else the
/// one of its model's name, else a new model of that name. Routing does not change: it was
/// served under that name all along.
pub(super) async fn adopt_instance(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
    body: bytes::Bytes,
) -> ApiResult<axum::Json<Stored<ModelInstance>>> {
    principal.require_admin()?;
    let input: AdoptInput = if body.iter().all(u8::is_ascii_whitespace) {
        AdoptInput::default()
    } else {
        super::extract::parse_json(&body)?
    };
    let inst = state
        .store
        .write(async move |tx| -> ApiResult<Stored<ModelInstance>> {
            let mut inst: Stored<ModelInstance> = store::get(tx.sql(), Kind::ModelInstances, id)
                .await?
                .ok_or_else(|| instance_not_found(id))?;
            if inst.object.model_id != ORPHAN_MODEL_ID {
                return Err(ApiError::conflict(format!(
                    "model instance {id} is not orphaned (model {})",
                    inst.object.model_id
                )));
            }
            let name = inst.object.model_name.clone().unwrap_or_default();
            let model = match input.model_id {
                Some(mid) => store::get::<Model>(tx.sql(), Kind::Models, mid)
                    .await?
                    .ok_or_else(|| {
                        ApiError::invalid(format!("model_id {mid}: no such model"))
                            .with("field", "model_id")
                    })?,
                None => match model_by_name(tx, &name).await? {
                    Some(model) => model,
                    None => {
                        let input = ModelInput {
                            name,
                            cluster_id: None,
                            description: None,
                            replicas: None,
                            route_policy: None,
                            _id: None,
                            _ready_replicas: None,
                            _created_at: None,
                            _updated_at: None,
                        };
                        let body = GpuStackBody {
                            body: input,
                            gpustack: serde_json::Map::new(),
                        };
                        write_model(tx, None, body).await?.object
                    }
                },
            };
            let o = &mut inst.object;
            o.model_id = model.id;
            o.model_name = Some(model.name);
            o.cluster_id = model.cluster_id.or(o.cluster_id);
            o.state_message = None;
            o.updated_at = Some(Timestamp::now());
            tx.sql()
                .execute(
                    "UPDATE model_instances SET model_id = $1, data = $2 WHERE id = $3",
                    args![
                        model.id,
                        serde_json::to_string(&inst).map_err(StoreError::from)?,
                        id
                    ],
                )
                .await?;
            tx.emit(Kind::ModelInstances, EventType::Updated, id, &inst)
                .await?;
            Ok(inst)
        })
        .await?;
    Ok(axum::Json(inst))
}
