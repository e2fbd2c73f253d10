//! `GET /v2/clusters/{id}/join` (Docker) and `GET /v2/clusters/{id}/manifests` (Kubernetes):
//! what adds a worker to a cluster. The rendering is in [`crate::join`]; this reads the query,
//! loads the cluster and answers.

use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use http::header;

use super::auth::Principal;
use super::extract::IdPath;
use super::{ApiError, ApiResult, AppState, get_or_404};
use crate::helm::HelmError;
use crate::join::docker::{self, DockerJoin, DockerRequest, Mount};
use crate::join::vendors::{self, Vendor};
use crate::join::{self, ImageRef, JoinError};
use crate::store::Kind;
use control_client::model::{Cluster, Provider, ProxyMode};

/// The API's answer to a rendering error: the caller's choices are 400s, the cluster's stored
/// options 422s (as on the cluster's own PUT).
pub(super) fn join_error(e: JoinError) -> ApiError {
    match e {
        JoinError::BadParameter { parameter, .. } => {
            let known = (parameter == "vendor").then(vendors::known);
            let error = ApiError::bad_request(e.to_string()).with("field", parameter);
            match known {
                Some(known) => error.with("known_vendors", known),
                None => error,
            }
        }
        JoinError::WrongProvider { .. } | JoinError::NoWorker => {
            ApiError::bad_request(e.to_string())
        }
        JoinError::Helm(HelmError::Rejected { ref paths }) => {
            let paths = paths.clone();
            ApiError::invalid(e.to_string()).with("rejected_paths", paths)
        }
        JoinError::Helm(HelmError::NotAnObject { .. }) => ApiError::invalid(e.to_string()),
        JoinError::Invalid(problems) => {
            ApiError::invalid(problems.join("; ")).with("errors", problems)
        }
    }
}

/// The query as `(key, value)` pairs, in order; keys may repeat.
fn pairs(raw: Option<String>) -> ApiResult<Vec<(String, String)>> {
    serde_urlencoded::from_str(raw.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("invalid query string: {e}")))
}

fn unknown(key: &str, known: &[&str]) -> ApiError {
    ApiError::bad_request(format!(
        "invalid query string: unknown parameter {key:?}; expected {}",
        known.join(", ")
    ))
    .with("field", key.to_owned())
}

fn vendor(name: &str) -> Result<&'static Vendor, JoinError> {
    vendors::find(name.trim()).ok_or_else(|| {
        JoinError::bad(
            "vendor",
            format!(
                "unknown GPU vendor {name:?}; expected one of {}",
                vendors::known().join(", ")
            ),
        )
    })
}

fn docker_request(raw: Option<String>) -> ApiResult<DockerRequest> {
    const KNOWN: &[&str] = &[
        "vendor",
        "worker_ip",
        "advertise_address",
        "mounts",
        "proxy_mode",
        "name",
    ];
    let (mut chosen, mut worker_ip, mut advertise_address, mut proxy_mode, mut name) =
        (None, None, None, None, None);
    let mut mounts = Vec::new();
    for (key, value) in pairs(raw)? {
        let value = value.trim();
        let bad = |parameter, reason: String| join_error(JoinError::bad(parameter, reason));
        match key.as_str() {
            "vendor" => chosen = Some(vendor(value).map_err(join_error)?),
            "worker_ip" if !value.is_empty() => {
                worker_ip =
                    Some(value.parse().map_err(|_| {
                        bad("worker_ip", format!("{value:?} is not an IP address"))
                    })?);
            }
            "advertise_address" if !value.is_empty() => {
                advertise_address = Some(value.to_owned());
            }
            "mounts" => {
                for m in value.split(',').filter(|m| !m.trim().is_empty()) {
                    mounts.push(Mount::parse(m).map_err(join_error)?);
                }
            }
            "proxy_mode" if !value.is_empty() => {
                proxy_mode = Some(ProxyMode::parse(value).ok_or_else(|| {
                    bad(
                        "proxy_mode",
                        format!("{value:?}: expected direct, worker or tunnel"),
                    )
                })?);
            }
            "name" if !value.is_empty() => name = Some(value.to_owned()),
            "worker_ip" | "advertise_address" | "proxy_mode" | "name" => {}
            other => return Err(unknown(other, KNOWN)),
        }
    }
    let vendor = chosen.ok_or_else(|| {
        join_error(JoinError::bad(
            "vendor",
            format!(
                "choose a GPU vendor: one of {}",
                vendors::known().join(", ")
            ),
        ))
    })?;
    Ok(DockerRequest {
        vendor,
        worker_ip,
        advertise_address,
        mounts,
        proxy_mode,
        name,
    })
}

/// GPUStack's `runtime` (repeated) and faden's `vendors` (comma-separated, repeatable) name the
/// same set; none means CPU only.
fn manifest_vendors(raw: Option<String>) -> ApiResult<Vec<&'static Vendor>> {
    const KNOWN: &[&str] = &["vendors", "runtime"];
    let mut chosen = Vec::new();
    for (key, value) in pairs(raw)? {
        match key.as_str() {
            "vendors" | "runtime" => {
                for name in value.split(',').filter(|n| !n.trim().is_empty()) {
                    chosen.push(vendor(name).map_err(join_error)?);
                }
            }
            other => return Err(unknown(other, KNOWN)),
        }
    }
    Ok(chosen)
}

async fn cluster_for(
    state: &AppState,
    id: i64,
    provider: Provider,
    hint: &'static str,
) -> ApiResult<Cluster> {
    let cluster: Cluster = get_or_404(state, Kind::Clusters, id, "cluster").await?;
    if cluster.provider != provider {
        return Err(join_error(JoinError::WrongProvider {
            id,
            name: cluster.name.clone(),
            provider: cluster.provider.to_string(),
            hint,
        }));
    }
    Ok(cluster)
}

/// The server's worker image (checked when the server starts).
pub(super) fn image(state: &AppState) -> ApiResult<ImageRef> {
    ImageRef::parse(&state.config.worker_image).map_err(|e| {
        tracing::error!(error = %e, "the server's worker image");
        ApiError::new(
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "bad worker image setting",
        )
    })
}

pub(super) async fn docker(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
    RawQuery(raw): RawQuery,
) -> ApiResult<axum::Json<DockerJoin>> {
    let request = docker_request(raw)?;
    principal.require_admin()?;
    let cluster = cluster_for(
        &state,
        id,
        Provider::Docker,
        "docker join commands are for docker clusters; a kubernetes cluster's workers come from \
         GET /v2/clusters/{id}/manifests",
    )
    .await?;
    let image = image(&state)?;
    docker::render(&cluster, &state.config.server_url, &image, &request)
        .map(axum::Json)
        .map_err(join_error)
}

pub(super) async fn manifests(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let vendors = manifest_vendors(raw)?;
    principal.require_admin()?;
    let cluster = cluster_for(
        &state,
        id,
        Provider::Kubernetes,
        "manifests are for kubernetes clusters; a docker cluster's workers start with the \
         command of GET /v2/clusters/{id}/join",
    )
    .await?;
    let image = image(&state)?;
    let yaml = join::kubernetes::render(&cluster, &state.config.server_url, &image, &vendors)
        .map_err(join_error)?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-yaml"),
            (
                header::CONTENT_DISPOSITION,
                "attachment; filename=manifest.yaml",
            ),
        ],
        yaml,
    )
        .into_response())
}
