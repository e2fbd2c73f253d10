//! `/v2/clusters`: create, list, get, replace (PUT), delete, chart values, registration token.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Value, json};

use super::auth::Principal;
use super::extract::{IdPath, JsonBody, Query};
use super::{
    ApiError, ApiResult, AppState, check_name, get_or_404, list_or_watch, problems_to_error,
};
use crate::args;
use crate::helm;
use crate::store::{self, Kind, StoreError};
use crate::worker_config;
use control_client::model::{Cluster, EventType, K8sOptions, Provider, Timestamp};
use control_client::tokens;

/// Body of `POST` and `PUT`: PUT replaces the whole cluster, so omitted fields return to their
/// defaults. Read-only fields a client echoes back from a GET are accepted and ignored.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ClusterInput {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    provider: Option<Provider>,
    /// YAML text, or the same options as a JSON object.
    #[serde(default)]
    worker_config: Option<Value>,
    #[serde(default)]
    default_container_registry: Option<String>,
    #[serde(rename = "k8sOptions", alias = "k8s_options", default)]
    k8s_options: Option<K8sOptions>,
    // Read-only, ignored.
    #[serde(default, rename = "id")]
    _id: Option<IgnoredAny>,
    #[serde(default, rename = "state")]
    _state: Option<IgnoredAny>,
    #[serde(default, rename = "registration_token")]
    _registration_token: Option<IgnoredAny>,
    #[serde(default, rename = "created_at")]
    _created_at: Option<IgnoredAny>,
    #[serde(default, rename = "updated_at")]
    _updated_at: Option<IgnoredAny>,
}

/// A validated cluster body, before it gets an id and a token.
struct ValidCluster {
    name: String,
    description: Option<String>,
    provider: Provider,
    worker_config: Option<Value>,
    default_container_registry: Option<String>,
    k8s_options: Option<K8sOptions>,
}

fn validate(input: ClusterInput) -> ApiResult<ValidCluster> {
    let ClusterInput {
        name,
        description,
        provider,
        worker_config,
        k8s_options,
        ..
    } = input;
    let registry = input
        .default_container_registry
        .filter(|r| !r.trim().is_empty());
    let provider = provider.unwrap_or(Provider::Docker);
    let mut problems = Vec::new();
    let mut details: Vec<(&str, Value)> = Vec::new();
    check_name("name", &name, &mut problems);

    let worker_config = match worker_config {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => match worker_config::parse_yaml(&text) {
            Ok(config) => Some(config),
            Err(e) => {
                problems.push(format!("worker_config: {e}"));
                details.push(("worker_config_errors", json!(e.issues)));
                None
            }
        },
        Some(value @ Value::Object(_)) => match worker_config::from_json(&value) {
            Ok(config) => Some(config),
            Err(e) => {
                problems.push(format!("worker_config: {e}"));
                details.push(("worker_config_errors", json!(e.issues)));
                None
            }
        },
        Some(_) => {
            problems.push("worker_config must be YAML text or an object".to_owned());
            None
        }
    };

    if provider == Provider::Shuihua {
        match registry.as_deref() {
            None => problems
                .push("default_container_registry is required for a shuihua cluster".to_owned()),
            Some(r) if resolves_to_docker_hub(r) => problems.push(format!(
                "default_container_registry {r:?} resolves to Docker Hub, which shuihua \
                 clusters cannot reach; use a registry host of your own"
            )),
            Some(_) => {}
        }
    }

    if let Some(overlay) = k8s_options.as_ref().and_then(|k| k.helm_values.as_ref()) {
        if !overlay.is_object() {
            problems.push("k8sOptions.helmValues must be an object".to_owned());
        } else {
            let rejected = helm::rejected_paths(overlay);
            if !rejected.is_empty() {
                problems.push(format!(
                    "k8sOptions.helmValues sets values the server derives: {}",
                    rejected.join(", ")
                ));
                details.push(("rejected_paths", json!(rejected)));
            }
        }
    }

    if let Err(mut found) =
        crate::join::values::KubernetesOptions::from_cluster(k8s_options.as_ref())
    {
        problems.append(&mut found);
    }

    if let Err(mut e) = problems_to_error(problems) {
        for (k, v) in details {
            e = e.with(k, v);
        }
        return Err(e);
    }
    Ok(ValidCluster {
        name,
        description,
        provider,
        worker_config: worker_config.map(|c| c.to_json()),
        default_container_registry: registry,
        k8s_options,
    })
}

/// Whether an image registry reference means Docker Hub: one of its names, or no registry host
/// at all (`myorg` or `myorg/images` is pulled from Docker Hub).
pub(crate) fn resolves_to_docker_hub(registry: &str) -> bool {
    let r = registry.trim().to_ascii_lowercase();
    let r = r
        .strip_prefix("https://")
        .or_else(|| r.strip_prefix("http://"))
        .unwrap_or(&r);
    let first = r.split('/').next().unwrap_or("");
    // Docker's rule: the first component is a host when it has a dot or a port, or is localhost.
    let is_host = first.contains('.') || first.contains(':') || first == "localhost";
    if !is_host {
        return true;
    }
    let host = first.split(':').next().unwrap_or(first);
    matches!(
        host,
        "docker.io" | "index.docker.io" | "registry-1.docker.io"
    )
}

fn to_cluster(id: i64, token: String, v: ValidCluster, created: Option<Timestamp>) -> Cluster {
    let now = Timestamp::now();
    Cluster {
        id,
        name: v.name,
        description: v.description,
        provider: v.provider,
        state: "ready".to_owned(),
        registration_token: Some(token),
        worker_config: v.worker_config,
        default_container_registry: v.default_container_registry,
        k8s_options: v.k8s_options,
        created_at: Some(created.unwrap_or(now)),
        updated_at: Some(now),
    }
}

fn name_taken(name: &str) -> ApiError {
    ApiError::conflict(format!("a cluster named {name:?} already exists"))
}

pub(super) async fn create(
    State(state): State<AppState>,
    principal: Principal,
    JsonBody(input): JsonBody<ClusterInput>,
) -> ApiResult<Response> {
    principal.require_admin()?;
    let valid = validate(input)?;
    let name = valid.name.clone();
    let key = tokens::generate(tokens::REGISTRATION_TOKEN_PREFIX);
    let cluster = state
        .store
        .write(async move |tx| -> Result<Cluster, StoreError> {
            let id = tx.sql().insert(
                "INSERT INTO clusters (name, reg_access_id, data) VALUES ($1, $2, '{}') RETURNING id",
                args![valid.name, key.access_id],
            ).await?;
            let cluster = to_cluster(id, key.value, valid, None);
            save(tx, &cluster, EventType::Created).await?;
            Ok(cluster)
        })
        .await
        .map_err(|e| {
            if e.is_unique_violation() {
                name_taken(&name)
            } else {
                e.into()
            }
        })?;
    Ok(axum::Json(cluster).into_response())
}

async fn save(tx: &mut store::Tx, cluster: &Cluster, kind: EventType) -> Result<(), StoreError> {
    tx.sql()
        .execute(
            "UPDATE clusters SET name = $1, data = $2 WHERE id = $3",
            args![cluster.name, serde_json::to_string(cluster)?, cluster.id],
        )
        .await?;
    tx.emit(Kind::Clusters, kind, cluster.id, cluster).await
}

pub(super) async fn list(
    State(state): State<AppState>,
    principal: Principal,
    Query(query): Query,
) -> ApiResult<Response> {
    principal.require_admin()?;
    list_or_watch::<Cluster>(&state, Kind::Clusters, &query, false, |_| true).await
}

async fn load(state: &AppState, id: i64) -> ApiResult<Cluster> {
    get_or_404(state, Kind::Clusters, id, "cluster").await
}

fn not_found(id: i64) -> ApiError {
    ApiError::not_found(format!("cluster {id} not found"))
}

pub(super) async fn get_one(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<axum::Json<Cluster>> {
    principal.require_admin()?;
    load(&state, id).await.map(axum::Json)
}

pub(super) async fn replace(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
    JsonBody(input): JsonBody<ClusterInput>,
) -> ApiResult<axum::Json<Cluster>> {
    principal.require_admin()?;
    let valid = validate(input)?;
    let name = valid.name.clone();
    let cluster = state
        .store
        .write(async move |tx| -> ApiResult<Cluster> {
            let old: Cluster = store::get(tx.sql(), Kind::Clusters, id)
                .await?
                .ok_or_else(|| not_found(id))?;
            let token = old.registration_token.unwrap_or_default();
            let cluster = to_cluster(id, token, valid, old.created_at);
            save(tx, &cluster, EventType::Updated).await.map_err(|e| {
                if e.is_unique_violation() {
                    name_taken(&name)
                } else {
                    e.into()
                }
            })?;
            Ok(cluster)
        })
        .await?;
    Ok(axum::Json(cluster))
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
            let cluster: Cluster = store::get(tx.sql(), Kind::Clusters, id)
                .await?
                .ok_or_else(|| not_found(id))?;
            let models = store::count(tx.sql(), "models", "cluster_id", id).await?;
            let workers = store::count(tx.sql(), "workers", "cluster_id", id).await?;
            if models > 0 || workers > 0 {
                return Err(ApiError::conflict(format!(
                    "cluster {}(id: {id}) still has {models} model(s) and {workers} worker(s); \
                     delete them first",
                    cluster.name
                ))
                .with("models", models)
                .with("workers", workers));
            }
            tx.sql()
                .execute("DELETE FROM clusters WHERE id = $1", args![id])
                .await?;
            tx.emit(Kind::Clusters, EventType::Deleted, id, &cluster)
                .await?;
            Ok(())
        })
        .await?;
    Ok(http::StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn helm_values(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<axum::Json<Value>> {
    principal.require_admin()?;
    let cluster = load(&state, id).await?;
    let image = super::join::image(&state)?;
    crate::join::values::chart_values(&cluster, &state.config.server_url, &image)
        .map(axum::Json)
        // Stored options were validated on write; this only happens if the rules tightened.
        .map_err(super::join::join_error)
}

pub(super) async fn registration_token(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<axum::Json<Value>> {
    principal.require_admin()?;
    let cluster = load(&state, id).await?;
    Ok(axum::Json(json!({
        "token": cluster.registration_token,
        "server_url": state.config.server_url,
        "cluster_id": cluster.id,
    })))
}

/// `GET /v2/clusters/{id}/proxy-credential`: what the cluster's worker proxies accept from a
/// gateway (`tokens::worker_proxy_credential`), for data-plane keys and administrators. It
/// opens worker proxies only: it cannot register a worker or read anything.
pub(super) async fn proxy_credential(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<axum::Json<Value>> {
    principal.require_reader()?;
    let cluster = load(&state, id).await?;
    let token = cluster.registration_token.unwrap_or_default();
    Ok(axum::Json(json!({
        "token": tokens::worker_proxy_credential(&token),
        "cluster_id": cluster.id,
    })))
}

#[cfg(test)]
mod tests {
    use super::resolves_to_docker_hub;

    #[test]
    fn docker_hub_detection() {
        for hub in [
            "docker.io",
            "index.docker.io",
            "registry-1.docker.io",
            "DOCKER.IO/library",
            "myorg",
            "myorg/images",
            "https://docker.io",
            "docker.io:443/x",
            "",
        ] {
            assert!(resolves_to_docker_hub(hub), "{hub}");
        }
        for own in [
            "registry.example.com",
            "localhost:5000/x",
            "10.0.0.1:5000",
            "quay.io/org",
        ] {
            assert!(!resolves_to_docker_hub(own), "{own}");
        }
    }
}
