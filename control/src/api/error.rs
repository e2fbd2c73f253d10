//! Errors of the management API, answered in GPUStack's shape `{"code", "reason", "message"}`
//! with optional structured details beside them.

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde_json::{Map, Value, json};

use crate::store::StoreError;

/// An error answer. Client mistakes carry a 4xx status; only store failures are 500s.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// Extra fields merged into the body (for example `rejected_paths`).
    pub details: Map<String, Value>,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            details: Map::new(),
            retry_after: None,
        }
    }

    /// 429 for a source blocked after too many failed authentications, with `Retry-After`.
    pub fn blocked(blocked: net::admission::Blocked) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, blocked.to_string());
        e.retry_after = Some(blocked.retry_after_secs());
        e
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "Invalid authentication credentials",
        )
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, message)
    }

    /// Adds a structured detail beside `code`, `reason` and `message`.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.details.insert(key.to_owned(), value.into());
        self
    }

    fn reason(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequest",
            StatusCode::UNAUTHORIZED => "Unauthorized",
            StatusCode::FORBIDDEN => "Forbidden",
            StatusCode::NOT_FOUND => "NotFound",
            StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowed",
            StatusCode::CONFLICT => "Conflict",
            StatusCode::PAYLOAD_TOO_LARGE => "PayloadTooLarge",
            StatusCode::UNSUPPORTED_MEDIA_TYPE => "UnsupportedMediaType",
            StatusCode::UNPROCESSABLE_ENTITY => "Invalid",
            StatusCode::TOO_MANY_REQUESTS => "TooManyRequests",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
            s if s.is_server_error() => "InternalServerError",
            _ => "Error",
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        tracing::error!(error = %e, "store failure");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal store error")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({
            "code": self.status.as_u16(),
            "reason": self.reason(),
            "message": self.message,
        });
        if let Value::Object(map) = &mut body {
            map.extend(self.details);
        }
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(http::header::RETRY_AFTER, http::HeaderValue::from(secs));
        }
        response
    }
}

/// Result of a handler.
pub type ApiResult<T> = Result<T, ApiError>;
