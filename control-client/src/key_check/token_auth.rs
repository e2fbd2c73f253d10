//! GPUStack's verdict on a key: `GET <server>/token-auth`, the endpoint GPUStack's own gateway
//! and worker proxies call, with the client's key as `Authorization: Bearer` and the model as
//! `X-Higress-Llm-Model`.
//!
//! GPUStack 2.3 answers (`gpustack/routes/token.py`):
//! - 200: the key may call the model (it checks the key's digest, expiry, owner, scope, the
//!   key's `allowed_model_names` and the owner's model access);
//! - 401: not a valid key; 403: a valid key without inference scope or without access to the
//!   model; 404: a valid key, a model GPUStack does not know;
//! - 400 "Missing 'model' field": a valid key asked about no model, which is how faden learns
//!   that a key is valid at all (for `/v1/models` with no model to ask about).
//!
//! Anything else (5xx, a timeout, no connection) is [`Unreachable`]: no verdict.

use std::time::Duration;

use bytes::Bytes;
use http::header::{AUTHORIZATION, HeaderName, HeaderValue};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;

use super::{BoxFuture, KeyAuthority, Unreachable, Verdict};
use crate::sync::SyncError;
use crate::tls::ApiConnector;

/// The header GPUStack's `/token-auth` reads the model from.
const MODEL_HEADER: HeaderName = HeaderName::from_static("x-higress-llm-model");
/// Largest answer body read for a reason.
const MAX_BODY_BYTES: usize = 4096;
/// Idle connections to the server kept for the next checks (they come in bursts).
const MAX_IDLE_CONNECTIONS: usize = 16;

/// [`KeyAuthority`] of a GPUStack server.
#[derive(Debug)]
pub struct TokenAuth {
    client: Client<ApiConnector, Empty<Bytes>>,
    /// `<base>/token-auth`.
    url: String,
    timeout: Duration,
}

impl TokenAuth {
    /// Checks keys at `base_url` (the server's API, as given to the sync client; `tls` for an
    /// `https` one), each check bounded by `timeout`.
    pub fn new(
        base_url: &str,
        tls: Option<std::sync::Arc<rustls::ClientConfig>>,
        timeout: Duration,
    ) -> Result<Self, SyncError> {
        let base = crate::sync::base_url(base_url, tls.is_some())?;
        let client = crate::sync::client(timeout, tls, MAX_IDLE_CONNECTIONS);
        Ok(Self {
            client,
            url: format!("{base}/token-auth"),
            timeout,
        })
    }

    async fn ask(&self, key: &str, model: Option<&str>) -> Result<Verdict, Unreachable> {
        let unreachable =
            |what: &str, e: &dyn std::fmt::Display| Unreachable(format!("{what}: {e}"));
        let mut authorization = HeaderValue::try_from(format!("Bearer {key}"))
            .map_err(|_| Unreachable("the key is not a valid header value".to_owned()))?;
        authorization.set_sensitive(true);
        let mut request = Request::get(&self.url).header(AUTHORIZATION, authorization);
        if let Some(model) = model {
            let model = HeaderValue::try_from(model)
                .map_err(|e| unreachable("the model name is not a valid header value", &e))?;
            request = request.header(MODEL_HEADER, model);
        }
        let request = request
            .body(Empty::new())
            .map_err(|e| unreachable("cannot build the key check", &e))?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| unreachable("key check failed", &e))?;
        let status = response.status();
        let reason = match Limited::new(response.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
        {
            Ok(body) => reason(&body.to_bytes()),
            Err(_) => String::new(),
        };
        let said = |fallback: &str| {
            if reason.is_empty() {
                fallback.to_owned()
            } else {
                reason.clone()
            }
        };
        Ok(match (status, model) {
            (StatusCode::OK, _) => Verdict::Allowed,
            (StatusCode::BAD_REQUEST, None) => Verdict::Allowed,
            (StatusCode::UNAUTHORIZED, _) => {
                Verdict::Unauthorized(said("invalid authentication credentials"))
            }
            (StatusCode::FORBIDDEN, _) => {
                Verdict::Forbidden(said("not allowed to access the model"))
            }
            (StatusCode::NOT_FOUND, Some(model)) => Verdict::Forbidden(format!(
                "the management server does not know model {model:?}"
            )),
            (status, _) => {
                return Err(Unreachable(format!(
                    "the key check answered {status}{}",
                    if reason.is_empty() {
                        String::new()
                    } else {
                        format!(": {reason}")
                    }
                )));
            }
        })
    }
}

impl KeyAuthority for TokenAuth {
    fn verify<'a>(
        &'a self,
        key: &'a str,
        model: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Verdict, Unreachable>> {
        Box::pin(async move {
            match tokio::time::timeout(self.timeout, self.ask(key, model)).await {
                Ok(verdict) => verdict,
                Err(_) => Err(Unreachable(format!(
                    "no answer to the key check within {:?}",
                    self.timeout
                ))),
            }
        })
    }
}

/// The `message` of GPUStack's `{code, reason, message}` error body, else the body's text.
fn reason(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Error {
        message: String,
    }
    match serde_json::from_slice::<Error>(body) {
        Ok(e) => e.message,
        Err(_) => String::from_utf8_lossy(body)
            .chars()
            .filter(|c| !c.is_control())
            .take(200)
            .collect(),
    }
}
