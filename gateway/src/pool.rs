//! The plain-HTTP upstream pool: HTTP/1.1 connections on hyper's low-level
//! `client::conn::http1`, driven by the request that uses them.
//!
//! hyper-util's legacy `Client` runs every connection in a task of its own: a request crosses
//! from the handler's task to the connection's task through a channel, its response comes back
//! through a oneshot, every body chunk through another channel, and the connection goes back to
//! the pool through one more spawned task per request. Each hop is a wake-up, often of the other
//! runtime worker. Here a [`Lease`] (the `SendRequest` and its `Connection` future together) is
//! polled by the task that sends the request and then by the response body
//! ([`crate::body::ProxyBody`]): the request, its response and every chunk move within one task,
//! with no extra wake-up and no task per request.
//!
//! Behaviour kept from the legacy pool:
//! - keep-alive with the most recently used connection first, at most `max_idle` idle
//!   connections per upstream address, idle ones closed after `idle_timeout` (kept below the
//!   engines' own keep-alive so reuse does not race their close, GPUStack #4419);
//! - a request that never left (the pooled connection was closed by the upstream meanwhile) is
//!   retried on another connection, and only then;
//! - `Host` from the URI, origin-form request target, `TCP_NODELAY`, a connect timeout;
//! - a connection is reused only after its response body was read to the end; dropping a body
//!   before that closes the connection, which is how a client disconnect cancels the upstream
//!   work.
//!
//! An idle connection is not polled: a close by the upstream is noticed when the connection is
//! next checked out (its `Connection` future then ends) or when the reaper drops it.

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery};
use http::{HeaderValue, Request, Response, Uri, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::error::{BoxError, ErrorKind, GatewayError};
use crate::hash::FxBuild;

type Io = TokioIo<TcpStream>;

/// Pool settings.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PoolConfig {
    pub(crate) connect_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) max_idle: usize,
}

/// What a pooled connection's request bodies must be: the gateway sends buffered bodies
/// (`Full<Bytes>`), the worker proxy streams its client's body (`Incoming`).
pub(crate) trait RequestBody:
    http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static
{
}

impl<B> RequestBody for B where
    B: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static
{
}

/// Idle connections by authority (`host:port`). Clones share the pool.
#[derive(Clone, Debug)]
pub(crate) struct Pool<B: RequestBody = Full<Bytes>> {
    inner: Arc<PoolInner<B>>,
}

#[derive(Debug)]
struct PoolInner<B: RequestBody> {
    config: PoolConfig,
    idle: Mutex<HashMap<Arc<str>, Vec<Idle<B>>, FxBuild>>,
    reaper: AtomicBool,
}

#[derive(Debug)]
struct Idle<B: RequestBody> {
    conn: Box<Conn<B>>,
    since: Instant,
}

/// One upstream connection: the request half and the connection future that does its IO.
struct Conn<B: RequestBody> {
    sender: http1::SendRequest<B>,
    conn: http1::Connection<Io, B>,
    /// The connection future finished (closed, or failed).
    done: bool,
    key: Arc<str>,
}

impl<B: RequestBody> std::fmt::Debug for Conn<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("key", &self.key)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl<B: RequestBody> Conn<B> {
    /// Polls the connection future (reads and writes whatever is due). Never blocks.
    fn drive(&mut self, cx: &mut Context<'_>) {
        if self.done {
            return;
        }
        if let Poll::Ready(result) = Pin::new(&mut self.conn).poll(cx) {
            self.done = true;
            if let Err(e) = result {
                tracing::debug!(error = %e, upstream = %self.key, "upstream connection failed");
            }
        }
    }

    /// Sends `req` and waits for the response head, driving the connection meanwhile.
    async fn send(&mut self, req: Request<B>) -> Result<Response<Incoming>, SendError<B>> {
        // A reused connection becomes ready once its previous response is fully processed,
        // which takes a poll of the connection; a closed one ends here.
        let ready = poll_fn(|cx| {
            self.drive(cx);
            match self.sender.poll_ready(cx) {
                Poll::Ready(Ok(())) => Poll::Ready(true),
                Poll::Ready(Err(_)) => Poll::Ready(false),
                Poll::Pending if self.done => Poll::Ready(false),
                Poll::Pending => Poll::Pending,
            }
        })
        .await;
        if !ready {
            return Err(SendError::Unsent(req));
        }
        let mut response = pin!(self.sender.try_send_request(req));
        poll_fn(|cx| {
            self.drive(cx);
            response.as_mut().poll(cx)
        })
        .await
        .map_err(|mut e| match e.take_message() {
            Some(req) => SendError::Unsent(req),
            None => SendError::Failed(e.into_error()),
        })
    }
}

// Not boxed: the request comes back only on the rare retry path, and boxing it would cost an
// allocation on every request.
#[allow(clippy::large_enum_variant)]
enum SendError<B> {
    /// The request never left: another connection may take it.
    Unsent(Request<B>),
    Failed(hyper::Error),
}

/// A connection lent to one request until its response body ends.
///
/// Whoever holds it must [`Lease::drive`] it while waiting for body data (the connection has
/// no task of its own). [`Lease::release`] after the end of the body returns it to the pool;
/// dropping it closes the connection.
#[derive(Debug)]
pub(crate) struct Lease<B: RequestBody = Full<Bytes>> {
    /// Boxed: the connection state is large, and leases move through several futures and
    /// the response body.
    conn: Box<Conn<B>>,
    pool: Weak<PoolInner<B>>,
}

impl<B: RequestBody> Lease<B> {
    /// Reads and writes whatever is due on the connection, registering for more.
    pub(crate) fn drive(&mut self, cx: &mut Context<'_>) {
        self.conn.drive(cx);
    }

    /// Back to the pool, once the response body was read to the end.
    pub(crate) fn release(self) {
        if self.conn.done {
            return;
        }
        if let Some(pool) = self.pool.upgrade() {
            pool.put(self.conn);
        }
    }

    /// Drives the connection in a task of its own until the response is complete, then
    /// returns it to the pool: for callers that take a plain `Response<Incoming>`.
    pub(crate) fn detach(mut self) {
        tokio::spawn(async move {
            let idle = poll_fn(|cx| {
                self.conn.drive(cx);
                if self.conn.done {
                    return Poll::Ready(false);
                }
                match self.conn.sender.poll_ready(cx) {
                    Poll::Ready(ready) => Poll::Ready(ready.is_ok()),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            if idle {
                self.release();
            }
        });
    }
}

/// A response body that drives its pooled connection while it is read, and returns the
/// connection to the pool at its end (dropped early, it closes the connection instead, which
/// cancels the work upstream). For callers without [`crate::body::ProxyBody`]'s deadlines.
#[derive(Debug)]
pub(crate) struct LeasedBody<B: RequestBody> {
    inner: Incoming,
    lease: Option<Lease<B>>,
}

impl<B: RequestBody> LeasedBody<B> {
    pub(crate) fn new(inner: Incoming, lease: Option<Lease<B>>) -> Self {
        Self { inner, lease }
    }

    /// Closes the connection instead of pooling it (its state is unknown after a failure).
    pub(crate) fn discard_lease(&mut self) {
        self.lease = None;
    }

    /// Drives `lease` while streaming.
    pub(crate) fn set_lease(&mut self, lease: Option<Lease<B>>) {
        self.lease = lease;
    }
}

impl<B: RequestBody> Drop for LeasedBody<B> {
    fn drop(&mut self) {
        // hyper stops polling a body once `is_end_stream` says it is complete, so the end is
        // usually seen here rather than as a final `None`.
        if http_body::Body::is_end_stream(&self.inner) {
            if let Some(lease) = self.lease.take() {
                lease.release();
            }
        }
    }
}

impl<B: RequestBody> http_body::Body for LeasedBody<B> {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let mut polled = Pin::new(&mut this.inner).poll_frame(cx);
        if polled.is_pending() {
            if let Some(lease) = &mut this.lease {
                lease.drive(cx);
                polled = Pin::new(&mut this.inner).poll_frame(cx);
            }
        }
        match &polled {
            Poll::Ready(None) => {
                if let Some(lease) = this.lease.take() {
                    lease.release();
                }
            }
            Poll::Ready(Some(Err(_))) => this.lease = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl<B: RequestBody> Pool<B> {
    pub(crate) fn new(config: PoolConfig) -> Self {
        Self {
            inner: Arc::new(PoolInner {
                config,
                idle: Mutex::new(HashMap::default()),
                reaper: AtomicBool::new(false),
            }),
        }
    }

    /// Sends `req` (absolute `http://` URI) and returns the response head with the connection
    /// its body comes on.
    pub(crate) async fn send(
        &self,
        mut req: Request<B>,
    ) -> Result<(Response<Incoming>, Lease<B>), GatewayError> {
        let Some(authority) = req.uri().authority().cloned() else {
            return Err(GatewayError::new(
                ErrorKind::UpstreamConnect,
                "the model instance has an invalid address",
            ));
        };
        req.headers_mut()
            .entry(header::HOST)
            .or_insert_with(|| host_header(&authority));
        let path = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        *req.uri_mut() = Uri::from(path);

        // Idle connections first, newest first; a request one of them could not take (the
        // upstream had closed it) goes to the next.
        while let Some(mut conn) = self.inner.checkout(authority.as_str()) {
            match conn.send(req).await {
                Ok(resp) => return Ok((resp, self.lease(conn))),
                Err(SendError::Unsent(r)) => req = r,
                Err(SendError::Failed(e)) => return Err(failed(e)),
            }
        }
        let mut conn = self.connect(&authority).await?;
        match conn.send(req).await {
            Ok(resp) => Ok((resp, self.lease(conn))),
            Err(SendError::Unsent(_)) => Err(GatewayError::new(
                ErrorKind::UpstreamProtocol,
                "the model instance closed a new connection before the request was sent",
            )),
            Err(SendError::Failed(e)) => Err(failed(e)),
        }
    }

    fn lease(&self, conn: Box<Conn<B>>) -> Lease<B> {
        Lease {
            conn,
            pool: Arc::downgrade(&self.inner),
        }
    }

    async fn connect(&self, authority: &Authority) -> Result<Box<Conn<B>>, GatewayError> {
        let connect_error = |e: std::io::Error| {
            GatewayError::new(
                ErrorKind::UpstreamConnect,
                "could not connect to the model instance",
            )
            .with_cause(e)
        };
        let host = authority.host();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let port = authority.port_u16().unwrap_or(80);
        let stream = match tokio::time::timeout(
            self.inner.config.connect_timeout,
            TcpStream::connect((host, port)),
        )
        .await
        {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return Err(connect_error(e)),
            Err(_) => {
                return Err(connect_error(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "connect timed out",
                )));
            }
        };
        let _ = stream.set_nodelay(true);
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| {
                GatewayError::new(
                    ErrorKind::UpstreamConnect,
                    "could not connect to the model instance",
                )
                .with_cause(e)
            })?;
        self.start_reaper();
        Ok(Box::new(Conn {
            sender,
            conn,
            done: false,
            key: Arc::from(authority.as_str()),
        }))
    }

    /// Closes idle connections past the idle timeout even when no request comes.
    fn start_reaper(&self) {
        if self.inner.reaper.swap(true, Ordering::Relaxed) {
            return;
        }
        let pool = Arc::downgrade(&self.inner);
        let every = self
            .inner
            .config
            .idle_timeout
            .max(Duration::from_millis(100));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(pool) = pool.upgrade() else { break };
                pool.reap();
            }
        });
    }

    /// Idle connections (for tests).
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.inner.lock().values().map(Vec::len).sum()
    }
}

impl<B: RequestBody> PoolInner<B> {
    fn lock(&self) -> parking_lot::MutexGuard<'_, HashMap<Arc<str>, Vec<Idle<B>>, FxBuild>> {
        self.idle.lock()
    }

    /// The most recently used idle connection to `key` that has not timed out.
    fn checkout(&self, key: &str) -> Option<Box<Conn<B>>> {
        let expired;
        {
            let mut idle = self.lock();
            let list = idle.get_mut(key)?;
            match list.pop() {
                Some(entry) if entry.since.elapsed() < self.config.idle_timeout => {
                    return Some(entry.conn);
                }
                Some(entry) => {
                    // The newest one is too old, so are the others.
                    let mut rest = std::mem::take(list);
                    rest.push(entry);
                    expired = rest;
                }
                None => return None,
            }
        }
        // Closed outside the lock.
        drop(expired);
        None
    }

    fn put(&self, conn: Box<Conn<B>>) {
        let surplus = {
            let mut idle = self.lock();
            let list = match idle.get_mut(&*conn.key) {
                Some(list) => list,
                None => idle.entry(conn.key.clone()).or_default(),
            };
            list.push(Idle {
                conn,
                since: Instant::now(),
            });
            (list.len() > self.config.max_idle).then(|| list.remove(0))
        };
        drop(surplus);
    }

    fn reap(&self) {
        let mut expired = Vec::new();
        {
            let mut idle = self.lock();
            idle.retain(|_, list| {
                let keep_from = list
                    .iter()
                    .position(|e| e.since.elapsed() < self.config.idle_timeout)
                    .unwrap_or(list.len());
                expired.extend(list.drain(..keep_from));
                !list.is_empty()
            });
        }
        drop(expired);
    }
}

/// `Host` for an `http://` authority: the port only when it is not 80 (as hyper-util's client).
fn host_header(authority: &Authority) -> HeaderValue {
    let value = match authority.port_u16() {
        Some(port) if port != 80 => HeaderValue::from_str(authority.as_str()),
        _ => HeaderValue::from_str(authority.host()),
    };
    value.unwrap_or_else(|_| HeaderValue::from_static(""))
}

fn failed(e: hyper::Error) -> GatewayError {
    GatewayError::new(
        ErrorKind::UpstreamProtocol,
        "the model instance failed before answering",
    )
    .with_cause(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn config() -> PoolConfig {
        PoolConfig {
            connect_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(3),
            max_idle: 2,
        }
    }

    /// A server that answers every request on a connection with `body`, then optionally
    /// closes; counts connections.
    async fn server(
        close_after_one: bool,
    ) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = conns.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut seen = Vec::new();
                    loop {
                        let n = match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        seen.extend_from_slice(&buf[..n]);
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&seen[..end]).to_string();
                            seen.drain(..end + 4);
                            let host = head
                                .lines()
                                .find_map(|l| l.strip_prefix("host: "))
                                .unwrap_or("-")
                                .to_owned();
                            let target = head.split(' ').nth(1).unwrap_or("").to_owned();
                            let body = format!("{target} {host}");
                            let resp = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                                body.len()
                            );
                            s.write_all(resp.as_bytes()).await.unwrap();
                            if close_after_one {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, conns)
    }

    fn get(addr: std::net::SocketAddr, path: &str) -> Request<Full<Bytes>> {
        Request::get(format!("http://{addr}{path}"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    }

    async fn body_of(resp: Response<Incoming>, mut lease: Lease) -> String {
        let mut body = resp.into_body();
        let mut out = Vec::new();
        loop {
            let frame = poll_fn(|cx| match Pin::new(&mut body).poll_frame(cx) {
                Poll::Pending => {
                    lease.drive(cx);
                    Pin::new(&mut body).poll_frame(cx)
                }
                ready => ready,
            })
            .await;
            match frame {
                Some(f) => out.extend_from_slice(&f.unwrap().into_data().unwrap()),
                None => break,
            }
        }
        lease.release();
        String::from_utf8(out).unwrap()
    }

    #[tokio::test]
    async fn reuses_connections_with_host_and_origin_form() {
        let (addr, conns) = server(false).await;
        let pool = Pool::new(config());
        for i in 0..5 {
            let (resp, lease) = pool.send(get(addr, &format!("/v1/x?i={i}"))).await.unwrap();
            assert_eq!(body_of(resp, lease).await, format!("/v1/x?i={i} {addr}"));
        }
        assert_eq!(conns.load(Ordering::SeqCst), 1);
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn retries_unsent_requests_when_the_upstream_closed_the_idle_connection() {
        let (addr, conns) = server(true).await;
        let pool = Pool::new(config());
        for _ in 0..3 {
            let (resp, lease) = pool.send(get(addr, "/a")).await.unwrap();
            assert_eq!(body_of(resp, lease).await, format!("/a {addr}"));
            // Let the server's close arrive before the next checkout.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(conns.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn dropping_a_lease_closes_and_unread_bodies_are_not_pooled() {
        let (addr, conns) = server(false).await;
        let pool = Pool::new(config());
        let (resp, lease) = pool.send(get(addr, "/a")).await.unwrap();
        drop((resp, lease));
        assert_eq!(pool.idle_count(), 0);
        let (resp, lease) = pool.send(get(addr, "/b")).await.unwrap();
        assert_eq!(body_of(resp, lease).await, format!("/b {addr}"));
        assert_eq!(conns.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn keeps_at_most_max_idle_and_expires_idle_connections() {
        let (addr, conns) = server(false).await;
        let pool = Pool::new(PoolConfig {
            idle_timeout: Duration::from_millis(200),
            ..config()
        });
        let mut open = Vec::new();
        for _ in 0..3 {
            open.push(pool.send(get(addr, "/a")).await.unwrap());
        }
        for (resp, lease) in open {
            body_of(resp, lease).await;
        }
        assert_eq!(pool.idle_count(), 2);
        assert_eq!(conns.load(Ordering::SeqCst), 3);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(pool.idle_count(), 0, "reaped");
        let (resp, lease) = pool.send(get(addr, "/a")).await.unwrap();
        body_of(resp, lease).await;
        assert_eq!(conns.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn connect_failure_is_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let pool = Pool::new(config());
        let err = pool.send(get(addr, "/a")).await.unwrap_err();
        assert_eq!(err.kind, ErrorKind::UpstreamConnect);
    }
}
