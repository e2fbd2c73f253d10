//! Accepting connections: HTTP/1.1 and HTTP/2 prior knowledge on one port, TCP_NODELAY, a cap
//! on open connections, header read timeout and size limit, and draining on shutdown.
//!
//! Every accepted connection takes a pending slot of the listener's
//! [`crate::admission::Admission`] (caps in total and per source address) and must complete
//! its first request head within the header read timeout of the accept, first byte and TLS
//! handshake included; it is closed otherwise. A connection over a cap is refused at once (on
//! plain listeners with a canned 429/503 answer) and reported to [`ConnectionEvents`].
//!
//! With [`ServeOptions::tls`], every connection is TLS: the first byte and the whole handshake
//! must arrive within the header read timeout, ALPN picks `h2` or `http/1.1`, and a failed
//! handshake is logged at debug and reported to [`ConnectionEvents`]. Every HTTP/1 connection
//! (plain, or TLS without ALPN `h2`) reads through `framing::H1Guard`, which refuses
//! requests carrying both `Content-Length` and `Transfer-Encoding`.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use http::{Request, Response};
use http_body::Body;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::admission::Admission;
use crate::events::{ConnectionEvents, HandshakeFailure};

use crate::config::ListenerConfig;
use crate::framing::H1Guard;
use crate::h1::{self, ClientBody};
use crate::stop::StopSignal;

/// Optional parts of a listener.
#[derive(Clone, Default)]
pub struct ServeOptions {
    /// Terminate TLS on every connection (build it with [`crate::tls::server_config`]).
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// Told about failed handshakes and refused requests.
    pub events: Option<Arc<dyn ConnectionEvents>>,
    /// Serve HTTP/1 only (no HTTP/2 prior knowledge).
    pub http1_only: bool,
    /// Let handlers take over connections (`CONNECT`, `Upgrade`) with `hyper::upgrade::on`.
    pub upgrades: bool,
    /// Caps shared with the other listening sockets of the same port (one per core,
    /// [`crate::cores`]); `None`: this socket's own.
    pub shared: Option<SharedCaps>,
}

/// The pending-connection and open-connection caps of one port, shared by the sockets that
/// listen on it (a connection counts once, whichever core accepted it).
#[derive(Clone, Debug)]
pub struct SharedCaps {
    admission: Arc<Admission>,
    permits: Arc<Semaphore>,
}

impl SharedCaps {
    pub fn new(config: &ListenerConfig) -> Self {
        Self {
            admission: Arc::new(Admission::new(config.pending)),
            permits: Arc::new(Semaphore::new(config.max_connections.max(1))),
        }
    }
}

impl std::fmt::Debug for ServeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeOptions")
            .field("tls", &self.tls.is_some())
            .field("http1_only", &self.http1_only)
            .field("upgrades", &self.upgrades)
            .finish_non_exhaustive()
    }
}

/// Serves `handler` on every accepted connection until `shutdown` fires, then drains: stops
/// accepting, lets in-flight requests and streams finish for up to `drain_timeout`, and returns.
/// `on_drain` runs as soon as shutdown starts (the gateway uses it to fail `/readyz`).
pub async fn serve<H, Fut, B>(
    listener: TcpListener,
    config: &ListenerConfig,
    handler: H,
    shutdown: CancellationToken,
    on_drain: impl FnOnce(),
) where
    H: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_with(
        listener,
        config,
        ServeOptions::default(),
        handler,
        shutdown,
        on_drain,
    )
    .await;
}

/// [`serve`] with TLS and event reporting. Every connection is served by hyper.
pub async fn serve_with<H, Fut, B>(
    listener: TcpListener,
    config: &ListenerConfig,
    options: ServeOptions,
    handler: H,
    shutdown: CancellationToken,
    on_drain: impl FnOnce(),
) where
    H: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let hyper = HyperConns::new(config, &options);
    let conn = move |accepted: Accepted| hyper.clone().serve(accepted, handler.clone());
    accept_loop(listener, config, &options, shutdown, on_drain, conn).await;
}

/// [`serve_with`] for the gateway's front: plain HTTP/1 connections are served by the native
/// server of [`crate::h1`] (nothing held between requests but the socket), HTTP/2 prior
/// knowledge and TLS connections by hyper. Upgrades are not offered.
pub async fn serve_native<H, Fut, B>(
    listener: TcpListener,
    config: &ListenerConfig,
    options: ServeOptions,
    handler: H,
    shutdown: CancellationToken,
    on_drain: impl FnOnce(),
) where
    H: Fn(Request<ClientBody>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = bytes::Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let options = ServeOptions {
        upgrades: false,
        ..options
    };
    let hyper = HyperConns::new(config, &options);
    let settings = h1::conn::Settings {
        head_timeout: config.header_read_timeout,
        max_head: config.max_header_bytes,
        write_stall: config.write_stall_timeout,
    };
    let http1_only = options.http1_only;
    let conn = move |accepted: Accepted| {
        let hyper = hyper.clone();
        let handler = handler.clone();
        async move {
            let sniffed = match accepted.tls {
                Some(_) => Sniffed::Other,
                None => sniff(&accepted, http1_only).await,
            };
            match sniffed {
                Sniffed::Http1 => {}
                Sniffed::Other => {
                    // TLS, HTTP/2 prior knowledge, or too few bytes to tell: hyper, boxed so
                    // that its (large) connection state is no part of a native connection's
                    // task.
                    let handler = move |req: Request<Incoming>, peer| {
                        handler(req.map(ClientBody::Hyper), peer)
                    };
                    return Box::pin(hyper.serve(accepted, handler)).await;
                }
                Sniffed::Nothing => {
                    if let Some(events) = &accepted.events {
                        events.head_timeout();
                    }
                    return;
                }
                Sniffed::Closed => return,
            }
            let Accepted {
                stream,
                peer,
                permit: _permit,
                pending,
                stop,
                events,
                ..
            } = accepted;
            h1::conn::serve(
                stream,
                peer,
                &handler,
                settings,
                pending.deadline(),
                move || pending.release(),
                &stop,
                events.as_deref(),
            )
            .await;
        }
    };
    accept_loop(listener, config, &options, shutdown, on_drain, conn).await;
}

/// What the first bytes of a plain connection say.
enum Sniffed {
    /// Not (a prefix of) the HTTP/2 preface.
    Http1,
    /// The HTTP/2 preface or a prefix of it ("P" could still be "POST").
    Other,
    /// Nothing arrived before the first head's deadline.
    Nothing,
    /// The client closed, or the listener is shutting down.
    Closed,
}

/// Looks at the first bytes of a plain connection without consuming them.
async fn sniff(accepted: &Accepted, http1_only: bool) -> Sniffed {
    if http1_only {
        return Sniffed::Http1;
    }
    let mut first = [0u8; 24];
    let deadline = accepted.pending.deadline();
    let peeked = tokio::select! {
        () = accepted.stop.cancelled() => return Sniffed::Closed,
        p = tokio::time::timeout_at(deadline, accepted.stream.peek(&mut first)) => p,
    };
    match peeked {
        Err(_) => Sniffed::Nothing,
        Ok(Ok(n)) if n > 0 => {
            if may_be_h2(&first[..n]) {
                Sniffed::Other
            } else {
                Sniffed::Http1
            }
        }
        Ok(_) => Sniffed::Closed,
    }
}

/// Whether a plain connection's first bytes are (a prefix of) the HTTP/2 preface: "P" could
/// still be "POST", so only hyper's automatic builder can tell.
fn may_be_h2(first: &[u8]) -> bool {
    crate::framing::PREFACE.starts_with(first)
}

/// One accepted connection, admitted.
struct Accepted {
    stream: TcpStream,
    peer: SocketAddr,
    /// The connection's slot under `max_connections`, held until the connection ends.
    permit: OwnedSemaphorePermit,
    pending: Arc<crate::admission::Pending>,
    watcher: hyper_util::server::graceful::Watcher,
    stop: CancellationToken,
    tls: Option<tokio_rustls::TlsAcceptor>,
    events: Option<Arc<dyn ConnectionEvents>>,
}

/// Accepts connections until `shutdown` fires and spawns `conn` for each admitted one, then
/// drains: stops accepting, lets open connections finish for up to the drain timeout.
async fn accept_loop<C, Fut>(
    listener: TcpListener,
    config: &ListenerConfig,
    options: &ServeOptions,
    shutdown: CancellationToken,
    on_drain: impl FnOnce(),
    conn: C,
) where
    C: Fn(Accepted) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let SharedCaps { admission, permits } = options
        .shared
        .clone()
        .unwrap_or_else(|| SharedCaps::new(config));
    let graceful = GracefulShutdown::new();
    let mut conns = JoinSet::new();
    let local = listener.local_addr().ok();

    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let deadline = tokio::time::Instant::now() + config.header_read_timeout;
        let pending = match admission.try_admit(Some(peer.ip()), deadline) {
            Ok(p) => Arc::new(p),
            Err(refusal) => {
                tracing::debug!(%peer, %refusal, "connection refused");
                if options.tls.is_none() {
                    refusal.answer(&stream);
                }
                if let Some(events) = &options.events {
                    events.connection_refused(refusal);
                }
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let served = conn(Accepted {
            stream,
            peer,
            permit,
            pending,
            watcher: graceful.watcher(),
            stop: shutdown.clone(),
            tls: options.tls.clone(),
            events: options.events.clone(),
        });
        let span = tracing::debug_span!("conn", %peer);
        // Spawned as is: wrapping it in another async block would store it twice in the task.
        conns.spawn(served.instrument(span));
    }

    on_drain();
    drop(listener);
    tracing::info!(?local, open = conns.len(), "draining");
    let drained = tokio::time::timeout(config.drain_timeout, async {
        graceful.shutdown().await;
        while conns.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            open = conns.len(),
            "drain timeout: closing remaining connections"
        );
    }
    conns.shutdown().await;
}

/// Serves connections with hyper (HTTP/1 through [`H1Guard`], HTTP/2, TLS with ALPN).
#[derive(Clone)]
struct HyperConns {
    builder: Arc<Builder>,
    header_timeout: std::time::Duration,
    write_stall: Option<std::time::Duration>,
    upgrades: bool,
}

/// hyper's connection builders. HTTP/1 connections are served by the HTTP/1 builder itself, on
/// the connection's IO as it is, so that a connection handed over by `CONNECT` or `Upgrade`
/// comes back out of `Upgraded` as the socket it is ([`crate::relay::take_socket`]); the
/// automatic builder, which wraps the IO in a private type for its sniffing, serves HTTP/2 (and
/// a connection whose first bytes were too few to tell).
struct Builder {
    http1: hyper::server::conn::http1::Builder,
    /// `None` on HTTP/1-only listeners.
    auto: Option<auto::Builder<TokioExecutor>>,
}

impl HyperConns {
    fn new(config: &ListenerConfig, options: &ServeOptions) -> Self {
        let mut http1 = hyper::server::conn::http1::Builder::new();
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(config.header_read_timeout)
            .max_buf_size(config.max_header_bytes.max(8192))
            .keep_alive(true);
        let auto = (!options.http1_only).then(|| {
            let mut auto = auto::Builder::new(TokioExecutor::new());
            auto.http1()
                .timer(TokioTimer::new())
                .header_read_timeout(config.header_read_timeout)
                .max_buf_size(config.max_header_bytes.max(8192))
                .keep_alive(true);
            auto.http2()
                .timer(TokioTimer::new())
                .max_header_list_size(u32::try_from(config.max_header_bytes).unwrap_or(u32::MAX));
            auto
        });
        Self {
            builder: Arc::new(Builder { http1, auto }),
            header_timeout: config.header_read_timeout,
            write_stall: config.write_stall_timeout,
            upgrades: options.upgrades,
        }
    }

    async fn serve<H, Fut, B>(self, accepted: Accepted, handler: H)
    where
        H: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Response<B>> + Send + 'static,
        B: Body<Data = bytes::Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let Accepted {
            stream,
            peer,
            permit: _permit,
            pending,
            watcher,
            stop,
            tls,
            events,
        } = accepted;
        // A connection that sends nothing is closed after the header timeout (the protocol
        // sniffing of `auto` has no timeout of its own).
        tokio::select! {
            () = stop.cancelled() => return,
            ready = first_byte_within(&stream, self.header_timeout) => if !ready {
                if let Some(events) = &events {
                    events.head_timeout();
                }
                return;
            },
        }
        let slot = pending.clone();
        let service = service_fn(move |req| {
            // The first request head ends the pending phase.
            slot.release();
            let handler = handler.clone();
            async move { Ok::<_, Infallible>(handler(req, peer).await) }
        });
        let write_stall = self.write_stall;
        let Some(acceptor) = tls else {
            let mut first = [0u8; 24];
            let http1 = match stream.peek(&mut first).await {
                Ok(n) => !may_be_h2(&first[..n]),
                Err(_) => return,
            };
            let io = H1Guard::new(stream, events.clone()).with_write_stall(write_stall);
            let serve = serve_connection(
                &self.builder,
                http1,
                io,
                service,
                watcher,
                &stop,
                self.upgrades,
            );
            return guarded(&pending, serve, events.as_deref()).await;
        };
        // The handshake shares the header read timeout with the first byte.
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            r = tokio::time::timeout_at(pending.deadline(), acceptor.accept(stream)) => r,
        };
        let failure = match accepted {
            Ok(Ok(tls)) => {
                let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                let io = if h2 {
                    H1Guard::passthrough(tls).with_write_stall(write_stall)
                } else {
                    H1Guard::new(tls, events.clone()).with_write_stall(write_stall)
                };
                let serve = serve_connection(
                    &self.builder,
                    !h2,
                    io,
                    service,
                    watcher,
                    &stop,
                    self.upgrades,
                );
                return guarded(&pending, serve, events.as_deref()).await;
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "TLS handshake failed");
                HandshakeFailure::of(&e)
            }
            Err(_) => {
                tracing::debug!("TLS handshake timed out");
                HandshakeFailure::Timeout
            }
        };
        if let Some(events) = events {
            events.tls_handshake_failed(failure);
        }
    }
}

/// Runs a served connection, closing it when its first request head is not complete by the
/// pending slot's deadline.
async fn guarded(
    pending: &crate::admission::Pending,
    serve: impl Future<Output = ()>,
    events: Option<&dyn ConnectionEvents>,
) {
    if pending.guard(serve).await.is_none() {
        tracing::debug!("closed: no complete request head in time");
        if let Some(events) = events {
            events.head_timeout();
        }
    }
}

/// Serves one connection (plain or TLS) until it ends or the drain closes it: with the HTTP/1
/// builder when `http1` (or on HTTP/1-only listeners), else with the automatic one.
async fn serve_connection<I, S, B>(
    builder: &Builder,
    http1: bool,
    io: I,
    service: S,
    watcher: hyper_util::server::graceful::Watcher,
    stop: &CancellationToken,
    upgrades: bool,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let auto = builder.auto.as_ref().filter(|_| !http1);
    let result: Result<(), Box<dyn std::error::Error + Send + Sync>> = match auto {
        Some(auto) if upgrades => {
            let conn = auto.serve_connection_with_upgrades(TokioIo::new(io), service);
            watcher.watch(conn.into_owned()).await
        }
        Some(auto) => {
            let conn = auto.serve_connection(TokioIo::new(io), service);
            watcher.watch(conn.into_owned()).await
        }
        None if upgrades => {
            // hyper-util's graceful watcher does not take an upgradeable HTTP/1 connection:
            // the listener's stop signal starts its graceful shutdown instead (the drain
            // then waits for the connection's task as for any other).
            drop(watcher);
            let conn = builder
                .http1
                .serve_connection(TokioIo::new(io), service)
                .with_upgrades();
            tokio::pin!(conn);
            let served = StopSignal::new(stop.clone())
                .or_stopped(conn.as_mut())
                .await;
            match served {
                Some(result) => result,
                None => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            }
            .map_err(Into::into)
        }
        None => {
            let conn = builder.http1.serve_connection(TokioIo::new(io), service);
            watcher.watch(conn).await.map_err(Into::into)
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

async fn first_byte_within(stream: &TcpStream, timeout: std::time::Duration) -> bool {
    let mut buf = [0u8; 1];
    matches!(
        tokio::time::timeout(timeout, stream.peek(&mut buf)).await,
        Ok(Ok(n)) if n > 0
    )
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::disallowed_methods
    )]

    use std::time::Duration;

    use bytes::Bytes;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    const T: Duration = Duration::from_secs(10);

    /// HTTP/1-only listeners with upgrades run outside hyper-util's graceful watcher (hyper's
    /// own HTTP/1 builder): they drain like the others. At shutdown an idle keep-alive
    /// connection is closed, a request in flight is answered (with `connection: close`), and
    /// the listener returns.
    #[tokio::test]
    async fn http1_only_connections_drain_gracefully() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let options = ServeOptions {
            http1_only: true,
            upgrades: true,
            ..Default::default()
        };
        let slow_started = Arc::new(tokio::sync::Notify::new());
        let handler = {
            let slow_started = slow_started.clone();
            move |req: Request<Incoming>, _peer| {
                let slow_started = slow_started.clone();
                async move {
                    if req.uri().path() == "/slow" {
                        slow_started.notify_one();
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    Response::new(http_body_util::Full::new(Bytes::from_static(b"done")))
                }
            }
        };
        let shutdown = CancellationToken::new();
        let served = tokio::spawn({
            let shutdown = shutdown.clone();
            async move {
                let config = ListenerConfig::default();
                serve_with(listener, &config, options, handler, shutdown, || {}).await;
            }
        });

        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(b"GET /fast HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = [0u8; 512];
        let n = tokio::time::timeout(T, idle.read(&mut answer))
            .await
            .unwrap()
            .unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("done"),
            "{answer}"
        );

        let mut busy = TcpStream::connect(addr).await.unwrap();
        busy.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::timeout(T, slow_started.notified())
            .await
            .expect("the slow request never reached the handler");
        shutdown.cancel();

        let idle = testkit::raw::until_closed(&mut idle).await;
        assert_eq!(idle.as_deref(), Some(""), "idle connection not closed");
        let answer = testkit::raw::until_closed(&mut busy).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("connection: close"), "{answer}");
        assert!(answer.ends_with("done"), "{answer}");
        tokio::time::timeout(T, served).await.unwrap().unwrap();
    }
}
