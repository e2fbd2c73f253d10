//! Client authentication against the routing snapshot's key digests.

use chrono::{DateTime, Utc};
use control::routing::{KeyRejection, RoutingSnapshot};
use control::tokens;
use http::HeaderMap;

use crate::error::{ErrorKind, GatewayError};

/// `X-API-Key`, accepted like `Authorization: Bearer`.
pub const X_API_KEY: &str = "x-api-key";

/// The key a client presents: `Authorization: Bearer <key>`, else `X-API-Key: <key>`.
pub fn presented_key(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(tokens::bearer)
        .or_else(|| {
            headers
                .get(X_API_KEY)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|k| !k.is_empty())
        })
}

/// Checks that the request carries a valid, unexpired key whose scope allows inference.
pub fn authenticate(
    snapshot: &RoutingSnapshot,
    headers: &HeaderMap,
    now: DateTime<Utc>,
) -> Result<(), GatewayError> {
    let key = presented_key(headers).ok_or_else(|| {
        GatewayError::new(
            ErrorKind::Unauthorized,
            "missing API key: send Authorization: Bearer <key> or X-API-Key",
        )
    })?;
    match snapshot.verify_key(key, now) {
        Ok(scope) if scope.allows_inference() => Ok(()),
        Ok(_) => Err(GatewayError::new(
            ErrorKind::Unauthorized,
            "API key scope does not allow inference",
        )),
        Err(
            rejection @ (KeyRejection::Malformed | KeyRejection::Unknown | KeyRejection::Expired),
        ) => Err(GatewayError::new(
            ErrorKind::Unauthorized,
            rejection.to_string(),
        )),
    }
}
