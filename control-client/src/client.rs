//! A minimal JSON client of the management API (faden's or GPUStack's `/v2`): what the worker
//! agent and `faden up` call it with.
//!
//! Given several server URLs (servers sharing one database), a call that cannot reach one is
//! tried on the others in turn, and the client stays on the one that answered.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    #[error("no server URL given")]
    NoUrl,
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

/// `server_url` without a trailing slash, if it is an `http(s)://host…` URL (`https` only
/// `with_tls`).
fn check_url(server_url: &str, with_tls: bool) -> Result<String, ClientError> {
    let base = server_url.trim().trim_end_matches('/').to_owned();
    let rest = base
        .strip_prefix("http://")
        .or_else(|| base.strip_prefix("https://"));
    if rest.is_none_or(str::is_empty) {
        return Err(ClientError::Url(server_url.to_owned()));
    }
    if base.starts_with("https://") && !with_tls {
        return Err(ClientError::NoTls(server_url.to_owned()));
    }
    Ok(base)
}

/// A minimal JSON client of the management API.
#[derive(Clone, Debug)]
pub struct ApiClient {
    /// The server URLs, without a trailing slash.
    bases: Arc<[String]>,
    /// Index in `bases` of the URL calls go to first: the last one that answered.
    current: Arc<AtomicUsize>,
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
        Self::with_urls(&[server_url], tls)
    }

    /// A client of several servers sharing one database, tried in turn (see
    /// [`ApiClient::call`]); `tls` serves the `https` ones.
    pub fn with_urls(
        server_urls: &[impl AsRef<str>],
        tls: Option<Arc<ClientConfig>>,
    ) -> Result<Self, ClientError> {
        let bases = server_urls
            .iter()
            .map(|url| check_url(url.as_ref(), tls.is_some()))
            .collect::<Result<Arc<[String]>, _>>()?;
        if bases.is_empty() {
            return Err(ClientError::NoUrl);
        }
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(20))
            .build(ApiConnector::new(http, tls));
        Ok(Self {
            bases,
            current: Arc::new(AtomicUsize::new(0)),
            client,
            timeout: Duration::from_secs(15),
        })
    }

    /// The server URL calls go to first: the last one that answered.
    pub fn base(&self) -> &str {
        &self.bases[self.current.load(Ordering::Relaxed)]
    }

    /// Every server URL, in the order they are tried.
    pub fn urls(&self) -> &[String] {
        &self.bases
    }

    /// Sends a JSON request with `token`; returns status and body.
    ///
    /// A server that cannot be reached (refused, reset, timed out: not an HTTP error answer) is
    /// left for the next URL, each tried once; the one that answers is used from then on, by
    /// every clone of this client. A `POST` goes to the next URL only if it was never sent (the
    /// connection failed): one lost after sending may have been applied, and is not repeated.
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
        let first = self.current.load(Ordering::Relaxed);
        let mut unreachable = ClientError::NoUrl;
        for step in 0..self.bases.len() {
            let at = (first + step) % self.bases.len();
            let base = &self.bases[at];
            let (answer, sent) = self
                .call_at(base, method.clone(), path, token, body.clone())
                .await;
            match answer {
                Err(ClientError::Unreachable(e)) if !sent || method.is_idempotent() => {
                    tracing::debug!(server = %base, error = %e, "server unreachable");
                    unreachable = ClientError::Unreachable(format!("{base}: {e}"));
                }
                answer => {
                    if at != first {
                        tracing::info!(server = %base, "using another server");
                        self.current.store(at, Ordering::Relaxed);
                    }
                    return answer;
                }
            }
        }
        Err(unreachable)
    }

    async fn call_at(
        &self,
        base: &str,
        method: Method,
        path: &str,
        token: &str,
        body: Bytes,
    ) -> (Result<(StatusCode, Bytes), ClientError>, bool) {
        let request = Request::builder()
            .method(method)
            .uri(format!("{base}{path}"))
            .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body));
        let request = match request {
            Ok(request) => request,
            Err(e) => return (Err(ClientError::Url(e.to_string())), false),
        };
        // Whether the request may have reached the server: anything but a failed connect.
        let mut sent = true;
        let exchange = async {
            let response = self.client.request(request).await.map_err(|e| {
                sent = !e.is_connect();
                ClientError::Unreachable(error_chain(&e))
            })?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| ClientError::Unreachable(e.to_string()))?
                .to_bytes();
            Ok((status, body))
        };
        let answer = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| ClientError::Unreachable(format!("no answer within {:?}", self.timeout)))
            .and_then(|answer| answer);
        (answer, sent)
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
