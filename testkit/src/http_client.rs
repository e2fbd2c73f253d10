//! A minimal HTTP/1.1 client for tests: one call, whole reply, with JSON helpers, plus a
//! streaming variant for watch streams and SSE.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// A client bound to a base URL such as `http://127.0.0.1:40123`.
#[derive(Clone, Debug)]
pub struct Client {
    base: String,
    token: Option<String>,
    inner: HyperClient<HttpConnector, Full<Bytes>>,
}

/// A whole reply.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// The body as JSON (panics with the body text when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts the status, showing the body when it differs.
    #[track_caller]
    pub fn expect(self, status: u16) -> Self {
        assert_eq!(
            self.status.as_u16(),
            status,
            "unexpected status; body: {}",
            self.text()
        );
        self
    }
}

impl Client {
    /// A client for `base`, without credentials.
    pub fn new(base: impl Into<String>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let inner = HyperClient::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(2))
            .build(connector);
        Self {
            base: base.into().trim_end_matches('/').to_owned(),
            token: None,
            inner,
        }
    }

    /// The same client sending `Authorization: Bearer <token>`.
    pub fn with_token(&self, token: impl Into<String>) -> Self {
        Self {
            token: Some(token.into()),
            ..self.clone()
        }
    }

    /// The same client without credentials.
    pub fn anonymous(&self) -> Self {
        Self {
            token: None,
            ..self.clone()
        }
    }

    /// The base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn request(&self, method: Method, path: &str, body: Bytes) -> Request<Full<Bytes>> {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            builder = builder.header("authorization", format!("Bearer {t}"));
        }
        if !body.is_empty() {
            builder = builder.header("content-type", "application/json");
        }
        builder.body(Full::new(body)).unwrap()
    }

    /// Sends a request with a raw body and reads the whole reply (10 s bound).
    pub async fn send(&self, method: Method, path: &str, body: impl Into<Bytes>) -> Reply {
        let req = self.request(method, path, body.into());
        self.send_request(req).await
    }

    /// Sends a prepared request and reads the whole reply (10 s bound).
    pub async fn send_request(&self, req: Request<Full<Bytes>>) -> Reply {
        let fut = async {
            let resp = self.inner.request(req).await.expect("request failed");
            let (parts, body) = resp.into_parts();
            let body = body.collect().await.expect("reading body").to_bytes();
            Reply {
                status: parts.status,
                headers: parts.headers,
                body,
            }
        };
        tokio::time::timeout(Duration::from_secs(10), fut)
            .await
            .expect("request timed out")
    }

    /// Like [`Client::post`], but `None` instead of a panic when the connection fails.
    pub async fn try_post(&self, path: &str, body: &Value) -> Option<Reply> {
        let req = self.request(Method::POST, path, serde_json::to_vec(body).ok()?.into());
        let resp = self.inner.request(req).await.ok()?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.ok()?.to_bytes();
        Some(Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(Method::GET, path, Bytes::new()).await
    }

    pub async fn delete(&self, path: &str) -> Reply {
        self.send(Method::DELETE, path, Bytes::new()).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Reply {
        self.send(Method::POST, path, serde_json::to_vec(body).unwrap())
            .await
    }

    pub async fn put(&self, path: &str, body: &Value) -> Reply {
        self.send(Method::PUT, path, serde_json::to_vec(body).unwrap())
            .await
    }

    /// Starts a request and returns the response head with its body still streaming.
    pub async fn stream(&self, path: &str) -> http::Response<Incoming> {
        let req = self.request(Method::GET, path, Bytes::new());
        tokio::time::timeout(Duration::from_secs(10), self.inner.request(req))
            .await
            .expect("request timed out")
            .expect("request failed")
    }
}

/// Reads body frames until `until` returns true for the text received so far, or `limit` passes.
pub async fn read_until(
    body: &mut Incoming,
    buf: &mut String,
    limit: Duration,
    mut until: impl FnMut(&str) -> bool,
) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while !until(buf) {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    buf.push_str(&String::from_utf8_lossy(&data));
                }
            }
            _ => return until(buf),
        }
    }
    true
}
