//! Client authentication against the routing snapshot's key digests, with failed attempts
//! rate-limited per source address. A key the snapshot does not hold can be left to the
//! management server ([`Caller::Remote`], checked by `control_client::key_check` once the model is
//! known): GPUStack publishes no digests.

use std::net::IpAddr;

use chrono::{DateTime, Utc};
use control_client::routing::{KeyRejection, RoutingSnapshot};
use http::HeaderMap;
use net::admission::AuthLimiter;

use crate::error::{ErrorKind, GatewayError};

/// `X-API-Key`, accepted like `Authorization: Bearer`.
pub const X_API_KEY: &str = "x-api-key";

pub use net::headers::presented_key;

/// Who a request's key says the caller is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller<'h> {
    /// A key of the snapshot, valid for inference.
    Known,
    /// A key the snapshot does not hold, for the management server to judge per model.
    Remote(&'h str),
}

/// [`authenticate`] for a client at `source`: a presented key that is refused (malformed,
/// unknown, expired, revoked) counts as a failure of that source, answered 429 instead of 401
/// once the source is past `limiter`'s limit; a valid key is served whatever the source's
/// count. A missing key or a valid key without inference scope is a 401 that does not count:
/// neither guesses a secret. With `remote`, a key the snapshot does not know (or cannot parse:
/// the server may take other shapes) is not refused but handed back as [`Caller::Remote`]; a
/// refusal of it then counts through [`AuthLimiter::failed`].
pub fn authenticate_source<'h>(
    limiter: &AuthLimiter,
    source: IpAddr,
    snapshot: &RoutingSnapshot,
    headers: &'h HeaderMap,
    now: impl FnOnce() -> DateTime<Utc>,
    remote: bool,
) -> Result<Caller<'h>, GatewayError> {
    let (result, guessed) = check(snapshot, headers, now, remote);
    if guessed {
        limiter.failed(source).map_err(GatewayError::blocked)?;
    }
    result
}

/// Checks that the request carries a valid, unexpired key whose scope allows inference. `now` is
/// called only for a key that has an expiry.
pub fn authenticate(
    snapshot: &RoutingSnapshot,
    headers: &HeaderMap,
    now: impl FnOnce() -> DateTime<Utc>,
) -> Result<(), GatewayError> {
    check(snapshot, headers, now, false).0.map(|_| ())
}

/// The check, and whether it failed on a presented key that is not valid.
fn check<'h>(
    snapshot: &RoutingSnapshot,
    headers: &'h HeaderMap,
    now: impl FnOnce() -> DateTime<Utc>,
    remote: bool,
) -> (Result<Caller<'h>, GatewayError>, bool) {
    let Some(key) = presented_key(headers) else {
        return (
            Err(GatewayError::new(
                ErrorKind::Unauthorized,
                "missing API key: send Authorization: Bearer <key> or X-API-Key",
            )),
            false,
        );
    };
    match snapshot.verify_key_lazily(key, now) {
        Ok(scope) if scope.allows_inference() => (Ok(Caller::Known), false),
        Ok(_) => (
            Err(GatewayError::new(
                ErrorKind::Unauthorized,
                "API key scope does not allow inference",
            )),
            false,
        ),
        Err(KeyRejection::Malformed | KeyRejection::Unknown) if remote => {
            (Ok(Caller::Remote(key)), false)
        }
        Err(
            rejection @ (KeyRejection::Malformed | KeyRejection::Unknown | KeyRejection::Expired),
        ) => (
            Err(GatewayError::new(
                ErrorKind::Unauthorized,
                rejection.to_string(),
            )),
            true,
        ),
    }
}
