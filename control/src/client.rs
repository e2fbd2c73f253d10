//! A minimal JSON client of the management API (faden's or GPUStack's `/v2`): what the worker
//! agent and `faden up` call it with.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::ClientConfig;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::tls::ApiConnector;

const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// Why a call of the management API failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid server URL {0:?}: it must look like http://host:port or https://host:port")]
    Url(String),
    /// An `https` server URL without TLS settings.
    #[error("server URL {0:?}: https needs TLS settings (a CA bundle or the platform roots)")]
    NoTls(String),
    #[error("cannot reach the server: {0}")]
    Unreachable(String),
    #[error("the server refused {what}: {status} {body}")]
    Refused {
        what: String,
        status: StatusCode,
        body: String,
    },
    #[error("unexpected answer to {what}: {reason}")]
    Answer { what: String, reason: String },
}

/// An error with its sources (a TLS failure hides two levels down in a client error).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let next = s.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = s.source();
    }
    text
}

/// A minimal JSON client of the management API.
#[derive(Clone, Debug)]
pub struct ApiClient {
    base: String,
    client: Client<ApiConnector, Full<Bytes>>,
    timeout: Duration,
}

impl ApiClient {
    /// A client of `server_url` (`http://host:port`).
    pub fn new(server_url: &str) -> Result<Self, ClientError> {
        Self::with_tls(server_url, None)
    }

    /// A client of `server_url` (`http://host:port`, or `https://host:port` with `tls`: see
    /// [`crate::tls::client_config`]).
    pub fn with_tls(server_url: &str, tls: Option<Arc<ClientConfig>>) -> Result<Self, ClientError> {
        let base = server_url.trim().trim_end_matches('/').to_owned();
        let rest = base
            .strip_prefix("http://")
            .or_else(|| base.strip_prefix("https://"));
        if rest.is_none_or(str::is_empty) {
            return Err(ClientError::Url(server_url.to_owned()));
        }
        if base.starts_with("https://") && tls.is_none() {
            return Err(ClientError::NoTls(server_url.to_owned()));
        }
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(20))
            .build(ApiConnector::new(http, tls));
        Ok(Self {
            base,
            client,
            timeout: Duration::from_secs(15),
        })
    }

    /// The server URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Sends a JSON request with `token`; returns status and body.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        token: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        let body = match body {
            Some(v) => Bytes::from(v.to_string()),
            None => Bytes::new(),
        };
        let request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| ClientError::Url(e.to_string()))?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| ClientError::Unreachable(error_chain(&e)))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| ClientError::Unreachable(e.to_string()))?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| ClientError::Unreachable(format!("no answer within {:?}", self.timeout)))?
    }

    /// Like [`ApiClient::call`], requiring a 2xx answer and parsing it.
    pub async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        token: &str,
        body: Option<&Value>,
    ) -> Result<T, ClientError> {
        let what = format!("{method} {path}");
        let (status, bytes) = self.call(method, path, token, body).await?;
        if !status.is_success() {
            let body = String::from_utf8_lossy(&bytes).into_owned();
            return Err(ClientError::Refused { what, status, body });
        }
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Answer {
            what,
            reason: e.to_string(),
        })
    }
}
