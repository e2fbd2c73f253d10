//! Request extractors that answer every client mistake in the API's error shape.

use axum::extract::{FromRequest, FromRequestParts, Request};
use bytes::Bytes;
use http::StatusCode;
use http::request::Parts;
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::error::ApiError;

/// Largest request body the management API reads.
pub const MAX_BODY: usize = 1 << 20;

/// A JSON body (whatever the content type says), read up to [`MAX_BODY`] and parsed strictly: malformed JSON is a 400, a body
/// that parses but does not fit (wrong type, unknown or missing field) is a 422 naming the field.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, ApiError> {
        // The content type is not checked: `curl -d` sends form-urlencoded by default, and the
        // body is parsed as JSON strictly anyway.
        let bytes = read_body(req).await?;
        parse_json(&bytes).map(JsonBody)
    }
}

pub(super) async fn read_body(req: Request) -> Result<Bytes, ApiError> {
    let limited = Limited::new(req.into_body(), MAX_BODY);
    match limited.collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body exceeds the limit of {MAX_BODY} bytes"),
            ))
        }
        Err(e) => Err(ApiError::bad_request(format!(
            "cannot read the request body: {e}"
        ))),
    }
}

/// Parses JSON strictly, naming the offending field on type errors.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "request body is empty; expected a JSON object",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, T>(de) {
        Ok(v) => Ok(v),
        Err(e) => {
            let mut path = e.path().to_string();
            let inner = e.into_inner();
            // A missing field is reported at its parent: name the field itself.
            let text = inner.to_string();
            if let Some(rest) = text.strip_prefix("missing field `")
                && let Some(field) = rest.split('`').next()
            {
                path = if path == "." {
                    field.to_owned()
                } else {
                    format!("{path}.{field}")
                };
            }
            match inner.classify() {
                serde_json::error::Category::Data => {
                    let message = if path == "." {
                        inner.to_string()
                    } else {
                        format!("{path}: {inner}")
                    };
                    Err(ApiError::invalid(message).with("field", path))
                }
                _ => Err(ApiError::bad_request(format!("malformed JSON: {inner}"))),
            }
        }
    }
}

/// A numeric `{id}` path segment; anything else is a 400.
#[derive(Debug, Clone, Copy)]
pub struct IdPath(pub i64);

impl<S: Send + Sync> FromRequestParts<S> for IdPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let axum::extract::Path(raw) =
            axum::extract::Path::<String>::from_request_parts(parts, state)
                .await
                .map_err(|e| ApiError::bad_request(e.body_text()))?;
        raw.parse::<i64>()
            .ok()
            .filter(|id| *id > 0)
            .map(IdPath)
            .ok_or_else(|| ApiError::bad_request(format!("{raw:?} is not a valid id")))
    }
}

/// Query parameters of list endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    pub page: Option<i64>,
    #[serde(rename = "perPage", alias = "per_page")]
    pub per_page: Option<i64>,
    pub watch: Option<bool>,
    /// Resume a watch after this revision.
    pub since: Option<u64>,
    /// Ignored filters GPUStack clients send.
    pub search: Option<String>,
    /// Only the object with this id (GPUStack's worker watches one instance so).
    pub id: Option<i64>,
    pub cluster_id: Option<i64>,
    pub worker_id: Option<i64>,
    pub model_id: Option<i64>,
    /// Only orphaned model instances (`true`: their model was deleted) or only the others.
    pub orphaned: Option<bool>,
    /// GPUStack's `me=true`: a worker's own record. A worker lists only itself anyway, and
    /// GPUStack ignores it for other callers, so it changes nothing.
    #[serde(rename = "me")]
    pub _me: Option<bool>,
}

impl ListQuery {
    /// Whether the query narrows the objects (by id, cluster, worker or model).
    pub fn filters(&self) -> bool {
        self.id.is_some()
            || self.cluster_id.is_some()
            || self.worker_id.is_some()
            || self.model_id.is_some()
            || self.orphaned.is_some()
    }
}

/// The parsed query string; malformed parameters are a 400 naming the parameter.
#[derive(Debug, Clone, Default)]
pub struct Query(pub ListQuery);

impl<S: Send + Sync> FromRequestParts<S> for Query {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let raw = parts.uri.query().unwrap_or("");
        serde_urlencoded::from_str::<ListQuery>(raw)
            .map(Query)
            .map_err(|e| ApiError::bad_request(format!("invalid query string: {e}")))
    }
}
