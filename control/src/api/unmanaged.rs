//! GPUStack resources that faden does not manage but GPUStack's workers read at start-up and
//! keep watching: inference backends, benchmarks, cache providers, services and instances,
//! model files. faden has none of them, and says so in GPUStack's shapes: a list is empty, a watch
//! sends only heartbeats until the server stops, one object is 404. Nothing is written.
//!
//! The query string is read leniently here (GPUStack's workers filter these lists by fields
//! faden does not store); only `watch` means anything.

use std::collections::HashMap;

use axum::extract::{Query, State};
use axum::response::Response;
use http::Uri;

use super::auth::Principal;
use super::extract::ListQuery;
use super::{ApiError, ApiResult, AppState, list_response, watch};

/// The collection paths under `/v2` served empty.
pub(super) const COLLECTIONS: &[&str] = &[
    "inference-backends",
    "benchmarks",
    "cache-providers",
    "cache-services",
    "cache-service-instances",
    "model-files",
];

/// `GET /v2/<collection>`: no items, or with `watch=true` a stream that stays idle.
pub(super) async fn list(
    State(state): State<AppState>,
    principal: Principal,
    Query(params): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    principal.worker_or_reader()?;
    if params.get("watch").is_some_and(|w| w == "true") {
        return watch::idle(&state);
    }
    // Nothing to page through (GPUStack's workers send even `page=0` here).
    list_response(
        Vec::<()>::new(),
        &ListQuery::default(),
        state.store.revision(),
    )
}

/// `GET /v2/inference-backends/all`: GPUStack's unpaginated list of backends, empty.
pub(super) async fn all_backends(principal: Principal) -> ApiResult<axum::Json<[(); 0]>> {
    principal.worker_or_reader()?;
    Ok(axum::Json([]))
}

/// `GET /v2/<collection>/{id}`: there is no such object.
pub(super) async fn get_one(principal: Principal, uri: Uri) -> ApiResult<Response> {
    principal.worker_or_reader()?;
    let collection = uri.path().split('/').nth(2).unwrap_or_default();
    Err(ApiError::not_found(format!(
        "{} not found: faden does not manage {collection}",
        uri.path()
    )))
}
