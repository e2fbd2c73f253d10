//! Gateway errors: each carries a kind, which fixes its HTTP status, its OpenAI `type` and
//! `code`, which side caused it and whether another instance may be tried.
//!
//! Every error reaches the client in the OpenAI shape `{"error": {"message", "type", "code"}}`.

use std::borrow::Cow;

use bytes::Bytes;
use http::StatusCode;

pub use net::{BoxError, error_body};

/// Which side of the proxy an error comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorSource {
    /// The client sent something we refuse.
    Downstream,
    /// The upstream instance (or the path to it) failed.
    Upstream,
    /// The gateway itself (routing state, configuration).
    Internal,
}

/// What went wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// No such path.
    NotFound,
    /// Known path, wrong method.
    MethodNotAllowed,
    /// The body is not JSON (or not an object, or has two `model` fields).
    InvalidJson,
    /// The body has no `model`.
    MissingModel,
    /// Another malformed request.
    BadRequest,
    /// The body is over the configured limit.
    PayloadTooLarge,
    /// The client was too slow sending its body.
    RequestTimeout,
    /// No key, an unknown, revoked or expired key, or a key without inference scope.
    Unauthorized,
    /// The source address failed authentication too often; refused without checking the key.
    TooManyAuthFailures,
    /// A valid key that the management server does not let call this model (scope, model not
    /// granted to the key or its owner).
    ModelNotAllowed,
    /// The key must be checked by the management server, which cannot be reached, and has not
    /// allowed it recently.
    AuthUnavailable,
    /// The model is not known (or has no routable instance at all).
    ModelNotFound,
    /// The model is known but none of its instances can take traffic now.
    NoRoutableInstance,
    /// The gateway is shutting down.
    Draining,
    /// The upstream could not be connected to (refused, unreachable, connect timeout).
    UpstreamConnect,
    /// The worker proxy does not know the instance (it has not started work).
    UpstreamNoSuchInstance,
    /// No response head within the first-byte timeout.
    UpstreamFirstByteTimeout,
    /// No body data within the idle timeout.
    UpstreamIdleTimeout,
    /// The request outlived the total timeout.
    UpstreamTotalTimeout,
    /// The upstream broke the protocol or the connection mid-way.
    UpstreamProtocol,
    /// TLS with the upstream failed before any response: its certificate does not chain to the
    /// configured CA bundle (or names another host), or it refused our client certificate.
    UpstreamTls,
    /// A `tunnel` worker, but this gateway has no tunnel path.
    TunnelUnavailable,
    /// A `worker` path endpoint, but no worker credential is configured.
    NoWorkerCredential,
}

impl ErrorKind {
    /// Every kind, for metrics.
    pub const ALL: &'static [ErrorKind] = &[
        ErrorKind::NotFound,
        ErrorKind::MethodNotAllowed,
        ErrorKind::InvalidJson,
        ErrorKind::MissingModel,
        ErrorKind::BadRequest,
        ErrorKind::PayloadTooLarge,
        ErrorKind::RequestTimeout,
        ErrorKind::Unauthorized,
        ErrorKind::TooManyAuthFailures,
        ErrorKind::ModelNotAllowed,
        ErrorKind::AuthUnavailable,
        ErrorKind::ModelNotFound,
        ErrorKind::NoRoutableInstance,
        ErrorKind::Draining,
        ErrorKind::UpstreamConnect,
        ErrorKind::UpstreamNoSuchInstance,
        ErrorKind::UpstreamFirstByteTimeout,
        ErrorKind::UpstreamIdleTimeout,
        ErrorKind::UpstreamTotalTimeout,
        ErrorKind::UpstreamProtocol,
        ErrorKind::UpstreamTls,
        ErrorKind::TunnelUnavailable,
        ErrorKind::NoWorkerCredential,
    ];

    /// The HTTP status the client sees.
    pub fn status(self) -> StatusCode {
        use ErrorKind::*;
        match self {
            NotFound | ModelNotFound => StatusCode::NOT_FOUND,
            MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            InvalidJson | MissingModel | BadRequest => StatusCode::BAD_REQUEST,
            PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Unauthorized => StatusCode::UNAUTHORIZED,
            TooManyAuthFailures => StatusCode::TOO_MANY_REQUESTS,
            ModelNotAllowed => StatusCode::FORBIDDEN,
            NoRoutableInstance | Draining | AuthUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            UpstreamConnect
            | UpstreamNoSuchInstance
            | UpstreamProtocol
            | UpstreamTls
            | TunnelUnavailable
            | NoWorkerCredential => StatusCode::BAD_GATEWAY,
            UpstreamFirstByteTimeout | UpstreamIdleTimeout | UpstreamTotalTimeout => {
                StatusCode::GATEWAY_TIMEOUT
            }
        }
    }

    /// The OpenAI error `type`.
    pub fn error_type(self) -> &'static str {
        match self.source() {
            _ if self == ErrorKind::Unauthorized => "authentication_error",
            _ if self == ErrorKind::ModelNotAllowed => "permission_error",
            _ if self == ErrorKind::TooManyAuthFailures => "rate_limit_error",
            ErrorSource::Downstream => "invalid_request_error",
            ErrorSource::Upstream => "upstream_error",
            ErrorSource::Internal => "service_unavailable",
        }
    }

    /// The OpenAI error `code` (also the metrics label).
    pub fn code(self) -> &'static str {
        use ErrorKind::*;
        match self {
            NotFound => "not_found",
            MethodNotAllowed => "method_not_allowed",
            InvalidJson => "invalid_json",
            MissingModel => "missing_model",
            BadRequest => "bad_request",
            PayloadTooLarge => "payload_too_large",
            RequestTimeout => "request_timeout",
            Unauthorized => "invalid_api_key",
            TooManyAuthFailures => net::admission::Blocked::CODE,
            ModelNotAllowed => "model_not_allowed",
            AuthUnavailable => "auth_unavailable",
            ModelNotFound => "model_not_found",
            NoRoutableInstance => "no_routable_instance",
            Draining => "draining",
            UpstreamConnect => "upstream_connect",
            UpstreamNoSuchInstance => "upstream_no_such_instance",
            UpstreamFirstByteTimeout => "upstream_first_byte_timeout",
            UpstreamIdleTimeout => "upstream_idle_timeout",
            UpstreamTotalTimeout => "upstream_total_timeout",
            UpstreamProtocol => "upstream_protocol",
            UpstreamTls => "upstream_tls",
            TunnelUnavailable => "tunnel_unavailable",
            NoWorkerCredential => "no_worker_credential",
        }
    }

    /// Which side caused it.
    pub fn source(self) -> ErrorSource {
        use ErrorKind::*;
        match self {
            NotFound | MethodNotAllowed | InvalidJson | MissingModel | BadRequest
            | PayloadTooLarge | RequestTimeout | Unauthorized | TooManyAuthFailures
            | ModelNotAllowed | ModelNotFound => ErrorSource::Downstream,
            NoRoutableInstance | Draining | TunnelUnavailable | NoWorkerCredential
            | AuthUnavailable => ErrorSource::Internal,
            UpstreamConnect
            | UpstreamNoSuchInstance
            | UpstreamFirstByteTimeout
            | UpstreamIdleTimeout
            | UpstreamTotalTimeout
            | UpstreamProtocol
            | UpstreamTls => ErrorSource::Upstream,
        }
    }

    /// Whether another instance may be tried: only when the upstream cannot have started work
    /// (a TLS failure happens before the upstream accepts the connection).
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::UpstreamConnect | ErrorKind::UpstreamNoSuchInstance | ErrorKind::UpstreamTls
        )
    }

    /// Whether this failure counts against the instance for outlier ejection.
    pub fn counts_against_instance(self) -> bool {
        matches!(
            self,
            ErrorKind::UpstreamConnect
                | ErrorKind::UpstreamNoSuchInstance
                | ErrorKind::UpstreamFirstByteTimeout
                | ErrorKind::UpstreamProtocol
                | ErrorKind::UpstreamTls
        )
    }
}

/// An error answered to the client.
#[derive(Debug, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct GatewayError {
    pub kind: ErrorKind,
    pub message: Cow<'static, str>,
    #[source]
    pub cause: Option<BoxError>,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u64>,
}

impl GatewayError {
    /// An error of `kind` with a client-facing message.
    pub fn new(kind: ErrorKind, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind,
            message: message.into(),
            cause: None,
            retry_after: None,
        }
    }

    /// 429 for a source blocked after too many failed authentications, with `Retry-After`.
    pub fn blocked(blocked: net::admission::Blocked) -> Self {
        let mut e = Self::new(ErrorKind::TooManyAuthFailures, blocked.to_string());
        e.retry_after = Some(blocked.retry_after_secs());
        e
    }

    /// Attaches the underlying cause (logged, not shown to the client).
    pub fn with_cause(mut self, cause: impl Into<BoxError>) -> Self {
        self.cause = Some(cause.into());
        self
    }

    /// The OpenAI-shaped JSON body.
    pub fn body(&self) -> Bytes {
        error_body(&self.message, self.kind.error_type(), self.kind.code())
    }
}

impl From<net::pool::PoolError> for GatewayError {
    fn from(e: net::pool::PoolError) -> Self {
        use net::pool::PoolErrorKind as P;
        let kind = match e.kind {
            P::Connect => ErrorKind::UpstreamConnect,
            P::Protocol => ErrorKind::UpstreamProtocol,
            P::FirstByteTimeout => ErrorKind::UpstreamFirstByteTimeout,
            P::RequestBody => ErrorKind::BadRequest,
        };
        Self {
            kind,
            message: Cow::Borrowed(e.message),
            cause: e.cause,
            retry_after: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_failures_before_the_upstream_started_retry() {
        for kind in ErrorKind::ALL {
            let expected = matches!(
                kind,
                ErrorKind::UpstreamConnect
                    | ErrorKind::UpstreamNoSuchInstance
                    | ErrorKind::UpstreamTls
            );
            assert_eq!(kind.retryable(), expected, "{kind:?}");
        }
    }

    #[test]
    fn body_is_openai_shaped() {
        let e = GatewayError::new(ErrorKind::ModelNotFound, "model \"x\" not found");
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["message"], "model \"x\" not found");
        assert_eq!(e.kind.status(), 404);
    }
}
