//! One upstream connection: its socket, read buffer and response-head timer.

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use super::Transport;
use super::outgoing::Outgoing;
use crate::h1::client::{self, ResponseHead, ResponseHeadError};
use crate::h1::head::find_end;
use crate::h1::write::lone;

/// Bytes reserved per read of a response head or a chunked body.
pub(super) const READ_CHUNK: usize = 8 * 1024;
/// Largest single read reservation for a `Content-Length` body.
const READ_MAX: usize = 64 * 1024;
/// Largest response head accepted (with any `1xx` heads before it).
const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// One upstream connection.
pub(super) struct Conn {
    io: Box<dyn Transport>,
    /// Bytes read and not yet consumed (empty between exchanges).
    pub(super) buf: BytesMut,
    pub(super) key: Arc<str>,
    /// It served a request before (a failure to send on it may just be a close by the upstream
    /// while it idled).
    pub(super) reused: bool,
    /// The response-head deadline's timer, made by the first exchange that waits for one and
    /// kept: later exchanges move it (see the module's notes).
    pub(super) timer: Option<Pin<Box<Sleep>>>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("key", &self.key)
            .field("buffered", &self.buf.len())
            .field("reused", &self.reused)
            .finish_non_exhaustive()
    }
}

/// A connection for [`Pool::send_keyed`](super::Pool::send_keyed): one the caller dialled, or an
/// idle one from [`Pool::checkout`](super::Pool::checkout).
#[derive(Debug)]
pub struct Connection(pub(super) Box<Conn>);

impl Connection {
    /// A new connection on `io`, pooled under `key` once its first exchange is done.
    /// `buffered`: bytes already read from `io` past a handshake (they come first).
    pub fn new(io: impl Transport, key: &str, buffered: Bytes) -> Self {
        Self(Box::new(Conn {
            io: Box::new(io),
            buf: BytesMut::from(buffered),
            key: Arc::from(key),
            reused: false,
            timer: None,
        }))
    }
}

impl Conn {
    /// Reads what the socket has into `buf`, reserving room for about `want` bytes. `Ok(0)` is
    /// the end of the stream.
    pub(super) fn poll_fill(
        &mut self,
        cx: &mut Context<'_>,
        want: usize,
    ) -> Poll<io::Result<usize>> {
        crate::h1::rewind(&mut self.buf);
        if self.buf.capacity() - self.buf.len() < 1024 {
            self.buf.reserve(want.clamp(READ_CHUNK, READ_MAX));
        }
        // Through `AsyncRead`, which marks the socket not ready after a short read: the next
        // wait costs no `EAGAIN` read.
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
    }

    /// Whether an idle connection can take a request: the upstream has not closed it and sent
    /// nothing unasked. A TCP socket that reported nothing answers without a system call.
    pub(super) fn is_usable(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        let mut probe = [0u8; 1];
        let mut probe = ReadBuf::new(&mut probe);
        Pin::new(&mut self.io)
            .poll_read(&mut cx, &mut probe)
            .is_pending()
    }

    /// Whether `deadline` passed; when not, the task is woken when it does.
    ///
    /// The timer is moved only when it would fire after `deadline`, or fired before it: each
    /// exchange's deadline is normally later than the one before, so a busy connection's timer
    /// stays where its first exchange put it and, once that passes, wakes its task once, early,
    /// to be moved to the deadline of the exchange then waiting.
    pub(super) fn poll_deadline(&mut self, cx: &mut Context<'_>, deadline: Instant) -> Poll<()> {
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.deadline() > deadline {
            timer.as_mut().reset(deadline);
        }
        loop {
            ready!(timer.as_mut().poll(cx));
            if timer.deadline() >= deadline {
                return Poll::Ready(());
            }
            timer.as_mut().reset(deadline);
        }
    }

    /// Writes everything `out` holds: with one `send` when it is one part (small parts are
    /// copied together first: [`Outgoing::gather`]), else vectored; then flushes the
    /// transport, which TCP ignores but a TLS stream needs: a write that found the socket
    /// full leaves its last records inside rustls, and no later write would push them out
    /// while the exchange waits for the answer.
    pub(super) fn poll_write_out(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut Outgoing,
    ) -> Poll<io::Result<()>> {
        out.gather();
        while !out.is_empty() {
            let parts = [&out.head[out.head_at..], &out.data[..], out.tail];
            let io = Pin::new(&mut self.io);
            let written = match lone(&parts) {
                Some(one) => io.poll_write(cx, one),
                None => io.poll_write_vectored(cx, &parts.map(IoSlice::new)),
            };
            match ready!(written) {
                Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Ok(n) => out.advance(n),
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// Reads until a final (non-`1xx`) response head is complete and parses it. `scanned`:
    /// how far the buffer was already searched for the head's end.
    pub(super) fn poll_head(
        &mut self,
        cx: &mut Context<'_>,
        scanned: &mut usize,
        head_request: bool,
    ) -> Poll<Result<ResponseHead, HeadReadError>> {
        loop {
            if let Some(end) = find_end(&self.buf, *scanned) {
                *scanned = 0;
                let head = client::parse_response(&mut self.buf, end, head_request)?;
                let status = head.response.status();
                if status == http::StatusCode::SWITCHING_PROTOCOLS {
                    return Poll::Ready(Err(HeadReadError::Head(ResponseHeadError::Malformed(
                        "unexpected 101 Switching Protocols",
                    ))));
                }
                if status.is_informational() {
                    // `100 Continue`, `103 Early Hints`: the final head follows.
                    continue;
                }
                return Poll::Ready(Ok(head));
            }
            *scanned = self.buf.len();
            if self.buf.len() >= MAX_RESPONSE_HEAD {
                return Poll::Ready(Err(HeadReadError::Head(ResponseHeadError::Malformed(
                    "response head larger than 64 KiB",
                ))));
            }
            match ready!(self.poll_fill(cx, READ_CHUNK)) {
                Ok(0) => return Poll::Ready(Err(HeadReadError::Closed)),
                Ok(_) => {}
                Err(e) => return Poll::Ready(Err(HeadReadError::Io(e))),
            }
        }
    }
}

/// Why no response head came.
#[derive(Debug, thiserror::Error)]
pub(super) enum HeadReadError {
    #[error("the model instance closed the connection before answering")]
    Closed,
    #[error("reading from the model instance failed: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Head(#[from] ResponseHeadError),
}
