//! Who is calling: an API key, a worker (its own token) or a cluster registration token.
//!
//! Credentials come as `Authorization: Bearer <token>` or `X-API-Key: <token>`. A missing,
//! malformed, unknown, revoked or expired credential is a 401; a valid one without the rights
//! for the call is a 403. A presented credential that is refused counts as a failed
//! authentication of the source address; a source with too many of them gets 429 with
//! `Retry-After` before its credential is looked at (see [`net::admission::AuthLimiter`]).

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, FromRequestParts};
use chrono::Utc;
use http::request::Parts;

use super::AppState;
use super::error::ApiError;
use crate::args;
use crate::store::{Sql, StoreError};
use control_client::model::{ApiKey, Cluster, Scope};
use control_client::tokens;

/// The authenticated caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    /// An API key.
    ApiKey { id: i64, scope: Scope },
    /// A worker, with its own worker token.
    Worker { worker_id: i64, cluster_id: i64 },
    /// A cluster registration token: may only register workers.
    Registration { cluster_id: i64 },
}

impl Principal {
    /// Administrators: API keys of scope `management` or `all`.
    pub fn require_admin(&self) -> Result<(), ApiError> {
        match self {
            Principal::ApiKey { scope, .. } if scope.is_admin() => Ok(()),
            _ => Err(ApiError::forbidden(
                "this call needs an API key of scope management or all",
            )),
        }
    }

    /// Readers of routing state: administrators and data-plane keys.
    pub fn require_reader(&self) -> Result<(), ApiError> {
        match self {
            Principal::ApiKey { scope, .. } if scope.is_admin() || *scope == Scope::DataPlane => {
                Ok(())
            }
            _ => Err(ApiError::forbidden(
                "this call needs an API key of scope management, all or data_plane",
            )),
        }
    }

    /// For calls open to workers (on their own rows) and readers: the worker's id, or `None` for
    /// a reader.
    pub fn worker_or_reader(&self) -> Result<Option<i64>, ApiError> {
        match self {
            Principal::Worker { worker_id, .. } => Ok(Some(*worker_id)),
            p => p.require_reader().map(|()| None),
        }
    }

    /// Whether the caller is an administrator.
    pub fn is_admin(&self) -> bool {
        self.require_admin().is_ok()
    }
}

/// Extracts the presented token from the request headers.
pub fn presented_token(parts: &Parts) -> Option<&str> {
    if let Some(value) = parts.headers.get(http::header::AUTHORIZATION) {
        return value.to_str().ok().and_then(tokens::bearer);
    }
    parts
        .headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

impl FromRequestParts<AppState> for Principal {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let source = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip());
        let token = presented_token(parts)
            .ok_or_else(ApiError::unauthorized)?
            .to_owned();
        let principal = state
            .store
            .read(async move |sql| resolve(sql, &token).await)
            .await?;
        if let (None, Some(ip)) = (&principal, source) {
            // A refused token; past the source's limit, a 429 tells it to back off. A valid
            // token is served from any source.
            state.auth_limiter.failed(ip).map_err(ApiError::blocked)?;
        }
        principal.ok_or_else(ApiError::unauthorized)
    }
}

/// Resolves a token to its principal; `None` when it is not valid now.
pub async fn resolve(sql: &mut Sql, token: &str) -> Result<Option<Principal>, StoreError> {
    let token = unwrap_registration_token(token);
    let Some(parts) = tokens::parse(token) else {
        return Ok(None);
    };
    match parts.prefix {
        tokens::API_KEY_PREFIX => {
            let Some(row) = sql
                .query_opt(
                    "SELECT digest, data FROM api_keys WHERE access_id = $1",
                    args![parts.access_id],
                )
                .await?
            else {
                return Ok(None);
            };
            let (digest, data): (Vec<u8>, String) = (row.get(0)?, row.get(1)?);
            if !digest_matches(parts.secret, &digest) {
                return Ok(None);
            }
            let key: ApiKey = serde_json::from_str(&data)?;
            if key.expires_at.is_some_and(|t| t.0 <= Utc::now()) {
                return Ok(None);
            }
            Ok(Some(Principal::ApiKey {
                id: key.id,
                scope: key.scope,
            }))
        }
        tokens::WORKER_TOKEN_PREFIX => {
            let Some(row) = sql
                .query_opt(
                    "SELECT id, cluster_id, token_digest FROM workers WHERE token_access_id = $1",
                    args![parts.access_id],
                )
                .await?
            else {
                return Ok(None);
            };
            let (worker_id, cluster_id, digest): (i64, i64, Vec<u8>) =
                (row.get(0)?, row.get(1)?, row.get(2)?);
            Ok(
                digest_matches(parts.secret, &digest).then_some(Principal::Worker {
                    worker_id,
                    cluster_id,
                }),
            )
        }
        tokens::REGISTRATION_TOKEN_PREFIX | tokens::LEGACY_REGISTRATION_TOKEN_PREFIX => {
            let Some(row) = sql
                .query_opt(
                    "SELECT data FROM clusters WHERE reg_access_id = $1",
                    args![parts.access_id],
                )
                .await?
            else {
                return Ok(None);
            };
            let data: String = row.get(0)?;
            let cluster: Cluster = serde_json::from_str(&data)?;
            let stored = cluster.registration_token.unwrap_or_default();
            Ok(
                tokens::constant_time_eq(stored.as_bytes(), token.as_bytes()).then_some(
                    Principal::Registration {
                        cluster_id: cluster.id,
                    },
                ),
            )
        }
        _ => Ok(None),
    }
}

fn digest_matches(secret: &str, stored: &[u8]) -> bool {
    <[u8; 32]>::try_from(stored).is_ok_and(|d| tokens::verify(secret, &d))
}

/// A GPUStack worker restarted with a data directory that holds its `worker_uuid` presents a
/// registration token that does not start with `gpustack` (one of the `fdnr_` tokens issued
/// before) as `gpustack_<worker uuid>_<token>`
/// (`gpustack.config.registration.registration_client`): the faden token inside is the one
/// checked.
fn unwrap_registration_token(token: &str) -> &str {
    token
        .strip_prefix("gpustack_")
        .and_then(|rest| rest.split_once('_'))
        .map(|(_, inner)| inner)
        .filter(|inner| {
            tokens::parse(inner)
                .is_some_and(|p| p.prefix == tokens::LEGACY_REGISTRATION_TOKEN_PREFIX)
        })
        .unwrap_or(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpustack_wraps_registration_tokens_only() {
        let reg = format!("fdnr_{}_{}", "a".repeat(16), "b".repeat(32));
        let uuid = "14249454-02ce-4254-bbe6-22fd3f420c94";
        assert_eq!(
            unwrap_registration_token(&format!("gpustack_{uuid}_{reg}")),
            reg
        );
        assert_eq!(unwrap_registration_token(&reg), reg);
        // Anything else is presented as it is (and then fails to resolve).
        let worker = format!("gpustack_{uuid}_fdnw_{}_{}", "a".repeat(16), "b".repeat(32));
        assert_eq!(unwrap_registration_token(&worker), worker);
        assert_eq!(unwrap_registration_token("gpustack_x"), "gpustack_x");
        // Today's tokens have GPUStack's own shape: GPUStack's workers never wrap them.
        let current = format!("gpustack_{}_{}", "a".repeat(16), "b".repeat(32));
        assert_eq!(unwrap_registration_token(&current), current);
        assert_eq!(
            tokens::parse(&current).unwrap().prefix,
            tokens::REGISTRATION_TOKEN_PREFIX
        );
        assert_eq!(unwrap_registration_token("gpustack__"), "gpustack__");
    }
}
