//! The pool's errors.

use crate::BoxError;

/// Why an exchange through the pool failed. The gateway maps the kind to its own errors; a
/// connector's errors pass through [`Pool::send_keyed`](super::Pool::send_keyed) in the caller's
/// type.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PoolError {
    pub kind: PoolErrorKind,
    pub message: &'static str,
    #[source]
    pub cause: Option<BoxError>,
}

/// What failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolErrorKind {
    /// No connection: bad address, refused, timed out dialling.
    Connect,
    /// The upstream closed or broke the exchange before a complete response head.
    Protocol,
    /// No response head by the deadline ([`Prepared::within`](super::Prepared::within)).
    FirstByteTimeout,
    /// The caller's request body failed.
    RequestBody,
}

impl PoolError {
    pub fn new(kind: PoolErrorKind, message: &'static str) -> Self {
        Self {
            kind,
            message,
            cause: None,
        }
    }

    #[must_use]
    pub fn with_cause(mut self, cause: impl Into<BoxError>) -> Self {
        self.cause = Some(cause.into());
        self
    }
}

pub(super) fn first_byte_timeout() -> PoolError {
    PoolError::new(
        PoolErrorKind::FirstByteTimeout,
        "no response from the model instance within the first-byte timeout",
    )
}

pub(super) fn body_failed(e: BoxError) -> PoolError {
    PoolError::new(
        PoolErrorKind::RequestBody,
        "reading the request body failed",
    )
    .with_cause(e)
}
