//! The yamux connection, driven by its own task.
//!
//! rust-yamux is poll-driven: `poll_next_inbound` performs all reads and writes of the
//! connection, so one task owns the `Connection` and polls it without pause. Outbound streams are
//! requested over a channel ([`MuxHandle::open_stream`]); inbound streams go to an acceptor
//! channel, or are refused at once where the side does not accept streams (the server). The
//! task never waits on a single stream: a full acceptor channel refuses the new stream instead,
//! and slow readers are held back by their own stream windows only.
//!
//! A worker that leaves says so first ([`MuxHandle::go_away`]): it opens a stream, which the
//! server (the side that accepts none) reads as "open no more": its own opens fail at once
//! with [`TunnelError::GoingAway`] (a connect failure the gateway retries on another
//! instance), while the streams already open run to their end. yamux's own GoAway frame
//! cannot say this: it ends the connection.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use futures_util::io::AsyncWrite as _;
use net::stop::StopSignal;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot};
use tokio_util::compat::TokioAsyncReadCompatExt as _;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::error::TunnelError;

/// One multiplexed stream, as a tokio byte stream. Shutting down the write half sends a FIN
/// (half-close); dropping it resets the stream.
///
/// Not tokio-util's `Compat`: a futures-io read needs an initialised slice, and `Compat` zeroes
/// all of the reader's unfilled buffer on every read (an 8–64 KiB `memset` per read for a
/// pooled HTTP connection or a hyper reader, whatever the read brings; `memset` was the first
/// user-space item of the relay's profile). Here a read goes, in order of preference:
/// - straight into the reader's unfilled bytes when they are already initialised (a reader
///   that reuses its buffer, as tokio's copy does);
/// - else, up to 16 KiB, through a per-thread scratch buffer initialised once, and
///   only what was read is copied (hyper's readers hand over uninitialised memory on every
///   read: zeroing 4 KiB to receive a 100-byte message cost more than the message);
/// - else (large reads of a bulk transfer) into a zeroed window sized by the recent reads: it
///   doubles while reads fill it and shrinks when they stay small.
#[derive(Debug)]
pub struct TunnelStream {
    inner: yamux::Stream,
    window: usize,
}

/// Bounds of [`TunnelStream`]'s read window.
const MIN_READ_WINDOW: usize = 4 * 1024;
const MAX_READ_WINDOW: usize = 256 * 1024;
/// Reads up to this size go through the thread's scratch buffer.
const SCRATCH: usize = 16 * 1024;

thread_local! {
    static SCRATCH_BUF: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0; SCRATCH].into_boxed_slice());
}

impl TunnelStream {
    fn new(inner: yamux::Stream) -> Self {
        Self {
            inner,
            window: MIN_READ_WINDOW,
        }
    }

    fn poll_inner(&mut self, cx: &mut Context<'_>, into: &mut [u8]) -> Poll<io::Result<usize>> {
        futures_util::io::AsyncRead::poll_read(Pin::new(&mut self.inner), cx, into)
    }
}

impl AsyncRead for TunnelStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let want = buf.remaining().min(this.window);
        if want == 0 {
            return Poll::Ready(Ok(()));
        }
        // Unfilled bytes already initialised (a reader reusing its buffer) are read into in
        // place: `initialize_unfilled_to` zeroes only what is not. Otherwise a small read goes
        // through the scratch buffer.
        let initialised = buf.initialized().len() - buf.filled().len();
        let scratch = (initialised < want && want <= SCRATCH)
            .then(|| {
                SCRATCH_BUF.with(|scratch| {
                    let mut scratch = scratch.try_borrow_mut().ok()?;
                    Some(this.poll_inner(cx, &mut scratch[..want]).map_ok(|n| {
                        buf.put_slice(&scratch[..n]);
                        n
                    }))
                })
            })
            .flatten();
        let n = match scratch {
            Some(polled) => ready!(polled)?,
            None => {
                let n = ready!(this.poll_inner(cx, buf.initialize_unfilled_to(want)))?;
                buf.advance(n);
                n
            }
        };
        if n == want {
            this.window = (this.window * 2).min(MAX_READ_WINDOW);
        } else if n < this.window / 4 {
            this.window = (this.window / 2).max(MIN_READ_WINDOW);
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for TunnelStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_close(cx)
    }
}

/// The connection's byte stream as yamux sees it: flushes coalesced within a pass of the
/// connection task.
///
/// yamux flushes after every frame it writes. Passed through, each frame of each stream would
/// be a WebSocket message and a system call of its own, however many frames the task writes in
/// one pass. Here a flush that finds bytes written since the previous flush is answered at once
/// without flushing, and the bytes are owed. They go out at the first of:
/// - a flush that finds nothing new (yamux flushes at the top of every turn of its loop, so
///   the turn after a burst of writes flushes it);
/// - the end of the pass: yamux's pass ends only once its read of the connection is pending
///   (or once a write is, whose waker then brings the next pass), so a read that finds
///   nothing to read flushes what is owed before it answers `Pending`;
/// - [`FLUSH_AT`] unflushed bytes, past which a flush is never put off.
///
/// So frames written in one pass, for many streams under load, leave together, and a lone
/// frame leaves in the pass that wrote it. (Waking the task to flush in a pass of its own
/// costs a whole pass, about 2,400 instructions, for every lone frame.)
#[derive(Debug)]
struct Coalesce<T> {
    inner: T,
    /// Bytes written since the last flush that reached `inner`.
    unflushed: usize,
    /// `unflushed` when the last flush was put off.
    put_off_at: usize,
}

/// Unflushed bytes past which a flush goes through at once.
const FLUSH_AT: usize = 16 * 1024;

impl<T> Coalesce<T> {
    fn new(inner: T) -> Self {
        Self {
            inner,
            unflushed: 0,
            put_off_at: 0,
        }
    }
}

impl<T: AsyncWrite + Unpin> Coalesce<T> {
    fn flush_now(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
        self.unflushed = 0;
        self.put_off_at = 0;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for Coalesce<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let read = Pin::new(&mut this.inner).poll_read(cx, buf);
        if read.is_pending() && this.unflushed > 0 {
            // The end of the pass: what is owed goes out now. A flush that cannot finish has
            // registered the task for the connection's write readiness, which brings another
            // pass (and another flush) in time.
            if let Poll::Ready(Err(e)) = this.flush_now(cx) {
                return Poll::Ready(Err(e));
            }
        }
        read
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Coalesce<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let n = ready!(Pin::new(&mut this.inner).poll_write(cx, buf))?;
        this.unflushed += n;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.unflushed > this.put_off_at && this.unflushed < FLUSH_AT {
            this.put_off_at = this.unflushed;
            return Poll::Ready(Ok(()));
        }
        this.flush_now(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// yamux settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MuxConfig {
    /// Streams open at once on one tunnel, at most.
    pub max_streams: usize,
    /// Inbound streams waiting for their handler, at most (more are refused).
    pub accept_backlog: usize,
}

impl Default for MuxConfig {
    fn default() -> Self {
        Self {
            max_streams: 10_000,
            accept_backlog: 1024,
        }
    }
}

impl MuxConfig {
    fn yamux(&self) -> yamux::Config {
        // One more than asked for: the parked stream (see `drive`) takes a slot of its own.
        let streams = self.max_streams.max(1).saturating_add(1);
        // Every stream may hold at least the default 256 KiB window (yamux requires it); each
        // one auto-tunes beyond that towards its bandwidth-delay product while the connection
        // total allows. Memory is only used by data received and not yet read.
        let window = streams.saturating_mul(yamux::DEFAULT_CREDIT as usize);
        let mut config = yamux::Config::default();
        // Window first: yamux asserts window >= 256 KiB x streams on each setter.
        config.set_max_connection_receive_window(Some(window.max(1 << 30)));
        config.set_max_num_streams(streams);
        config
    }
}

/// Which end of the tunnel this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The server: opens streams, accepts none.
    Opener,
    /// The worker: accepts streams, opens none.
    Acceptor,
}

type OpenRequest = oneshot::Sender<Result<yamux::Stream, TunnelError>>;

/// Opens streams on a running tunnel, and closes it. Cheap to clone.
#[derive(Clone, Debug)]
pub struct MuxHandle {
    open: mpsc::UnboundedSender<OpenRequest>,
    close: CancellationToken,
    closed: CancellationToken,
    /// The peer said it is going away: no new streams.
    going_away: CancellationToken,
}

impl MuxHandle {
    /// Opens a new stream.
    pub async fn open_stream(&self) -> Result<TunnelStream, TunnelError> {
        if self.going_away.is_cancelled() {
            return Err(TunnelError::GoingAway);
        }
        let (tx, rx) = oneshot::channel();
        self.open.send(tx).map_err(|_| TunnelError::Closed)?;
        let stream = rx.await.map_err(|_| TunnelError::Closed)??;
        Ok(TunnelStream::new(stream))
    }

    /// The worker's go-away: tells the server to open no more streams on this tunnel (the
    /// open ones go on). Returns the signalling stream, to be held until the tunnel closes.
    pub async fn go_away(&self) -> Result<TunnelStream, TunnelError> {
        let (tx, rx) = oneshot::channel();
        self.open.send(tx).map_err(|_| TunnelError::Closed)?;
        let mut stream = rx.await.map_err(|_| TunnelError::Closed)??;
        // An empty write is one empty data frame: it carries the SYN that announces the stream.
        poll_fn(|cx| Pin::new(&mut stream).poll_write(cx, &[])).await?;
        Ok(TunnelStream::new(stream))
    }

    /// Whether the peer said it is going away (see [`MuxHandle::go_away`]).
    pub fn is_going_away(&self) -> bool {
        self.going_away.is_cancelled()
    }

    /// Asks the connection to close (a yamux GoAway, then the WebSocket close).
    pub fn close(&self) {
        self.close.cancel();
    }

    /// Whether the connection task has ended.
    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Resolves once the connection task has ended.
    pub async fn closed(&self) {
        self.closed.cancelled().await;
    }
}

/// A running multiplexed connection.
#[derive(Debug)]
pub struct Mux {
    pub handle: MuxHandle,
    /// Inbound streams (only for [`Role::Acceptor`]); call [`Inbound::accept`] on each.
    pub inbound: mpsc::Receiver<Inbound>,
    /// The connection task; it ends when the connection does.
    pub task: tokio::task::JoinHandle<Result<(), TunnelError>>,
}

/// The transport as yamux holds it: boxed, because yamux moves its whole connection state out
/// of the connection and back on every poll, and the WebSocket under it is about 550 bytes
/// (896-byte connection unboxed, 336 boxed; two such moves per poll, several polls per request).
type MuxIo<T> = Box<tokio_util::compat::Compat<Coalesce<T>>>;

/// How long a graceful close may take before the connection is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Starts the connection task over `io`.
pub fn spawn<T>(io: T, role: Role, config: &MuxConfig, span: tracing::Span) -> Mux
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (handle, inbound, connection) = start(io, role, config);
    // `Mux` keeps the handle; the task ends with the connection or when `Mux` closes it.
    let task = net::task::spawn(connection.instrument(span));
    Mux {
        handle,
        inbound,
        task,
    }
}

/// The connection over `io`, its handle and its inbound streams, with the future that drives
/// it (for [`spawn`] to run as a task).
fn start<T>(
    io: T,
    role: Role,
    config: &MuxConfig,
) -> (
    MuxHandle,
    mpsc::Receiver<Inbound>,
    impl Future<Output = Result<(), TunnelError>> + Send + 'static,
)
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mode = match role {
        Role::Opener => yamux::Mode::Client,
        Role::Acceptor => yamux::Mode::Server,
    };
    let io: MuxIo<T> = Box::new(Coalesce::new(io).compat());
    let connection = yamux::Connection::new(io, config.yamux(), mode);
    let (open_tx, open_rx) = mpsc::unbounded_channel();
    let (in_tx, in_rx) = mpsc::channel(config.accept_backlog.max(1));
    let close = CancellationToken::new();
    let closed = CancellationToken::new();
    let going_away = CancellationToken::new();
    let handle = MuxHandle {
        open: open_tx,
        close: close.clone(),
        closed: closed.clone(),
        going_away: going_away.clone(),
    };
    let run = async move {
        let _closed = closed.drop_guard();
        let result = drive(connection, role, open_rx, in_tx, close, going_away).await;
        match &result {
            Ok(()) => tracing::debug!("tunnel connection closed"),
            Err(e) => tracing::debug!(error = %e, "tunnel connection ended"),
        }
        result
    };
    (handle, in_rx, run)
}

async fn drive<T>(
    mut connection: yamux::Connection<T>,
    role: Role,
    mut open_rx: mpsc::UnboundedReceiver<OpenRequest>,
    in_tx: mpsc::Sender<Inbound>,
    close: CancellationToken,
    going_away: CancellationToken,
) -> Result<(), TunnelError>
where
    T: futures_util::io::AsyncRead + futures_util::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut waiting: VecDeque<OpenRequest> = VecDeque::new();
    // A stream of this side's own, opened at once and never written to, held until the
    // connection ends. yamux gathers the frames its streams send through a `SelectAll`, whose
    // `FuturesUnordered` wakes the task whenever one poll has polled every stream it holds and
    // all were pending. With one stream in use (one request at a time) that is every time a
    // frame went out: a whole extra pass of the connection for nothing, about 2,400
    // instructions per frame. The parked stream is never woken, so it is never polled again and
    // the count of polled streams stays below the count held. The peer never hears of it: yamux
    // announces a stream with its first frame, and this one sends none (it is dropped only
    // after the connection has ended). It costs one stream slot ([`MuxConfig::yamux`] adds
    // one), on the opener one of the 256 streams yamux lets wait for the peer's
    // acknowledgement (the worker acknowledges each stream at once, see `Inbound::accept`),
    // and about 1 KiB per tunnel (docs/benchmarks.md, "Tunnel beside rathole").
    let parked = match poll_fn(|cx| Poll::Ready(connection.poll_new_outbound(cx))).await {
        Poll::Ready(Ok(stream)) => Some(stream),
        _ => None,
    };
    // Checked on every pass: a flag read, not the token's lock.
    let mut close = StopSignal::new(close);
    // The waker the open requests' channel holds (from its last `Pending`): a send wakes the
    // task through it, so while the channel is empty and the task's waker the same, there is
    // no need to poll the channel (and register the waker again) on every pass.
    let mut open_waker: Option<Waker> = None;
    let outcome = poll_fn(|cx| {
        if close.poll(cx).is_ready() {
            return Poll::Ready(Ok(false));
        }
        // New open requests; callers that gave up are skipped.
        let registered = open_waker.as_ref().is_some_and(|w| w.will_wake(cx.waker()));
        if !registered || !open_rx.is_empty() {
            loop {
                match open_rx.poll_recv(cx) {
                    Poll::Ready(Some(request)) => waiting.push_back(request),
                    Poll::Ready(None) => {
                        open_waker = None;
                        break;
                    }
                    Poll::Pending => {
                        open_waker = Some(cx.waker().clone());
                        break;
                    }
                }
            }
        }
        while let Some(front) = waiting.front() {
            if front.is_closed() {
                waiting.pop_front();
                continue;
            }
            if going_away.is_cancelled() {
                if let Some(request) = waiting.pop_front() {
                    let _ = request.send(Err(TunnelError::GoingAway));
                }
                continue;
            }
            match connection.poll_new_outbound(cx) {
                Poll::Ready(Ok(stream)) => {
                    if let Some(request) = waiting.pop_front() {
                        // A caller gone meanwhile drops the stream, which resets it.
                        let _ = request.send(Ok(stream));
                    }
                }
                Poll::Ready(Err(e)) => {
                    let error = match e {
                        yamux::ConnectionError::TooManyStreams => TunnelError::TooManyStreams,
                        yamux::ConnectionError::Closed => TunnelError::Closed,
                        other => TunnelError::Mux(other),
                    };
                    if let Some(request) = waiting.pop_front() {
                        let _ = request.send(Err(error));
                    }
                }
                // The peer has not acknowledged enough streams yet: wait for it.
                Poll::Pending => break,
            }
        }
        // Drive the connection: every read and write happens here.
        loop {
            match connection.poll_next_inbound(cx) {
                Poll::Ready(Some(Ok(stream))) => {
                    if role == Role::Opener {
                        // The worker's go-away (this side accepts no streams otherwise).
                        if !going_away.is_cancelled() {
                            tracing::info!("the worker is going away: opening no more streams");
                            going_away.cancel();
                        }
                        drop(stream); // resets it
                        continue;
                    }
                    if in_tx.try_send(Inbound(Box::new(stream))).is_err() {
                        tracing::warn!("tunnel accept backlog full: refusing a stream");
                    }
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(TunnelError::Mux(e))),
                Poll::Ready(None) => return Poll::Ready(Ok(true)),
                Poll::Pending => return Poll::Pending,
            }
        }
    })
    .await;
    let ended = match outcome {
        Ok(true) => Ok(()),
        Ok(false) => {
            // Asked to close: say goodbye, but never wait on a stalled peer for long.
            let _ =
                tokio::time::timeout(CLOSE_GRACE, poll_fn(|cx| connection.poll_close(cx))).await;
            Ok(())
        }
        Err(e) => Err(e),
    };
    for request in waiting.drain(..) {
        let _ = request.send(Err(TunnelError::Closed));
    }
    open_rx.close();
    while let Ok(request) = open_rx.try_recv() {
        let _ = request.send(Err(TunnelError::Closed));
    }
    // Only now, with the connection done: dropped earlier, it would reset itself on the wire.
    drop(connection);
    drop(parked);
    ended
}

/// A stream the peer opened, not yet acknowledged. Boxed: the acceptor channel allocates its
/// slots in blocks of 32 up front, on every tunnel (even the server's, which accepts none), so
/// a slot is one pointer rather than a whole `yamux::Stream`.
#[derive(Debug)]
pub struct Inbound(Box<yamux::Stream>);

impl Inbound {
    /// Acknowledges the stream at once (an empty data frame with ACK), so that the opener's
    /// backlog of unacknowledged streams (256 in yamux) does not fill up while the handler waits
    /// for a slow answer, then hands it out.
    pub async fn accept(mut self) -> std::io::Result<TunnelStream> {
        // An empty write is exactly one empty data frame carrying the ACK flag.
        poll_fn(|cx| std::pin::Pin::new(&mut *self.0).poll_write(cx, &[])).await?;
        Ok(TunnelStream::new(*self.0))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::disallowed_methods
    )]

    use std::mem::MaybeUninit;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// Two muxes over an in-memory pipe, and one stream between them (both ends).
    pub(crate) async fn pair() -> (Mux, TunnelStream, TunnelStream) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let config = MuxConfig::default();
        let opener = spawn(a, Role::Opener, &config, tracing::Span::none());
        let acceptor = spawn(b, Role::Acceptor, &config, tracing::Span::none());
        let (out, inc) = connected(&opener.handle, acceptor).await;
        (opener, out, inc)
    }

    /// A stream opened through `opener`, and its other end taken from `acceptor`.
    async fn connected(opener: &MuxHandle, mut acceptor: Mux) -> (TunnelStream, TunnelStream) {
        let mut out = opener.open_stream().await.unwrap();
        // The stream reaches the acceptor with its first frame.
        out.write_all(b"x").await.unwrap();
        let mut inc = acceptor
            .inbound
            .recv()
            .await
            .unwrap()
            .accept()
            .await
            .unwrap();
        let mut one = [0u8; 1];
        inc.read_exact(&mut one).await.unwrap();
        (out, inc)
    }

    #[tokio::test]
    async fn a_go_away_stops_new_streams_and_keeps_the_open_ones() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let config = MuxConfig::default();
        let opener = spawn(a, Role::Opener, &config, tracing::Span::none());
        let acceptor = spawn(b, Role::Acceptor, &config, tracing::Span::none());
        let worker = acceptor.handle.clone();
        let (mut out, mut inc) = connected(&opener.handle, acceptor).await;
        let _signal = worker.go_away().await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !opener.handle.is_going_away() {
            assert!(tokio::time::Instant::now() < deadline, "no go-away seen");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(matches!(
            opener.handle.open_stream().await,
            Err(TunnelError::GoingAway)
        ));
        // The stream opened before carries on, both ways.
        out.write_all(b"ping").await.unwrap();
        let mut four = [0u8; 4];
        inc.read_exact(&mut four).await.unwrap();
        assert_eq!(&four, b"ping");
        inc.write_all(b"pong").await.unwrap();
        out.read_exact(&mut four).await.unwrap();
        assert_eq!(&four, b"pong");
        assert!(!opener.handle.is_closed());
    }

    /// Reads once into `buf` (whatever its initialised part) and returns what was read.
    async fn read_once(stream: &mut TunnelStream, buf: &mut ReadBuf<'_>) -> Vec<u8> {
        let before = buf.filled().len();
        poll_fn(|cx| Pin::new(&mut *stream).poll_read(cx, buf))
            .await
            .unwrap();
        buf.filled()[before..].to_vec()
    }

    /// yamux moves its connection state on every poll: the transport inside must stay boxed.
    #[test]
    fn yamux_connection_state_stays_small() {
        type Ws = crate::ws_io::WsIo<hyper_util::rt::TokioIo<hyper::upgrade::Upgraded>>;
        let unboxed =
            std::mem::size_of::<yamux::Connection<tokio_util::compat::Compat<Coalesce<Ws>>>>();
        let held = std::mem::size_of::<yamux::Connection<MuxIo<Ws>>>();
        assert!(
            held + 256 <= unboxed && held <= 512,
            "yamux connection {held} bytes (unboxed transport: {unboxed})"
        );
    }

    /// A writer that records what reached it and how often it was flushed.
    #[derive(Default)]
    struct Recorder {
        written: Vec<u8>,
        flushes: usize,
    }

    impl AsyncRead for Recorder {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Poll::Pending
        }
    }

    impl AsyncWrite for Recorder {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.get_mut().written.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.get_mut().flushes += 1;
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    struct Flag(std::sync::atomic::AtomicBool);

    impl std::task::Wake for Flag {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn flushes_of_one_pass_go_out_as_one() {
        let flag = std::sync::Arc::new(Flag(false.into()));
        let waker = std::task::Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let woken = || flag.0.swap(false, std::sync::atomic::Ordering::SeqCst);
        let mut io = Coalesce::new(Recorder::default());
        fn write(io: &mut Coalesce<Recorder>, cx: &mut Context<'_>, bytes: &[u8]) {
            let n = Pin::new(io).poll_write(cx, bytes);
            assert!(matches!(n, Poll::Ready(Ok(n)) if n == bytes.len()));
        }
        fn flush(io: &mut Coalesce<Recorder>, cx: &mut Context<'_>) {
            assert!(matches!(Pin::new(io).poll_flush(cx), Poll::Ready(Ok(()))));
        }
        fn read_pending(io: &mut Coalesce<Recorder>, cx: &mut Context<'_>) {
            let mut raw = [0u8; 16];
            let mut buf = ReadBuf::new(&mut raw);
            assert!(Pin::new(io).poll_read(cx, &mut buf).is_pending());
        }

        // Nothing written: a flush goes through.
        flush(&mut io, &mut cx);
        assert_eq!(io.inner.flushes, 1);
        // Two frames, each followed by yamux's flush: both put off, the task not woken.
        write(&mut io, &mut cx, b"frame one");
        flush(&mut io, &mut cx);
        write(&mut io, &mut cx, b"frame two");
        flush(&mut io, &mut cx);
        assert_eq!(io.inner.flushes, 1);
        // The pass ends on a read with nothing to read: both go out with one flush.
        read_pending(&mut io, &mut cx);
        assert_eq!(io.inner.flushes, 2);
        assert_eq!(io.inner.written, b"frame oneframe two");
        // Nothing owed: the end of the next pass flushes nothing.
        read_pending(&mut io, &mut cx);
        assert_eq!(io.inner.flushes, 2);
        // A flush that finds nothing new since the one put off flushes the lot.
        write(&mut io, &mut cx, b"frame three");
        flush(&mut io, &mut cx);
        assert_eq!(io.inner.flushes, 2);
        flush(&mut io, &mut cx);
        assert_eq!(io.inner.flushes, 3);
        read_pending(&mut io, &mut cx);
        assert_eq!(io.inner.flushes, 3);
        // A lot gathered: no putting off.
        write(&mut io, &mut cx, &vec![0; FLUSH_AT]);
        flush(&mut io, &mut cx);
        assert_eq!(io.inner.flushes, 4);
        // Never a wake-up of its own.
        assert!(!woken());
    }

    /// Counts the polls of the future inside.
    struct CountPolls<F> {
        inner: Pin<Box<F>>,
        polls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    impl<F: Future> Future for CountPolls<F> {
        type Output = F::Output;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            self.polls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.inner.as_mut().poll(cx)
        }
    }

    /// One request at a time: a round trip of a small message wakes the opener's connection
    /// task twice (the frame out, the answer in), never for nothing: no pass of its own to
    /// flush a lone frame, no wake-up from yamux's `SelectAll` having polled its only stream.
    #[tokio::test]
    async fn a_round_trip_takes_two_passes_of_the_connection() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let config = MuxConfig::default();
        let (handle, _inbound, run) = start(a, Role::Opener, &config);
        let polls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        tokio::spawn(CountPolls {
            inner: Box::pin(run),
            polls: polls.clone(),
        });
        let acceptor = spawn(b, Role::Acceptor, &config, tracing::Span::none());
        let (mut out, mut inc) = connected(&handle, acceptor).await;
        let echo = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            loop {
                let n = inc.read(&mut buf).await.unwrap();
                if n == 0 {
                    return;
                }
                inc.write_all(&buf[..n]).await.unwrap();
            }
        });

        const TRIPS: usize = 200;
        let before = polls.load(std::sync::atomic::Ordering::Relaxed);
        for i in 0..TRIPS {
            let message = [i as u8; 48];
            out.write_all(&message).await.unwrap();
            let mut back = [0u8; 48];
            out.read_exact(&mut back).await.unwrap();
            assert_eq!(back, message);
        }
        let passes = polls.load(std::sync::atomic::Ordering::Relaxed) - before;
        assert!(
            passes <= 2 * TRIPS + 4,
            "{passes} passes of the connection for {TRIPS} round trips"
        );
        out.shutdown().await.unwrap();
        echo.await.unwrap();
    }

    #[tokio::test]
    async fn reads_through_each_path_deliver_the_bytes() {
        let (_mux, mut out, mut inc) = pair().await;
        let message: Vec<u8> = (0..200u8).collect();

        // Uninitialised memory, small read: through the scratch buffer.
        out.write_all(&message).await.unwrap();
        let mut raw = [MaybeUninit::<u8>::uninit(); 8192];
        let mut buf = ReadBuf::uninit(&mut raw);
        let got = read_once(&mut inc, &mut buf).await;
        assert_eq!(got, message);
        // Nothing past what was read was initialised on the way.
        assert_eq!(buf.initialized().len(), message.len());

        // Initialised memory: read in place.
        out.write_all(&message[..50]).await.unwrap();
        let mut init = [7u8; 8192];
        let mut buf = ReadBuf::new(&mut init);
        assert_eq!(read_once(&mut inc, &mut buf).await, &message[..50]);

        // A bulk transfer grows the window past the scratch size; every byte arrives in order.
        let bulk: Vec<u8> = (0..(3 << 20)).map(|i: u32| (i % 251) as u8).collect();
        let writer = {
            let bulk = bulk.clone();
            tokio::spawn(async move {
                out.write_all(&bulk).await.unwrap();
                out.shutdown().await.unwrap();
            })
        };
        let mut got = Vec::new();
        let mut largest = 0;
        loop {
            let mut raw = vec![MaybeUninit::<u8>::uninit(); 512 * 1024];
            let mut buf = ReadBuf::uninit(&mut raw);
            let chunk = read_once(&mut inc, &mut buf).await;
            if chunk.is_empty() {
                break;
            }
            largest = largest.max(chunk.len());
            got.extend_from_slice(&chunk);
        }
        writer.await.unwrap();
        assert_eq!(got.len(), bulk.len());
        assert!(got == bulk, "bytes differ");
        assert!(largest > SCRATCH, "largest read {largest}");
    }
}
