#![allow(clippy::disallowed_methods)]

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::{Body, Frame};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::dial::host;
use super::*;
use crate::h1::body::BodyError;
use crate::h1::head::find_end;
use crate::h1::write::GATHER_MAX;
use http_body_util::{BodyExt as _, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn config() -> PoolConfig {
    PoolConfig {
        connect_timeout: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(3),
        max_idle: 2,
    }
}

/// A transport that counts its plain and vectored writes.
struct Counting {
    io: tokio::io::DuplexStream,
    plain: Arc<std::sync::atomic::AtomicUsize>,
    vectored: Arc<std::sync::atomic::AtomicUsize>,
}

impl AsyncRead for Counting {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counting {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.plain.fetch_add(1, Ordering::SeqCst);
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.vectored.fetch_add(1, Ordering::SeqCst);
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Sends a POST with a `len`-byte body over a [`Counting`] transport and returns what the
/// far end read and the (plain, vectored) write counts.
async fn post_counting(len: usize) -> (Vec<u8>, usize, usize) {
    let (near, mut far) = tokio::io::duplex(1 << 20);
    let plain = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let vectored = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let conn = Connection::new(
        Counting {
            io: near,
            plain: plain.clone(),
            vectored: vectored.clone(),
        },
        "k",
        Bytes::new(),
    );
    let body = Bytes::from(vec![b'x'; len]);
    let req = Request::post("http://k/v1/embeddings")
        .body(Full::new(body))
        .unwrap();
    let far_end = tokio::spawn(async move {
        let mut got = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = far.read(&mut buf).await.unwrap();
            got.extend_from_slice(&buf[..n]);
            let head_end = find_end(&got, 0);
            if head_end.is_some_and(|end| got.len() >= end + len) {
                break;
            }
        }
        far.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .await
            .unwrap();
        got
    });
    let pool = Pool::new(config());
    let prepared = Prepared::new(req).unwrap();
    let resp = pool
        .send_keyed("k", Some(conn), prepared, || async {
            Err(PoolError::new(PoolErrorKind::Connect, "no second dial"))
        })
        .await
        .unwrap();
    assert_eq!(body_of(resp).await, "ok");
    let got = far_end.await.unwrap();
    (
        got,
        plain.load(Ordering::SeqCst),
        vectored.load(Ordering::SeqCst),
    )
}

#[tokio::test]
async fn a_small_body_goes_out_with_its_head_in_one_plain_write() {
    let (got, plain, vectored) = post_counting(300).await;
    assert_eq!((plain, vectored), (1, 0));
    let text = String::from_utf8(got).unwrap();
    assert!(
        text.starts_with("POST /v1/embeddings HTTP/1.1\r\n"),
        "{text}"
    );
    assert!(text.contains("content-length: 300\r\n"), "{text}");
    assert!(
        text.ends_with(&format!("\r\n\r\n{}", "x".repeat(300))),
        "{text}"
    );
}

#[tokio::test]
async fn a_large_body_goes_out_vectored_uncopied() {
    let (got, plain, vectored) = post_counting(GATHER_MAX + 1).await;
    assert_eq!(plain, 0);
    assert!(vectored >= 1);
    let end = find_end(&got, 0).unwrap();
    assert_eq!(got.len(), end + GATHER_MAX + 1);
    assert!(got[end..].iter().all(|&b| b == b'x'));
}

#[tokio::test]
async fn a_request_is_flushed_out_of_a_buffering_transport() {
    // `BufWriter` keeps what is written until it is flushed, as a TLS stream keeps the
    // records a full socket did not take: without the flush, the request never leaves and
    // the exchange waits for an answer to it until its deadline.
    let (near, far) = tokio::io::duplex(1 << 16);
    let conn = Connection::new(tokio::io::BufWriter::new(near), "k", Bytes::new());
    let far_end = tokio::spawn(answer_ok_after(far, 0));
    let req = Request::get("http://k/v1/models")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(exchange_on(conn, req).await, "ok");
    let got = String::from_utf8(far_end.await.unwrap()).unwrap();
    assert!(got.starts_with("GET /v1/models HTTP/1.1\r\n"), "{got}");
}

#[tokio::test]
async fn a_flush_that_waits_is_polled_again() {
    // The whole request fits in the `BufWriter` (8 KiB), not in the 512-byte pipe behind
    // it: its flush returns pending until the far end reads, as a TLS stream's does when
    // the socket is full. The exchange must flush again when woken, though nothing is left
    // to write; otherwise the request's end stays in the buffer and the far end waits for
    // it until the exchange's deadline.
    let (near, far) = tokio::io::duplex(512);
    let conn = Connection::new(tokio::io::BufWriter::new(near), "k", Bytes::new());
    let body = vec![b'x'; 4096];
    let far_end = tokio::spawn(answer_ok_after(far, 4096));
    let req = Request::post("http://k/v1/embeddings")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    assert_eq!(exchange_on(conn, req).await, "ok");
    assert!(far_end.await.unwrap().len() > 4096);
}

/// The far end of a pipe: reads a request head and `body` bytes after it, answers `ok`,
/// and gives back what it read.
async fn answer_ok_after(mut far: tokio::io::DuplexStream, body: usize) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while find_end(&got, 0).is_none_or(|end| got.len() < end + body) {
        let n = far.read(&mut buf).await.unwrap();
        assert_ne!(n, 0, "closed before the whole request came");
        got.extend_from_slice(&buf[..n]);
    }
    far.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        .await
        .unwrap();
    got
}

/// One exchange of `req` on the given connection (never a dialled one), with a 10 s
/// deadline for the answer's head (a hang guard); the answer's body.
async fn exchange_on(conn: Connection, req: Request<Full<Bytes>>) -> String {
    let prepared = Prepared::new(req)
        .unwrap()
        .within(Instant::now() + Duration::from_secs(10));
    let no_dial = || async { Err(PoolError::new(PoolErrorKind::Connect, "no dial")) };
    let resp = Pool::new(config())
        .send_keyed("k", Some(conn), prepared, no_dial)
        .await
        .unwrap();
    body_of(resp).await
}

#[test]
fn host_leaves_out_the_default_port_of_the_scheme() {
    let host_of = |uri: &str| host(&uri.parse().unwrap()).to_owned();
    assert_eq!(host_of("http://10.0.0.1/v1/models"), "10.0.0.1");
    assert_eq!(host_of("http://10.0.0.1:80/v1/models"), "10.0.0.1");
    assert_eq!(host_of("http://10.0.0.1:443/v1/models"), "10.0.0.1:443");
    assert_eq!(host_of("https://10.0.0.1:443/v1/models"), "10.0.0.1");
    assert_eq!(host_of("https://10.0.0.1:80/v1/models"), "10.0.0.1:80");
    assert_eq!(host_of("https://[::1]:8443/v1/models"), "[::1]:8443");
    assert_eq!(host_of("/v1/models"), "");
}

/// A server that answers every request on a connection with its target and `Host`, then
/// optionally closes; counts connections. Requests for `/silent` get no answer.
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
                        if target == "/silent" {
                            continue;
                        }
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

const T: Duration = Duration::from_secs(10);

/// Waits until every idle connection is one checkout would retire: its upstream closed it
/// or sent bytes unasked (one of which the probe reads, as checkout's does).
async fn wait_idle_unusable(pool: &Pool) {
    testkit::wait_until(T, "the idle connections to be seen unusable", || {
        pool.inner
            .lock()
            .values_mut()
            .flatten()
            .all(|idle| !idle.conn.is_usable())
    })
    .await;
}

async fn body_of(resp: Response<PooledBody>) -> String {
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn reuses_connections_with_host_and_origin_form() {
    let (addr, conns) = server(false).await;
    let pool = Pool::new(config());
    for i in 0..5 {
        let resp = pool.send(get(addr, &format!("/v1/x?i={i}"))).await.unwrap();
        assert_eq!(body_of(resp).await, format!("/v1/x?i={i} {addr}"));
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1);
    assert_eq!(pool.idle_count(), 1);
}

#[tokio::test]
async fn a_late_head_fails_at_its_deadline_on_the_timer_the_connection_keeps() {
    let (addr, conns) = server(false).await;
    let pool = Pool::new(config());
    let send = |path: &str, deadline: Instant| {
        pool.send_as::<_, PooledBody>(get(addr, path), Some(deadline))
    };
    // The first exchange waits for its head, which leaves a timer on the connection.
    let resp = send("/a", Instant::now() + Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(body_of(resp).await, format!("/a {addr}"));
    assert!(
        pool.inner
            .lock()
            .values()
            .flatten()
            .all(|idle| idle.conn.timer.is_some())
    );
    // That timer fires while the connection idles; the next exchange, due later, moves it
    // rather than taking the old deadline for its own. Nothing waits on a socket meanwhile,
    // so tokio's clock can jump past the deadline.
    tokio::time::pause();
    tokio::time::advance(Duration::from_millis(200)).await;
    tokio::time::resume();
    let resp = send("/b", Instant::now() + Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(body_of(resp).await, format!("/b {addr}"));
    // A nearer deadline moves it earlier: the silent upstream's request fails at 200 ms,
    // not at the previous exchange's 30 s.
    let late = send("/silent", Instant::now() + Duration::from_millis(200));
    let err = tokio::time::timeout(Duration::from_secs(10), late)
        .await
        .expect("the deadline was not kept")
        .unwrap_err();
    assert_eq!(err.kind, PoolErrorKind::FirstByteTimeout);
    // The connection that timed out is closed, not pooled; the next request dials anew.
    assert_eq!(pool.idle_count(), 0);
    let resp = send("/c", Instant::now() + Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(body_of(resp).await, format!("/c {addr}"));
    assert_eq!(conns.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn retries_unsent_requests_when_the_upstream_closed_the_idle_connection() {
    let (addr, conns) = server(true).await;
    let pool = Pool::new(config());
    for _ in 0..3 {
        let resp = pool.send(get(addr, "/a")).await.unwrap();
        assert_eq!(body_of(resp).await, format!("/a {addr}"));
        // The server's close reaches the idle connection before the next checkout.
        wait_idle_unusable(&pool).await;
    }
    assert_eq!(conns.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn dropping_an_unread_body_closes_its_connection() {
    let (addr, conns) = server(false).await;
    let pool = Pool::new(config());
    let resp = pool.send(get(addr, "/a")).await.unwrap();
    drop(resp);
    assert_eq!(pool.idle_count(), 0);
    let resp = pool.send(get(addr, "/b")).await.unwrap();
    assert_eq!(body_of(resp).await, format!("/b {addr}"));
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
    for resp in open {
        body_of(resp).await;
    }
    assert_eq!(pool.idle_count(), 2);
    assert_eq!(conns.load(Ordering::SeqCst), 3);
    // The reaper runs on tokio's clock: past the idle timeout and its next tick at once,
    // with no socket waiting meanwhile. Only the reaper empties the pool here.
    tokio::time::pause();
    tokio::time::advance(Duration::from_millis(500)).await;
    testkit::wait_until(T, "the reaper to close the idle connections", || {
        pool.idle_count() == 0
    })
    .await;
    tokio::time::resume();
    let resp = pool.send(get(addr, "/a")).await.unwrap();
    body_of(resp).await;
    assert_eq!(conns.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn connect_failure_is_a_connect_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let pool = Pool::new(config());
    let err = pool.send(get(addr, "/a")).await.unwrap_err();
    assert_eq!(err.kind, PoolErrorKind::Connect);
}

/// A one-connection server: reads the request head (and a chunked body's end, when the
/// head announces one) into the returned channel, answers `response` after `delay`, then
/// closes when `close`.
async fn scripted(
    response: &'static [u8],
    close: bool,
) -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = vec![0u8; 4096];
                loop {
                    let n = match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    seen.extend_from_slice(&buf[..n]);
                    let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&seen[..end]).to_lowercase();
                    if head.contains("transfer-encoding: chunked") && !seen.ends_with(b"0\r\n\r\n")
                    {
                        continue;
                    }
                    let _ = tx.send(std::mem::take(&mut seen));
                    s.write_all(response).await.unwrap();
                    if close {
                        return;
                    }
                }
            });
        }
    });
    (addr, rx)
}

#[tokio::test]
async fn reads_chunked_until_close_and_bodiless_answers() {
    let pool = Pool::new(config());
    let (addr, _) = scripted(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
          5;ext=1\r\nhello\r\n1\r\n!\r\n0\r\ntrailer: x\r\n\r\n",
        false,
    )
    .await;
    for _ in 0..2 {
        let resp = pool.send(get(addr, "/c")).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(body_of(resp).await, "hello!");
    }
    assert_eq!(pool.idle_count(), 1, "chunked answers keep the connection");

    let (addr, _) = scripted(b"HTTP/1.0 200 OK\r\n\r\nuntil the end", true).await;
    let resp = pool.send(get(addr, "/u")).await.unwrap();
    assert!(resp.body().size_hint().exact().is_none());
    assert_eq!(body_of(resp).await, "until the end");

    let (addr, _) = scripted(b"HTTP/1.1 204 No Content\r\n\r\n", false).await;
    let resp = pool.send(get(addr, "/n")).await.unwrap();
    assert!(resp.body().is_end_stream());
    assert_eq!(
        pool.idle_count(),
        2,
        "a bodiless answer frees its connection at once"
    );

    let (addr, _) = scripted(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", false).await;
    let mut req = get(addr, "/h");
    *req.method_mut() = Method::HEAD;
    let resp = pool.send(req).await.unwrap();
    assert!(resp.body().is_end_stream());
}

#[tokio::test]
async fn truncated_and_ambiguous_answers_fail() {
    let pool = Pool::new(config());
    let (addr, _) = scripted(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", true).await;
    let resp = pool.send(get(addr, "/t")).await.unwrap();
    let err = resp.into_body().collect().await.unwrap_err();
    assert!(matches!(err, BodyError::Truncated), "{err:?}");

    let (addr, _) = scripted(
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n",
        false,
    )
    .await;
    let err = pool.send(get(addr, "/a")).await.unwrap_err();
    assert_eq!(err.kind, PoolErrorKind::Protocol);

    let (addr, _) = scripted(b"", true).await;
    let err = pool.send(get(addr, "/closed")).await.unwrap_err();
    assert_eq!(err.kind, PoolErrorKind::Protocol);
    assert_eq!(pool.idle_count(), 0);
}

#[tokio::test]
async fn connections_the_upstream_ends_or_taints_are_not_reused() {
    let pool = Pool::new(config());
    // `Connection: close`: the answer is read, the connection is not kept.
    let (addr, _) = scripted(
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
        false,
    )
    .await;
    let resp = pool.send(get(addr, "/close")).await.unwrap();
    assert_eq!(body_of(resp).await, "ok");
    assert_eq!(pool.idle_count(), 0);
    // Bytes after a complete answer: never read as the next answer.
    let (addr, _) = scripted(
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n\r\n",
        false,
    )
    .await;
    let resp = pool.send(get(addr, "/extra")).await.unwrap();
    assert_eq!(body_of(resp).await, "ok");
    assert_eq!(pool.idle_count(), 0);
    // Bytes sent on an idle connection unasked retire it at checkout.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    // The junk follows once the answer's connection is idle in the pool.
    let pooled = Arc::new(tokio::sync::Notify::new());
    let junk_after = pooled.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            let junk_after = junk_after.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = s.read(&mut buf).await;
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await
                    .unwrap();
                junk_after.notified().await;
                let _ = s.write_all(b"junk").await;
                let _ = s.read(&mut buf).await;
            });
        }
    });
    let resp = pool.send(get(addr, "/a")).await.unwrap();
    assert_eq!(body_of(resp).await, "ok");
    assert_eq!(pool.idle_count(), 1);
    pooled.notify_one();
    // The junk reaches the idle connection before the next checkout.
    wait_idle_unusable(&pool).await;
    let resp = pool.send(get(addr, "/b")).await.unwrap();
    assert_eq!(body_of(resp).await, "ok");
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "the tainted connection was not reused"
    );
}

/// A request body fed through a channel (a streamed client body, as the worker proxy
/// sends).
struct Streamed(tokio::sync::mpsc::Receiver<Bytes>);

impl Body for Streamed {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|d| d.map(|d| Ok(Frame::data(d))))
    }
}

#[tokio::test]
async fn streams_bodies_of_unknown_size_chunked() {
    let pool = Pool::new(config());
    let (addr, mut seen) = scripted(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", false).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let req = Request::post(format!("http://{addr}/s"))
        .body(Streamed(rx))
        .unwrap();
    let send = tokio::spawn({
        let pool = pool.clone();
        async move { body_of(pool.send(req).await.unwrap()).await }
    });
    for piece in ["ab", "", "cde"] {
        tx.send(Bytes::from(piece)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(tx);
    assert_eq!(send.await.unwrap(), "ok");
    let request = String::from_utf8(seen.recv().await.unwrap()).unwrap();
    assert!(
        request.starts_with("POST /s HTTP/1.1\r\nhost: 127.0.0.1:"),
        "{request}"
    );
    assert!(
        request.ends_with("transfer-encoding: chunked\r\n\r\n2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"),
        "{request}"
    );
    assert_eq!(pool.idle_count(), 1);
}

#[tokio::test]
async fn an_early_answer_ends_the_request_and_retires_the_connection() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 4096];
        let _ = s.read(&mut buf).await.unwrap();
        s.write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\n\r\nbig")
            .await
            .unwrap();
        // Keep the connection open without reading more (far longer than the test's bound:
        // an answer that came only at this close would fail it).
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
    let pool = Pool::new(config());
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(Bytes::from_static(b"first")).await.unwrap();
    let req = Request::post(format!("http://{addr}/big"))
        .body(Streamed(rx))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), pool.send(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 413);
    assert_eq!(body_of(resp).await, "big");
    assert_eq!(pool.idle_count(), 0, "the body was cut short");
    drop(tx);
}
