//! The management API: `/v2/...` resources, their watch streams and the credential feed.
//!
//! Handlers are thin: parse (strictly), authorise, validate, then one store transaction that
//! also records the watch events. Every client mistake is a 4xx in GPUStack's error shape.

pub mod auth;
mod clusters;
mod drain;
pub mod error;
pub mod extract;
mod gpustack;
mod join;
mod keys;
mod models;
mod unmanaged;
mod watch;
mod worker_load;
mod workers;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderValue, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

pub use self::error::{ApiError, ApiResult};
use self::extract::ListQuery;
pub use self::keys::ensure_key;
pub use self::worker_load::LoadHub;
pub use self::workers::{clear_proxy_addresses, set_proxy_address, spawn_heartbeat_monitor};
use crate::store::{self, Kind, Store};
use control_client::model::{ListResponse, Pagination, REVISION_HEADER};

/// Settings of the management API.
#[derive(Clone, Debug)]
pub struct ApiConfig {
    /// A worker without a heartbeat for this long becomes `not_ready`.
    pub heartbeat_timeout: Duration,
    /// Blank-line heartbeat interval of watch streams.
    pub watch_heartbeat: Duration,
    /// The URL workers use to reach this server (shown with registration tokens, used for chart
    /// values). Empty: derived from the bound address at start.
    pub server_url: String,
    /// The image workers run, `[registry/]repository:tag` (`--worker-image`); a cluster's
    /// default container registry replaces its registry.
    pub worker_image: String,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            heartbeat_timeout: Duration::from_secs(150),
            watch_heartbeat: Duration::from_secs(15),
            server_url: String::new(),
            worker_image: crate::join::DEFAULT_WORKER_IMAGE.to_owned(),
        }
    }
}

/// Shared state of the handlers.
#[derive(Clone, Debug)]
pub struct AppState {
    pub store: Store,
    pub config: Arc<ApiConfig>,
    /// Fires on shutdown: open watch streams end so that the server can drain.
    pub shutdown: CancellationToken,
    /// Failed authentications per source; blocked sources get 429 before any credential check.
    pub auth_limiter: Arc<net::admission::AuthLimiter>,
    /// The engines' load as the workers report it (`/v2/worker-load`).
    pub loads: Arc<LoadHub>,
}

/// Builds the management API router.
pub fn router(state: AppState) -> Router {
    let mut router = Router::new();
    for collection in unmanaged::COLLECTIONS {
        router = router
            .route(&format!("/v2/{collection}"), get(unmanaged::list))
            .route(&format!("/v2/{collection}/{{id}}"), get(unmanaged::get_one));
    }
    router
        .route("/v2/clusters", get(clusters::list).post(clusters::create))
        .route(
            "/v2/clusters/{id}",
            get(clusters::get_one)
                .put(clusters::replace)
                .delete(clusters::delete),
        )
        .route("/v2/clusters/{id}/helm-values", get(clusters::helm_values))
        .route(
            "/v2/clusters/{id}/registration-token",
            get(clusters::registration_token),
        )
        .route(
            "/v2/clusters/{id}/proxy-credential",
            get(clusters::proxy_credential),
        )
        .route("/v2/clusters/{id}/join", get(join::docker))
        .route("/v2/clusters/{id}/manifests", get(join::manifests))
        .route("/v2/workers", get(workers::list).post(workers::register))
        .route(
            "/v2/workers/{id}",
            get(workers::get_one).delete(workers::delete),
        )
        .route(
            "/v2/workers/{id}/drain",
            get(drain::get).post(drain::start).delete(drain::end),
        )
        .route("/v2/worker-heartbeat", post(workers::heartbeat))
        .route("/v2/worker-status", post(workers::status))
        .route(
            "/v2/worker-load",
            get(worker_load::read).post(worker_load::report),
        )
        .route(
            "/v2/models",
            get(models::list_models).post(models::create_model),
        )
        .route(
            "/v2/models/{id}",
            get(models::get_model)
                .put(models::replace_model)
                .delete(models::delete_model),
        )
        .route(
            "/v2/model-instances",
            get(models::list_instances).post(models::create_instance),
        )
        .route(
            "/v2/model-instances/{id}",
            get(models::get_instance)
                .put(models::replace_instance)
                .delete(models::delete_instance),
        )
        .route(
            "/v2/model-instances/{id}/adopt",
            post(models::adopt_instance),
        )
        .route("/v2/api-keys", get(keys::list).post(keys::create))
        .route("/v2/api-keys/{id}", get(keys::get_one).delete(keys::delete))
        .route("/v2/credentials", get(keys::credentials))
        .route("/v2/inference-backends/all", get(unmanaged::all_backends))
        .route("/healthz", get(|| async { "ok" }))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed on this endpoint",
            )
        })
        .with_state(state)
}

/// Loads the row `id` of `kind`; a 404 naming `what` when there is none.
async fn get_or_404<T>(state: &AppState, kind: Kind, id: i64, what: &'static str) -> ApiResult<T>
where
    T: DeserializeOwned + Send + 'static,
{
    state
        .store
        .read(async move |conn| store::get::<T>(conn, kind, id).await)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("{what} {id} not found")))
}

/// Answers a list endpoint: with `?watch=true` the watch stream of `kind`, else the rows of
/// `kind` that `keep` accepts, paginated, with the revision they reflect. A watch of a worker
/// (`own`) or with filters in the query sends only the events whose object `keep` accepts
/// (GPUStack's worker watches its own instances, by `id`); an unfiltered one sends every event
/// as stored, without reading it.
async fn list_or_watch<T>(
    state: &AppState,
    kind: Kind,
    query: &ListQuery,
    own: bool,
    keep: impl Fn(&T) -> bool + Send + Sync + 'static,
) -> ApiResult<Response>
where
    T: DeserializeOwned + Serialize + Send + 'static,
{
    if query.watch == Some(true) {
        let filter: Option<watch::Filter> = (own || query.filters()).then(|| {
            Box::new(move |event: &store::Event| {
                serde_json::from_str::<T>(&event.data).is_ok_and(|object| keep(&object))
            }) as watch::Filter
        });
        return watch::respond(state, kind, query.since, filter).await;
    }
    let (items, revision) = state
        .store
        .read_at_revision(async move |conn, rev| {
            let items: Vec<T> = store::list(conn, kind, None).await?;
            Ok((
                items.into_iter().filter(|i| keep(i)).collect::<Vec<_>>(),
                rev,
            ))
        })
        .await?;
    list_response(items, query, revision)
}

/// Paginates `items` as GPUStack does and adds the revision header. `page=-1` is everything
/// in one answer (what GPUStack's own clients send); `perPage=-1`, faden's older spelling of
/// the same, is kept (GPUStack 2.3 answers it with 500).
fn list_response<T: Serialize>(
    items: Vec<T>,
    query: &ListQuery,
    revision: u64,
) -> ApiResult<Response> {
    let page = query.page.unwrap_or(1);
    let per_page = query.per_page.unwrap_or(100);
    if page < 1 && page != -1 {
        return Err(ApiError::invalid("page must be -1 (all) or 1 or more").with("field", "page"));
    }
    if per_page == 0 || per_page < -1 {
        return Err(
            ApiError::invalid("perPage must be -1 (all) or 1 or more").with("field", "perPage")
        );
    }
    let total = items.len() as u64;
    let (items, total_page) = if page == -1 || per_page == -1 {
        (items, 1)
    } else {
        let per = per_page as u64;
        let skip = (page as u64 - 1).saturating_mul(per);
        let items: Vec<T> = items
            .into_iter()
            .skip(skip as usize)
            .take(per as usize)
            .collect();
        (items, total.div_ceil(per).max(1))
    };
    let body = ListResponse {
        items,
        pagination: Pagination {
            page,
            per_page,
            total,
            total_page,
        },
    };
    let mut response = axum::Json(body).into_response();
    response
        .headers_mut()
        .insert(REVISION_HEADER, HeaderValue::from(revision));
    Ok(response)
}

/// Validates a free-text name: present, not blank, at most 255 characters, no control characters.
fn check_name(field: &str, name: &str, problems: &mut Vec<String>) {
    if name.trim().is_empty() {
        problems.push(format!("{field} must not be empty"));
    } else if name.chars().count() > 255 {
        problems.push(format!("{field} must be at most 255 characters"));
    } else if name.chars().any(char::is_control) {
        problems.push(format!("{field} must not contain control characters"));
    }
}

/// Turns collected validation problems into one 422 listing them all.
fn problems_to_error(problems: Vec<String>) -> ApiResult<()> {
    if problems.is_empty() {
        return Ok(());
    }
    Err(ApiError::invalid(problems.join("; ")).with("errors", problems))
}
