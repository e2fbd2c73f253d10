//! Byte relays for connections taken over by `CONNECT`, and their drain at shutdown: the
//! worker proxy's instance relay and the proxy port's relays share this.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite};
use tokio::net::TcpStream;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::framing::H1Guard;
use crate::stop::StopSignal;

/// A byte stream a relay copies to and from.
pub trait RelayIo: AsyncRead + AsyncWrite + Unpin + Send {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + ?Sized> RelayIo for T {}

/// Takes a connection that hyper handed over (`hyper::upgrade::on`) back out of `Upgraded`
/// when it is of a kind the caller knows (with [`with_read_ahead`] for what hyper read past the
/// request), so that the relay reads and writes it directly: not through `Upgraded`'s boxed IO,
/// its read-ahead layer and two `TokioIo` adapters on every read and write. Any other kind
/// comes back as it was.
pub type TakeOver = fn(Upgraded) -> Result<Box<dyn RelayIo>, Upgraded>;

/// `io`, with `read_ahead` (bytes already read from it) served first.
pub fn with_read_ahead<T: RelayIo + 'static>(io: T, read_ahead: Bytes) -> Box<dyn RelayIo> {
    if read_ahead.is_empty() {
        return Box::new(io);
    }
    let (read, write) = tokio::io::split(io);
    let read = std::io::Cursor::new(read_ahead).chain(read);
    Box::new(tokio::io::join(read, write))
}

/// A socket this crate's listener served an HTTP/1 connection on, plain or TLS.
pub type ListenerSocket = Either<TcpStream, Box<tokio_rustls::server::TlsStream<TcpStream>>>;

/// The socket under a connection this crate's listener served with HTTP/1 and hyper handed over
/// (`CONNECT`, `Upgrade`), and the bytes hyper read past the request; `Upgraded` as it was when
/// it runs on something else. Reads and writes then reach the socket directly, not through
/// `Upgraded`'s boxed IO, its read-ahead layer and two `TokioIo` adapters.
pub fn take_socket(upgraded: Upgraded) -> Result<(ListenerSocket, Bytes), Upgraded> {
    let upgraded = match upgraded.downcast::<TokioIo<H1Guard<TcpStream>>>() {
        Ok(parts) => {
            return Ok((
                Either::Left(parts.io.into_inner().into_socket()),
                parts.read_buf,
            ));
        }
        Err(upgraded) => upgraded,
    };
    match upgraded.downcast::<TokioIo<H1Guard<tokio_rustls::server::TlsStream<TcpStream>>>>() {
        Ok(parts) => {
            let tls = Box::new(parts.io.into_inner().into_socket());
            Ok((Either::Right(tls), parts.read_buf))
        }
        Err(upgraded) => Err(upgraded),
    }
}

/// The connection IOs this crate's listener serves HTTP/1 connections on, taken back out of
/// `Upgraded` with their guard (the write-stall limit stays).
fn take_listener_io(upgraded: Upgraded) -> Result<Box<dyn RelayIo>, Upgraded> {
    let upgraded = match upgraded.downcast::<TokioIo<H1Guard<TcpStream>>>() {
        Ok(parts) => return Ok(with_read_ahead(parts.io.into_inner(), parts.read_buf)),
        Err(upgraded) => upgraded,
    };
    match upgraded.downcast::<TokioIo<H1Guard<tokio_rustls::server::TlsStream<TcpStream>>>>() {
        Ok(parts) => Ok(with_read_ahead(parts.io.into_inner(), parts.read_buf)),
        Err(upgraded) => Err(upgraded),
    }
}

/// The open relays of one listener. Cheap to clone; clones share.
#[derive(Clone, Debug, Default)]
pub struct Relays {
    tasks: TaskTracker,
    /// Ends the relays still open when the drain timeout is over.
    hard_stop: CancellationToken,
    /// Takes over connections of a kind this crate does not know (a tunnel's streams).
    take_over: Option<TakeOver>,
}

impl Relays {
    pub fn new() -> Self {
        Self::default()
    }

    /// Relays that also take connections of another kind out of `Upgraded` with `take_over`
    /// (the listener's own connections are always taken out).
    pub fn with_take_over(take_over: TakeOver) -> Self {
        Self {
            take_over: Some(take_over),
            ..Self::default()
        }
    }

    /// Spawns the relay of `req`'s connection: once hyper hands it over (after the 200 answer
    /// went out), bytes are copied both ways between it and `far` through one 8 KiB buffer per
    /// direction. Each direction's end (EOF) becomes a shutdown of the other side's write half
    /// (half-close passed on); an error on either side (a reset: the peer went away) ends
    /// both, which closes `far`.
    pub fn spawn<B, T>(&self, req: &mut Request<B>, far: T)
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let on_upgrade = hyper::upgrade::on(req);
        let stop = self.hard_stop.clone();
        let take_over = self.take_over;
        self.tasks.spawn(async move {
            let upgraded = match on_upgrade.await {
                Ok(u) => u,
                Err(e) => {
                    tracing::debug!(error = %e, "CONNECT: the connection was not handed over");
                    return;
                }
            };
            let mut near = near_side(upgraded, take_over);
            let mut far = far;
            let relay = tokio::io::copy_bidirectional(&mut near, &mut far);
            if let Some(Err(e)) = until_stopped(relay, &stop).await {
                tracing::debug!(error = %e, "CONNECT: relay ended with an error");
            }
        });
    }

    /// Relays open now (a draining worker waits for them).
    pub fn open(&self) -> usize {
        self.tasks.len()
    }

    /// Refuses new relays, waits up to `timeout` for the open ones to end, then ends the rest.
    pub async fn drain(&self, timeout: Duration, listener: &str) {
        self.tasks.close();
        if tokio::time::timeout(timeout, self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                listener,
                "drain timeout: closing the remaining CONNECT relays"
            );
        }
        self.hard_stop.cancel();
        self.tasks.wait().await;
    }
}

/// The near side of a relay: the connection itself when it is of a known kind, else
/// `Upgraded`.
fn near_side(upgraded: Upgraded, take_over: Option<TakeOver>) -> Box<dyn RelayIo> {
    let upgraded = match take_listener_io(upgraded) {
        Ok(io) => return io,
        Err(upgraded) => upgraded,
    };
    let upgraded = match take_over {
        Some(take) => match take(upgraded) {
            Ok(io) => return io,
            Err(upgraded) => upgraded,
        },
        None => upgraded,
    };
    Box::new(TokioIo::new(upgraded))
}

/// `work` to its end, or `None` once `stop` is cancelled (checked through [`StopSignal`]).
async fn until_stopped<F: Future>(work: F, stop: &CancellationToken) -> Option<F::Output> {
    tokio::pin!(work);
    StopSignal::new(stop.clone()).or_stopped(work).await
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::disallowed_methods
    )]

    use super::*;

    /// Serves `CONNECT`s on an HTTP/1-only listener (with TLS when given); each relay checks
    /// that its connection came out of `Upgraded`, reads the 5 bytes sent behind the request,
    /// and answers `taken` (or `wrapd` when the connection was left in `Upgraded`).
    async fn connect_listener(
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> (std::net::SocketAddr, CancellationToken) {
        use tokio::io::AsyncWriteExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let options = crate::listener::ServeOptions {
            tls,
            http1_only: true,
            upgrades: true,
            ..Default::default()
        };
        let handler = |mut req: Request<hyper::body::Incoming>, _peer| {
            let on_upgrade = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                let upgraded = on_upgrade.await.unwrap();
                let (mut io, answer): (Box<dyn RelayIo>, &[u8]) = match take_listener_io(upgraded) {
                    Ok(io) => (io, b"taken"),
                    Err(upgraded) => (Box::new(TokioIo::new(upgraded)), b"wrapd"),
                };
                let mut early = [0u8; 5];
                io.read_exact(&mut early).await.unwrap();
                assert_eq!(&early, b"early");
                io.write_all(answer).await.unwrap();
            });
            async { http::Response::new(http_body_util::Empty::<Bytes>::new()) }
        };
        let shutdown = CancellationToken::new();
        let config = crate::config::ListenerConfig::default();
        tokio::spawn({
            let shutdown = shutdown.clone();
            async move {
                crate::listener::serve_with(listener, &config, options, handler, shutdown, || {})
                    .await;
            }
        });
        (addr, shutdown)
    }

    /// Sends a `CONNECT` and 5 bytes behind it in one write; returns the relay's 5-byte answer.
    async fn connect_and_ask<S: AsyncRead + AsyncWrite + Unpin>(mut io: S) -> Vec<u8> {
        use tokio::io::AsyncWriteExt as _;
        io.write_all(b"CONNECT model-1-2.static:0 HTTP/1.1\r\nhost: x\r\n\r\nearly")
            .await
            .unwrap();
        let head = testkit::raw::read_head(&mut io).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let mut answer = [0u8; 5];
        io.read_exact(&mut answer).await.unwrap();
        answer.to_vec()
    }

    /// The listener's HTTP/1-only connections, plain and TLS, come back out of `Upgraded` as
    /// the connection itself, with the bytes hyper read past the request served first.
    #[tokio::test]
    async fn relays_take_the_listeners_connections_out_of_upgraded() {
        let (addr, shutdown) = connect_listener(None).await;
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert_eq!(connect_and_ask(tcp).await, b"taken");
        shutdown.cancel();

        let ca = testkit::certs::TestCa::new("splice test CA");
        let server = testkit::certs::server_config(&ca.server_cert(), None, &[b"http/1.1"]);
        let (addr, shutdown) = connect_listener(Some(server.into())).await;
        let client = testkit::certs::client_config(&ca, None, &[b"http/1.1"]);
        let tls = testkit::certs::connect(addr, client).await.unwrap();
        assert_eq!(connect_and_ask(tls).await, b"taken");
        shutdown.cancel();
    }

    #[tokio::test]
    async fn work_ends_on_its_own_or_when_stopped() {
        let stop = CancellationToken::new();
        assert_eq!(until_stopped(async { 7 }, &stop).await, Some(7));

        // Work that waits (and is polled again and again by wake-ups of its own) ends once
        // the token is cancelled, however late.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
        let waiting = tokio::spawn({
            let stop = stop.clone();
            async move { until_stopped(async move { while rx.recv().await.is_some() {} }, &stop).await }
        });
        for _ in 0..3 {
            tx.send(()).await.unwrap();
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished());
        stop.cancel();
        let out = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("stopped")
            .unwrap();
        assert_eq!(out, None);
        // Already cancelled: returns at once.
        assert_eq!(
            until_stopped(std::future::pending::<()>(), &stop).await,
            None
        );
    }
}
