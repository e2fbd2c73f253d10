//! `/v2/api-keys` (administrators) and `/v2/credentials`, the feed of key digests that
//! data-plane components verify keys against without ever seeing a secret.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use serde::Deserialize;
use serde::de::IgnoredAny;

use super::auth::Principal;
use super::extract::{IdPath, JsonBody, Query};
use super::{
    ApiError, ApiResult, AppState, check_name, get_or_404, list_or_watch, problems_to_error,
};
use crate::args;
use crate::store::{self, Kind, Store, StoreError, Tx};
use control_client::model::{ApiKey, Credential, EventType, Scope, Timestamp};
use control_client::tokens;

/// Body of `POST /v2/api-keys`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct KeyInput {
    name: String,
    #[serde(default)]
    description: Option<String>,
    /// Defaults to `inference`, the least privilege.
    #[serde(default)]
    scope: Option<Scope>,
    #[serde(default)]
    expires_at: Option<Timestamp>,
    /// GPUStack's alternative: seconds from now; 0 or absent means never.
    #[serde(default)]
    expires_in: Option<i64>,
    #[serde(default, rename = "allowed_model_names")]
    _allowed_model_names: Option<IgnoredAny>,
}

async fn insert_key(
    tx: &mut Tx,
    key: &tokens::NewKey,
    name: String,
    description: Option<String>,
    scope: Scope,
    expires_at: Option<Timestamp>,
) -> Result<ApiKey, StoreError> {
    let id = tx
        .sql()
        .insert(
            "INSERT INTO api_keys (name, access_id, digest, data, credential) \
         VALUES ($1, $2, $3, '{}', '{}') RETURNING id",
            args![name, key.access_id, key.digest.as_slice()],
        )
        .await?;
    let now = Timestamp::now();
    let api_key = ApiKey {
        id,
        name,
        description,
        scope,
        expires_at,
        access_id: Some(key.access_id.clone()),
        value: None,
        created_at: Some(now),
        updated_at: Some(now),
    };
    let credential = Credential {
        id,
        access_id: key.access_id.clone(),
        secret_digest: hex::encode(key.digest),
        scope,
        expires_at,
    };
    tx.sql()
        .execute(
            "UPDATE api_keys SET data = $1, credential = $2 WHERE id = $3",
            args![
                serde_json::to_string(&api_key)?,
                serde_json::to_string(&credential)?,
                id
            ],
        )
        .await?;
    tx.emit(Kind::Credentials, EventType::Created, id, &credential)
        .await?;
    Ok(api_key)
}

pub(super) async fn create(
    State(state): State<AppState>,
    principal: Principal,
    JsonBody(input): JsonBody<KeyInput>,
) -> ApiResult<axum::Json<ApiKey>> {
    principal.require_admin()?;
    let mut problems = Vec::new();
    check_name("name", &input.name, &mut problems);
    let expires_at = match (input.expires_at, input.expires_in) {
        (Some(_), Some(_)) => {
            problems.push("give expires_at or expires_in, not both".to_owned());
            None
        }
        (Some(t), None) => Some(t),
        (None, Some(s)) if s < 0 => {
            problems.push("expires_in must be 0 (never) or a number of seconds".to_owned());
            None
        }
        (None, Some(s)) if s > 0 => Some(Timestamp(
            Utc::now() + chrono::Duration::seconds(s.min(100 * 365 * 86_400)),
        )),
        _ => None,
    };
    if expires_at.is_some_and(|t| t.0 <= Utc::now()) {
        problems.push("expires_at must be in the future".to_owned());
    }
    problems_to_error(problems)?;
    let key = tokens::generate(tokens::API_KEY_PREFIX);
    let value = key.value.clone();
    let scope = input.scope.unwrap_or(Scope::Inference);
    let mut api_key = state
        .store
        .write(async move |tx| {
            insert_key(tx, &key, input.name, input.description, scope, expires_at).await
        })
        .await?;
    api_key.value = Some(value);
    Ok(axum::Json(api_key))
}

pub(super) async fn list(
    State(state): State<AppState>,
    principal: Principal,
    Query(query): Query,
) -> ApiResult<Response> {
    principal.require_admin()?;
    if query.watch == Some(true) {
        return Err(ApiError::bad_request(
            "api-keys cannot be watched; watch /v2/credentials",
        ));
    }
    list_or_watch::<ApiKey>(&state, Kind::ApiKeys, &query, false, |_| true).await
}

pub(super) async fn get_one(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<axum::Json<ApiKey>> {
    principal.require_admin()?;
    get_or_404::<ApiKey>(&state, Kind::ApiKeys, id, "api key")
        .await
        .map(axum::Json)
}

/// `DELETE /v2/api-keys/{id}`: revokes the key. Data planes see the credential deleted.
pub(super) async fn delete(
    State(state): State<AppState>,
    principal: Principal,
    IdPath(id): IdPath,
) -> ApiResult<Response> {
    principal.require_admin()?;
    state
        .store
        .write(async move |tx| -> ApiResult<()> {
            let credential: Credential = store::get(tx.sql(), Kind::Credentials, id)
                .await?
                .ok_or_else(|| ApiError::not_found(format!("api key {id} not found")))?;
            tx.sql()
                .execute("DELETE FROM api_keys WHERE id = $1", args![id])
                .await?;
            tx.emit(Kind::Credentials, EventType::Deleted, id, &credential)
                .await?;
            Ok(())
        })
        .await?;
    Ok(http::StatusCode::NO_CONTENT.into_response())
}

/// `GET /v2/credentials[?watch=true]`: digests and scopes, never secrets; for administrators and
/// data-plane keys.
pub(super) async fn credentials(
    State(state): State<AppState>,
    principal: Principal,
    Query(query): Query,
) -> ApiResult<Response> {
    principal.require_reader()?;
    list_or_watch::<Credential>(&state, Kind::Credentials, &query, false, |_| true).await
}

/// Makes sure the key `value` exists with `scope` (bootstrap keys: the admin key, the in-process
/// data plane's key). Returns `false` when it already existed.
pub async fn ensure_key(
    store: &Store,
    value: &str,
    name: &str,
    scope: Scope,
) -> Result<bool, EnsureKeyError> {
    let parts = tokens::parse(value).ok_or(EnsureKeyError::Malformed)?;
    if parts.prefix != tokens::API_KEY_PREFIX {
        return Err(EnsureKeyError::Malformed);
    }
    let key = tokens::NewKey {
        value: value.to_owned(),
        access_id: parts.access_id.to_owned(),
        digest: tokens::digest(parts.secret),
    };
    let name = name.to_owned();
    let created = store
        .write(async move |tx| -> Result<bool, StoreError> {
            let existing: Option<Vec<u8>> = tx
                .sql()
                .query_opt(
                    "SELECT digest FROM api_keys WHERE access_id = $1",
                    args![key.access_id],
                )
                .await?
                .map(|row| row.get(0))
                .transpose()?;
            match existing {
                Some(digest) if digest == key.digest => Ok(false),
                Some(_) => {
                    // Same access id, other secret: revoke the old row, then add the new one.
                    let row = tx
                        .sql()
                        .query_opt(
                            "SELECT id, credential FROM api_keys WHERE access_id = $1",
                            args![key.access_id],
                        )
                        .await?
                        .ok_or_else(|| StoreError::Decode("api key row vanished".to_owned()))?;
                    let (id, data): (i64, String) = (row.get(0)?, row.get(1)?);
                    let old: Credential = serde_json::from_str(&data)?;
                    tx.sql()
                        .execute("DELETE FROM api_keys WHERE id = $1", args![id])
                        .await?;
                    tx.emit(Kind::Credentials, EventType::Deleted, id, &old)
                        .await?;
                    insert_key(tx, &key, name, None, scope, None)
                        .await
                        .map(|_| true)
                }
                None => insert_key(tx, &key, name, None, scope, None)
                    .await
                    .map(|_| true),
            }
        })
        .await?;
    Ok(created)
}

/// Why a bootstrap key was refused.
#[derive(Debug, thiserror::Error)]
pub enum EnsureKeyError {
    #[error("the key must look like fdn_<16 hex digits>_<32 hex digits>")]
    Malformed,
    #[error(transparent)]
    Store(#[from] StoreError),
}
