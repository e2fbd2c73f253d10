//! The management API as the sync client sees it: a list and a watch per resource.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::header::{ACCEPT, AUTHORIZATION, HeaderMap, HeaderValue};
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::timeout;

use super::decode::{self, Skipped};
use super::error::SessionError;
use super::resource::{Resource, ResourceKind};
use super::{SyncConfig, SyncError};
use crate::model::{REVISION_HEADER, WATCH_MODE_HEADER};
use crate::tls::ApiConnector;

/// Largest list answer read (128 MiB): ample for tens of thousands of GPUStack workers, whose
/// objects carry their whole hardware status, while still bounding memory.
const MAX_LIST_BYTES: usize = 128 * 1024 * 1024;
/// Largest error body kept for the log.
const MAX_ERROR_BODY_BYTES: usize = 4096;
/// How long to wait for an error body before logging without it.
const ERROR_BODY_TIMEOUT: Duration = Duration::from_secs(2);
/// Pooled connections idle longer than this are closed (list connections are reused).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// A complete list of one resource.
#[derive(Debug)]
pub(crate) struct Listed<T> {
    pub(crate) items: Vec<T>,
    /// Items that did not fit the wire type (see [`decode`]).
    pub(crate) skipped: Vec<Skipped>,
    /// `x-faden-revision` of the answer: where a watch can resume.
    pub(crate) revision: Option<u64>,
}

/// An open watch stream.
#[derive(Debug)]
pub(crate) struct Watch {
    pub(crate) body: Incoming,
    /// `x-faden-watch: snapshot`: the stream starts over with every object instead of resuming.
    pub(crate) snapshot: bool,
}

/// An HTTP client bound to one management API, served by one or several servers.
#[derive(Debug)]
pub(crate) struct Api {
    client: Client<ApiConnector, Empty<Bytes>>,
    /// `http(s)://host:port[/prefix]` of each server, without a trailing slash.
    bases: Vec<String>,
    /// Index in `bases` of the server new sessions go to.
    current: AtomicUsize,
    authorization: Option<HeaderValue>,
    request_timeout: Duration,
}

impl Api {
    pub(crate) fn new(config: &SyncConfig) -> Result<Self, SyncError> {
        let bases = config
            .base_urls
            .iter()
            .map(|url| base_url(url, config.tls.is_some()))
            .collect::<Result<Vec<_>, _>>()?;
        if bases.is_empty() {
            return Err(SyncError::InvalidConfig("no management API URL given"));
        }
        let authorization = bearer(&config.token)?;
        let client = client(
            config.request_timeout,
            config.tls.clone(),
            ResourceKind::ALL.len(),
        );
        Ok(Self {
            client,
            bases,
            current: AtomicUsize::new(0),
            authorization,
            request_timeout: config.request_timeout,
        })
    }

    /// The server (index) a new session goes to.
    pub(crate) fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    /// The base URL of server `at`.
    pub(crate) fn base(&self, at: usize) -> &str {
        &self.bases[at % self.bases.len()]
    }

    /// After a failure on server `at`, new sessions go to the next one. The tasks that failed
    /// on `at` together move it on once, not once each.
    pub(crate) fn move_on(&self, at: usize) {
        let next = (at + 1) % self.bases.len();
        let _ = self
            .current
            .compare_exchange(at, next, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// `GET /v2/<resource>?page=-1` (everything, on faden and GPUStack alike) on server `at`,
    /// body included, within the request timeout.
    pub(crate) async fn list<T: Resource>(&self, at: usize) -> Result<Listed<T>, SessionError> {
        let path = format!("/v2/{}?page=-1", T::KIND.path());
        timeout(self.request_timeout, self.list_at(at, &path))
            .await
            .map_err(|_| SessionError::Timeout(self.request_timeout))?
    }

    async fn list_at<T: Resource>(&self, at: usize, path: &str) -> Result<Listed<T>, SessionError> {
        let response = self.get_at(at, path).await?;
        let revision = revision(response.headers());
        let body = Limited::new(response.into_body(), MAX_LIST_BYTES)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<LengthLimitError>() {
                    SessionError::ListTooLarge(MAX_LIST_BYTES)
                } else {
                    SessionError::Body(e)
                }
            })?
            .to_bytes();
        let (items, skipped) = decode::list(&body).map_err(SessionError::ListDecode)?;
        Ok(Listed {
            items,
            skipped,
            revision,
        })
    }

    /// `GET /v2/<resource>?watch=true[&since=<revision>]` on server `at`: waits for the
    /// response head only (within the request timeout); the caller reads the body under its
    /// idle timeout.
    pub(crate) async fn watch(
        &self,
        at: usize,
        kind: ResourceKind,
        since: Option<u64>,
    ) -> Result<Watch, SessionError> {
        let mut path = format!("/v2/{}?watch=true", kind.path());
        if let Some(since) = since {
            let _ = write!(path, "&since={since}");
        }
        let response = timeout(self.request_timeout, self.get_at(at, &path))
            .await
            .map_err(|_| SessionError::Timeout(self.request_timeout))??;
        let snapshot = response
            .headers()
            .get(WATCH_MODE_HEADER)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"snapshot"));
        Ok(Watch {
            body: response.into_body(),
            snapshot,
        })
    }

    /// Sends a GET to the current server and turns any non-2xx answer into an error; a server
    /// that cannot be reached leaves the next call to the next one.
    pub(crate) async fn get(
        &self,
        path_and_query: &str,
    ) -> Result<Response<Incoming>, SessionError> {
        let at = self.current();
        let answer = self.get_at(at, path_and_query).await;
        if let Err(SessionError::Request(_)) = &answer {
            self.move_on(at);
        }
        answer
    }

    /// Sends a GET to server `at` and turns any non-2xx answer into an error.
    pub(crate) async fn get_at(
        &self,
        at: usize,
        path_and_query: &str,
    ) -> Result<Response<Incoming>, SessionError> {
        let mut request = Request::get(format!("{}{path_and_query}", self.base(at)))
            .header(ACCEPT, HeaderValue::from_static("application/json"));
        if let Some(authorization) = &self.authorization {
            request = request.header(AUTHORIZATION, authorization.clone());
        }
        let request = request
            .body(Empty::new())
            .map_err(SessionError::BuildRequest)?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(SessionError::Request)?;
        if response.status().is_success() {
            Ok(response)
        } else {
            Err(rejection(response).await)
        }
    }
}

/// An HTTP(S) client for the management API: `connect_timeout` per connection, at most
/// `max_idle` idle connections kept, each for [`POOL_IDLE_TIMEOUT`].
pub(crate) fn client(
    connect_timeout: Duration,
    tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    max_idle: usize,
) -> Client<ApiConnector, Empty<Bytes>> {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_max_idle_per_host(max_idle)
        .build(ApiConnector::new(http, tls))
}

/// The error for a non-2xx answer, with the start of its body for the log.
async fn rejection(response: Response<Incoming>) -> SessionError {
    let status = response.status();
    let body = Limited::new(response.into_body(), MAX_ERROR_BODY_BYTES).collect();
    let body = match timeout(ERROR_BODY_TIMEOUT, body).await {
        Ok(Ok(collected)) => {
            let bytes = collected.to_bytes();
            String::from_utf8_lossy(&bytes).trim().to_owned()
        }
        _ => String::new(),
    };
    if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
        SessionError::Auth { status, body }
    } else {
        SessionError::Status { status, body }
    }
}

fn revision(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(REVISION_HEADER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Checks the configured URL and returns it as `http(s)://authority[/prefix]`; `https` only
/// `with_tls`.
pub(crate) fn base_url(url: &str, with_tls: bool) -> Result<String, SyncError> {
    let invalid = |reason: &str| SyncError::InvalidUrl {
        url: url.to_owned(),
        reason: reason.to_owned(),
    };
    let uri: Uri = url
        .trim()
        .parse()
        .map_err(|e: http::uri::InvalidUri| invalid(&e.to_string()))?;
    let scheme = match uri.scheme_str() {
        Some(s) if s.eq_ignore_ascii_case("http") => "http",
        Some(s) if s.eq_ignore_ascii_case("https") && with_tls => "https",
        Some(s) if s.eq_ignore_ascii_case("https") => {
            return Err(SyncError::HttpsNeedsTls {
                url: url.to_owned(),
            });
        }
        Some(other) => {
            return Err(SyncError::UnsupportedScheme {
                url: url.to_owned(),
                scheme: other.to_owned(),
            });
        }
        None => return Err(invalid("missing scheme (expected http://host:port)")),
    };
    let authority = uri
        .authority()
        .ok_or_else(|| invalid("missing host (expected http://host:port)"))?;
    if authority.as_str().contains('@') {
        return Err(invalid(
            "credentials in the URL are not supported (use the token)",
        ));
    }
    if uri.query().is_some() {
        return Err(invalid("a query string is not supported"));
    }
    let prefix = uri.path().trim_end_matches('/');
    Ok(format!("{scheme}://{authority}{prefix}"))
}

/// `Authorization: Bearer <token>`, marked sensitive so that it never shows in debug output.
/// An empty token sends no header.
fn bearer(token: &str) -> Result<Option<HeaderValue>, SyncError> {
    if token.is_empty() {
        return Ok(None);
    }
    let mut value =
        HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| SyncError::InvalidToken)?;
    value.set_sensitive(true);
    Ok(Some(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_url_keeps_host_port_and_prefix() {
        assert_eq!(
            base_url("http://127.0.0.1:30080", false).unwrap(),
            "http://127.0.0.1:30080"
        );
        assert_eq!(
            base_url(" http://cp.example:8080/gpustack/ ", false).unwrap(),
            "http://cp.example:8080/gpustack"
        );
        assert_eq!(
            base_url("HTTP://[::1]:1/", false).unwrap(),
            "http://[::1]:1"
        );
        assert_eq!(
            base_url("https://cp.example/gpustack/", true).unwrap(),
            "https://cp.example/gpustack"
        );
    }

    #[test]
    fn base_url_rejects_what_it_cannot_serve() {
        assert!(matches!(
            base_url("https://cp:443", false),
            Err(SyncError::HttpsNeedsTls { .. })
        ));
        assert!(matches!(
            base_url("ftp://cp", false),
            Err(SyncError::UnsupportedScheme { .. })
        ));
        for bad in [
            "",
            "cp:30080",
            "/v2",
            "http://",
            "http://a b",
            "http://u:p@cp",
            "http://cp/?x=1",
        ] {
            assert!(
                matches!(base_url(bad, false), Err(SyncError::InvalidUrl { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn bearer_is_sensitive_and_validated() {
        let value = bearer("abc").unwrap().unwrap();
        assert_eq!(value, "Bearer abc");
        assert!(value.is_sensitive());
        assert_eq!(bearer("").unwrap(), None);
        assert!(matches!(bearer("a\nb"), Err(SyncError::InvalidToken)));
    }

    #[test]
    fn revision_header_is_optional() {
        let mut headers = HeaderMap::new();
        assert_eq!(revision(&headers), None);
        headers.insert(REVISION_HEADER, HeaderValue::from_static(" 42 "));
        assert_eq!(revision(&headers), Some(42));
        headers.insert(REVISION_HEADER, HeaderValue::from_static("x"));
        assert_eq!(revision(&headers), None);
    }
}
