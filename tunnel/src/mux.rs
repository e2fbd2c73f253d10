//! The yamux connection, driven by its own task.
//!
//! rust-yamux is poll-driven: `poll_next_inbound` performs all reads and writes of the
//! connection, so one task owns the `Connection` and polls it without pause. Outbound streams are
//! requested over a channel ([`MuxHandle::open_stream`]); inbound streams go to an acceptor
//! channel, or are refused at once where the side does not accept streams (the server). The
//! task never waits on a single stream: a full acceptor channel refuses the new stream instead,
//! and slow readers are held back by their own stream windows only.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures_util::io::AsyncWrite as _;
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
/// user-space item of the relay's profile). Here only a window sized by the recent reads is
/// initialised: it doubles while reads fill it and shrinks when they stay small.
#[derive(Debug)]
pub struct TunnelStream {
    inner: yamux::Stream,
    window: usize,
}

/// Bounds of [`TunnelStream`]'s read window.
const MIN_READ_WINDOW: usize = 4 * 1024;
const MAX_READ_WINDOW: usize = 256 * 1024;

impl TunnelStream {
    fn new(inner: yamux::Stream) -> Self {
        Self {
            inner,
            window: MIN_READ_WINDOW,
        }
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
        let slice = buf.initialize_unfilled_to(want);
        let n = ready!(futures_util::io::AsyncRead::poll_read(
            Pin::new(&mut this.inner),
            cx,
            slice
        ))?;
        buf.advance(n);
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
        let streams = self.max_streams.max(1);
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
}

impl MuxHandle {
    /// Opens a new stream.
    pub async fn open_stream(&self) -> Result<TunnelStream, TunnelError> {
        let (tx, rx) = oneshot::channel();
        self.open.send(tx).map_err(|_| TunnelError::Closed)?;
        let stream = rx.await.map_err(|_| TunnelError::Closed)??;
        Ok(TunnelStream::new(stream))
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

/// How long a graceful close may take before the connection is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Starts the connection task over `io`.
pub fn spawn<T>(io: T, role: Role, config: &MuxConfig, span: tracing::Span) -> Mux
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mode = match role {
        Role::Opener => yamux::Mode::Client,
        Role::Acceptor => yamux::Mode::Server,
    };
    let connection = yamux::Connection::new(io.compat(), config.yamux(), mode);
    let (open_tx, open_rx) = mpsc::unbounded_channel();
    let (in_tx, in_rx) = mpsc::channel(config.accept_backlog.max(1));
    let close = CancellationToken::new();
    let closed = CancellationToken::new();
    let handle = MuxHandle {
        open: open_tx,
        close: close.clone(),
        closed: closed.clone(),
    };
    let task = tokio::spawn(
        async move {
            let _closed = closed.drop_guard();
            let result = drive(connection, role, open_rx, in_tx, close).await;
            match &result {
                Ok(()) => tracing::debug!("tunnel connection closed"),
                Err(e) => tracing::debug!(error = %e, "tunnel connection ended"),
            }
            result
        }
        .instrument(span),
    );
    Mux {
        handle,
        inbound: in_rx,
        task,
    }
}

async fn drive<T>(
    mut connection: yamux::Connection<T>,
    role: Role,
    mut open_rx: mpsc::UnboundedReceiver<OpenRequest>,
    in_tx: mpsc::Sender<Inbound>,
    close: CancellationToken,
) -> Result<(), TunnelError>
where
    T: futures_util::io::AsyncRead + futures_util::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut waiting: VecDeque<OpenRequest> = VecDeque::new();
    let closing = close.cancelled();
    tokio::pin!(closing);
    let outcome = poll_fn(|cx| {
        if closing.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Ok(false));
        }
        // New open requests; callers that gave up are skipped.
        while let Poll::Ready(Some(request)) = open_rx.poll_recv(cx) {
            waiting.push_back(request);
        }
        while let Some(front) = waiting.front() {
            if front.is_closed() {
                waiting.pop_front();
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
                        drop(stream); // resets it: this side accepts no streams
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
