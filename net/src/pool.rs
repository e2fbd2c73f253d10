//! The plain-HTTP upstream pool: HTTP/1.1 keep-alive connections, each request and its
//! response driven by the task that sends it.
//!
//! hyper-util's legacy `Client` runs every connection in a task of its own: a request crosses
//! from the handler's task to the connection's task through a channel, its response comes back
//! through a oneshot, every body chunk through another channel. hyper's low-level client
//! connection, driven in-task, still dispatches each request through a channel and a callback
//! and keeps its own buffers. Here the exchange is written for the gateway's case: the request
//! head is encoded straight from the caller's parts (`h1::client`) and written with
//! the first piece of body in one `writev`; the response head is parsed in place from the
//! connection's read buffer; the response body ([`PooledBody`]) owns the connection and
//! decodes its frames from that buffer (the server's own decoder, `h1::body`) as its
//! reader polls it. No task, channel or wake-up stands between the upstream socket and the
//! client's.
//!
//! Behaviour:
//! - keep-alive with the most recently used connection first, at most `max_idle` idle
//!   connections per upstream address, idle ones closed after `idle_timeout` (kept below the
//!   engines' own keep-alive so reuse does not race their close, GPUStack #4419);
//! - an idle connection is checked before reuse without a system call unless its socket
//!   reported readable (a close by the upstream, or unsolicited bytes: either retires it);
//!   a request that could not be written at all on a reused connection goes to the next one,
//!   and only then;
//! - `Host` from the URI when the caller set none, origin-form target, framing from the body's
//!   size (`Content-Length` when known, else chunked), `TCP_NODELAY`, a connect timeout;
//! - the response head may come before the request body was all sent (an early error): the
//!   rest of the body is then not sent and the connection not reused;
//! - a deadline for the response head ([`Prepared::within`]: the gateway's first-byte timeout)
//!   runs on a timer that the connection keeps across its exchanges, moved only when it would
//!   fire late or fired early (`Conn::poll_deadline`), where a timer per request would be
//!   inserted into and removed from the runtime's timer wheel each time (dialling a new
//!   connection is bounded by the same deadline, with a timer of its own);
//! - a connection goes back to the pool only once its response body was read to the end, with
//!   nothing after it; dropping a body before that closes the connection, which is how a client
//!   disconnect cancels the upstream work.
//!
//! An idle connection is not polled: a close by the upstream is noticed when the connection is
//! next checked out or when the reaper drops it.
//!
//! Connections run on any [`Transport`]: [`Pool::send`] dials TCP by the request URI's
//! authority; [`Pool::send_keyed`] takes a key and a connector of the caller's (the tunnel
//! transport keys its connections by instance and dials yamux streams).

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use bytes::{Buf as _, Bytes, BytesMut};
use http::uri::Authority;
use http::{Method, Request, Response, header};
use http_body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use crate::BoxError;
use crate::h1::body::{BodyError, CHUNKED, Decoded, Decoder};
use crate::h1::client::{self, RequestFraming, ResponseFraming, ResponseHead, ResponseHeadError};
use crate::h1::head::find_end;
use crate::h1::write::{GATHER_MAX, lone};
use crate::hash::FastBuild;

/// Bytes reserved per read of a response head or a chunked body.
const READ_CHUNK: usize = 8 * 1024;
/// Largest single read reservation for a `Content-Length` body.
const READ_MAX: usize = 64 * 1024;
/// Largest response head accepted (with any `1xx` heads before it).
const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// Why an exchange through the pool failed. The gateway maps the kind to its own errors; a
/// connector's errors pass through [`Pool::send_keyed`] in the caller's type.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PoolError {
    pub kind: PoolErrorKind,
    pub message: &'static str,
    #[source]
    pub cause: Option<BoxError>,
}

/// What failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolErrorKind {
    /// No connection: bad address, refused, timed out dialling.
    Connect,
    /// The upstream closed or broke the exchange before a complete response head.
    Protocol,
    /// No response head by the deadline ([`Prepared::within`]).
    FirstByteTimeout,
    /// The caller's request body failed.
    RequestBody,
}

impl PoolError {
    pub fn new(kind: PoolErrorKind, message: &'static str) -> Self {
        Self {
            kind,
            message,
            cause: None,
        }
    }

    #[must_use]
    pub fn with_cause(mut self, cause: impl Into<BoxError>) -> Self {
        self.cause = Some(cause.into());
        self
    }
}

fn first_byte_timeout() -> PoolError {
    PoolError::new(
        PoolErrorKind::FirstByteTimeout,
        "no response from the model instance within the first-byte timeout",
    )
}

/// Pool settings.
#[derive(Clone, Copy, Debug)]
pub struct PoolConfig {
    /// For the TCP connections [`Pool::send`] dials.
    pub connect_timeout: Duration,
    /// Idle connections are closed after this long (keep it below the upstream's keep-alive).
    pub idle_timeout: Duration,
    /// Idle connections kept per key, at most.
    pub max_idle: usize,
}

/// What a request body sent through the pool must be: the gateway sends buffered bodies
/// (`Full<Bytes>`), the worker proxy streams its client's body (`Incoming`).
pub trait RequestBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static {}

impl<B> RequestBody for B where B: Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static
{}

/// The byte stream a pooled connection runs on: TCP, a tunnel stream, a relayed connection.
pub trait Transport: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<T> Transport for T where T: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

/// Idle connections by key (`host:port` for TCP). Clones share the pool.
#[derive(Clone, Debug)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    config: PoolConfig,
    idle: Mutex<HashMap<Arc<str>, Vec<Idle>, FastBuild>>,
    reaper: AtomicBool,
    /// Cancelled when the pool is dropped: the reaper stops at once, not at its next tick.
    _stop_reaper: tokio_util::sync::DropGuard,
    stop_reaper: tokio_util::sync::CancellationToken,
}

#[derive(Debug)]
struct Idle {
    conn: Box<Conn>,
    since: Instant,
}

/// One upstream connection.
struct Conn {
    io: Box<dyn Transport>,
    /// Bytes read and not yet consumed (empty between exchanges).
    buf: BytesMut,
    key: Arc<str>,
    /// It served a request before (a failure to send on it may just be a close by the upstream
    /// while it idled).
    reused: bool,
    /// The response-head deadline's timer, made by the first exchange that waits for one and
    /// kept: later exchanges move it (see the module's notes).
    timer: Option<Pin<Box<Sleep>>>,
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

/// A connection for [`Pool::send_keyed`]: one the caller dialled, or an idle one from
/// [`Pool::checkout`].
#[derive(Debug)]
pub struct Connection(Box<Conn>);

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
    fn poll_fill(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>> {
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
    fn is_usable(&mut self) -> bool {
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
    fn poll_deadline(&mut self, cx: &mut Context<'_>, deadline: Instant) -> Poll<()> {
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
    fn poll_write_out(&mut self, cx: &mut Context<'_>, out: &mut Outgoing) -> Poll<io::Result<()>> {
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
    fn poll_head(
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
enum HeadReadError {
    #[error("the model instance closed the connection before answering")]
    Closed,
    #[error("reading from the model instance failed: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Head(#[from] ResponseHeadError),
}

/// Bytes to write: an encoded head or chunk-size line, a piece of body, a fixed tail (chunk
/// end, last chunk). Advanced only by what was written, so a write that failed at once leaves
/// it whole for another connection.
#[derive(Debug, Default)]
struct Outgoing {
    head: Vec<u8>,
    head_at: usize,
    data: Bytes,
    tail: &'static [u8],
    /// Some byte of the request was written.
    sent: bool,
}

const CHUNK_END: &[u8] = b"\r\n";
const LAST_CHUNK: &[u8] = b"0\r\n\r\n";
const CHUNK_END_LAST: &[u8] = b"\r\n0\r\n\r\n";

impl Outgoing {
    fn is_empty(&self) -> bool {
        self.head_at == self.head.len() && self.data.is_empty() && self.tail.is_empty()
    }

    /// Copies a small piece of body and its framing behind what is left of the head, so that
    /// one `send` carries them ([`GATHER_MAX`]: `writev` costs the kernel more per call).
    fn gather(&mut self) {
        if self.data.is_empty() && self.tail.is_empty() {
            return;
        }
        if self.head.len() - self.head_at + self.data.len() + self.tail.len() > GATHER_MAX {
            return;
        }
        if self.head_at == self.head.len() {
            self.head.clear();
            self.head_at = 0;
        }
        self.head.extend_from_slice(&self.data);
        self.head.extend_from_slice(self.tail);
        self.data = Bytes::new();
        self.tail = &[];
    }

    fn advance(&mut self, mut n: usize) {
        self.sent = true;
        let head = (self.head.len() - self.head_at).min(n);
        self.head_at += head;
        n -= head;
        let data = self.data.len().min(n);
        self.data.advance(data);
        n -= data;
        self.tail = &self.tail[self.tail.len().min(n)..];
    }

    /// Queues a piece of body (after everything already queued was written, or after the
    /// head), framed for `chunked`; `last`: the body ends with it.
    fn push_body(&mut self, data: Bytes, chunked: bool, last: bool) {
        if self.is_empty() {
            self.head.clear();
            self.head_at = 0;
        }
        if !chunked {
            self.data = data;
            return;
        }
        if data.is_empty() {
            // An empty chunk would end the body.
            if last {
                self.tail = LAST_CHUNK;
            }
            return;
        }
        crate::h1::write::chunk_size(&mut self.head, data.len());
        self.data = data;
        self.tail = if last { CHUNK_END_LAST } else { CHUNK_END };
    }
}

/// A request encoded for the wire and ready to go on a connection ([`Pool::send_keyed`]): its
/// head and first piece of body, and the rest of its body. It survives an attempt that wrote
/// nothing, for the next connection.
#[derive(Debug)]
pub struct Prepared<B> {
    out: Outgoing,
    body: B,
    chunked: bool,
    body_done: bool,
    head_request: bool,
    scanned: usize,
    /// Everything was written but the transport's flush did not finish: it is polled again
    /// until it does (a TLS stream holds the last records until then).
    unflushed: bool,
    /// The response head is due by then ([`Prepared::within`]).
    deadline: Option<Instant>,
}

/// How an exchange failed.
enum ExchangeError {
    /// Nothing of the request was written: another connection may take it.
    Unsent(BoxError),
    /// The upstream may have seen (part of) the request.
    Failed(BoxError),
    /// The request body (the caller's) failed.
    Body(BoxError),
    /// No response head came by the deadline.
    TimedOut,
}

impl<B: RequestBody> Prepared<B> {
    /// Encodes `req` (`Host` from its URI's authority when it has no `Host` header; the
    /// target in origin form) and takes the first piece of its body when it is ready now.
    ///
    /// Not async: a body that is not ready is polled again, with the sending task's waker, once
    /// the head is written (`Prepared::poll`); a buffered body (the gateway's) is always
    /// ready. Building it before any future keeps the request itself out of the sending
    /// future's state.
    pub fn new(req: Request<B>) -> Result<Self, PoolError> {
        let (parts, body) = req.into_parts();
        let framing = RequestFraming::choose(
            &parts.method,
            body.size_hint().exact(),
            parts.headers.contains_key(header::CONTENT_LENGTH),
        );
        let chunked = framing == RequestFraming::Chunked;
        let mut out = Outgoing::default();
        client::encode_head(
            &mut out.head,
            &parts.method,
            parts.uri.path_and_query().map_or("/", |p| p.as_str()),
            host(&parts.uri),
            &parts.headers,
            framing,
        );
        let mut prepared = Self {
            out,
            body,
            chunked,
            body_done: framing == RequestFraming::None,
            head_request: parts.method == Method::HEAD,
            scanned: 0,
            unflushed: false,
            deadline: None,
        };
        if !prepared.body_done {
            // A piece of body that is ready at once (all of a buffered one) goes out with
            // the head, in one write. If none is, the no-op waker registered here is replaced
            // by the task's own when `poll` asks again.
            let mut cx = Context::from_waker(Waker::noop());
            if let Poll::Ready(frame) = Pin::new(&mut prepared.body).poll_frame(&mut cx) {
                prepared.take(frame).map_err(body_failed)?;
            }
        }
        Ok(prepared)
    }

    /// The response head is due by `deadline`: past it (dialling, writing or waiting), the
    /// exchange fails with [`PoolErrorKind::FirstByteTimeout`] and its connection is closed.
    #[must_use]
    pub fn within(mut self, deadline: Instant) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Queues the body's next frame (`None`: its end) behind what is queued.
    fn take(&mut self, frame: Option<Result<Frame<Bytes>, B::Error>>) -> Result<(), BoxError> {
        match frame {
            Some(Ok(frame)) => {
                let last = self.body.is_end_stream();
                self.body_done = last;
                match frame.into_data() {
                    Ok(data) => self.out.push_body(data, self.chunked, last),
                    // Trailers are not forwarded.
                    Err(_) if last && self.chunked => self.out.push_body(Bytes::new(), true, true),
                    Err(_) => {}
                }
            }
            None => {
                self.body_done = true;
                if self.chunked {
                    self.out.push_body(Bytes::new(), true, true);
                }
            }
            Some(Err(e)) => return Err(e.into()),
        }
        Ok(())
    }

    /// Drives the exchange on `conn` until the response head, within the deadline if any.
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        conn: &mut Conn,
    ) -> Poll<Result<ResponseHead, ExchangeError>> {
        let polled = self.poll_exchange(cx, conn);
        if polled.is_pending()
            && let Some(deadline) = self.deadline
        {
            ready!(conn.poll_deadline(cx, deadline));
            return Poll::Ready(Err(ExchangeError::TimedOut));
        }
        polled
    }

    fn poll_exchange(
        &mut self,
        cx: &mut Context<'_>,
        conn: &mut Conn,
    ) -> Poll<Result<ResponseHead, ExchangeError>> {
        loop {
            // The response head ends the exchange, also when it comes before the body was all
            // sent (an early error answer).
            match conn.poll_head(cx, &mut self.scanned, self.head_request) {
                Poll::Ready(Ok(head)) => return Poll::Ready(Ok(head)),
                Poll::Ready(Err(e)) if !self.out.sent => {
                    return Poll::Ready(Err(ExchangeError::Unsent(e.into())));
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(ExchangeError::Failed(e.into()))),
                Poll::Pending => {}
            }
            // Also when everything was taken but the flush was pending: the next poll must
            // flush again, or the last TLS records wait in rustls while the upstream waits for
            // them.
            if !self.out.is_empty() || self.unflushed {
                self.unflushed = true;
                match ready!(conn.poll_write_out(cx, &mut self.out)) {
                    Ok(()) => self.unflushed = false,
                    Err(e) if !self.out.sent => {
                        return Poll::Ready(Err(ExchangeError::Unsent(e.into())));
                    }
                    Err(e) => return Poll::Ready(Err(ExchangeError::Failed(e.into()))),
                }
            }
            if self.body_done {
                // Everything is out; the head's read is registered.
                return Poll::Pending;
            }
            let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
            if let Err(e) = self.take(frame) {
                return Poll::Ready(Err(ExchangeError::Body(e)));
            }
        }
    }
}

/// A response body read straight from its pooled connection. At its end the connection goes
/// back to the pool (when the upstream keeps it alive and sent nothing more); dropped before
/// its end, it closes the connection, which cancels the work upstream.
#[derive(Debug)]
pub struct PooledBody {
    conn: Option<Box<Conn>>,
    pool: Weak<PoolInner>,
    decoder: Decoder,
    /// The body ends when the upstream closes the connection.
    until_close: bool,
    keep_alive: bool,
}

impl PooledBody {
    fn new(
        conn: Box<Conn>,
        pool: Weak<PoolInner>,
        framing: ResponseFraming,
        keep_alive: bool,
    ) -> Self {
        let (decoder, until_close) = match framing {
            ResponseFraming::Empty => (Decoder::Done, false),
            ResponseFraming::Length(n) => (Decoder::Length(n), false),
            ResponseFraming::Chunked => (CHUNKED, false),
            ResponseFraming::UntilClose => (Decoder::Length(u64::MAX), true),
        };
        let mut body = Self {
            conn: Some(conn),
            pool,
            decoder,
            until_close,
            keep_alive,
        };
        if body.decoder.is_done() {
            body.finish();
        }
        body
    }

    /// The body ended: the connection back to the pool, or closed.
    fn finish(&mut self) {
        self.decoder = Decoder::Done;
        let Some(conn) = self.conn.take() else { return };
        if self.keep_alive
            && conn.buf.is_empty()
            && let Some(pool) = self.pool.upgrade()
        {
            pool.put(conn);
        }
    }

    fn fail(&mut self, error: BodyError) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.decoder = Decoder::Failed;
        self.conn = None;
        Poll::Ready(Some(Err(error)))
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return match this.decoder {
                    Decoder::Failed => Poll::Ready(Some(Err(BodyError::Truncated))),
                    _ => Poll::Ready(None),
                };
            };
            let want = match this.decoder {
                Decoder::Length(left) if !this.until_close => {
                    usize::try_from(left).unwrap_or(usize::MAX)
                }
                _ => READ_CHUNK,
            };
            match this.decoder.decode(&mut conn.buf) {
                Ok(Decoded::Data(data)) => {
                    if this.decoder.is_done() {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(Decoded::End) => {
                    this.finish();
                    return Poll::Ready(None);
                }
                Ok(Decoded::More) => match ready!(conn.poll_fill(cx, want)) {
                    Ok(0) if this.until_close => {
                        this.keep_alive = false;
                        this.finish();
                        return Poll::Ready(None);
                    }
                    Ok(0) => return this.fail(BodyError::Truncated),
                    Ok(_) => {}
                    Err(e) => return this.fail(BodyError::Io(e)),
                },
                Err(e) => return this.fail(e),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.decoder.is_done()
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder {
            Decoder::Done => SizeHint::with_exact(0),
            Decoder::Length(n) if !self.until_close => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

impl Pool {
    pub fn new(config: PoolConfig) -> Self {
        let stop_reaper = tokio_util::sync::CancellationToken::new();
        Self {
            inner: Arc::new(PoolInner {
                config,
                idle: Mutex::new(HashMap::default()),
                reaper: AtomicBool::new(false),
                _stop_reaper: stop_reaper.clone().drop_guard(),
                stop_reaper,
            }),
        }
    }

    /// Sends `req` (absolute `http://` URI) over TCP and returns the response, whose body
    /// reads from the connection.
    pub fn send<B: RequestBody>(
        &self,
        req: Request<B>,
    ) -> impl Future<Output = Result<Response<PooledBody>, PoolError>> + Send + '_ {
        self.send_as(req, None)
    }

    /// [`Pool::send`] with the body made into a `T` (no other future wraps this one to do it),
    /// and the response head due by `deadline` if one is given ([`Prepared::within`]).
    ///
    /// The request is encoded before the future is made: the future holds the encoded bytes,
    /// not the request.
    pub fn send_as<B, T>(
        &self,
        req: Request<B>,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Response<T>, PoolError>> + Send + '_
    where
        B: RequestBody,
        T: From<PooledBody>,
    {
        let ready = match req.uri().authority().cloned() {
            Some(authority) => Prepared::new(req).map(|prepared| {
                let prepared = match deadline {
                    Some(deadline) => prepared.within(deadline),
                    None => prepared,
                };
                (authority, prepared)
            }),
            None => Err(PoolError::new(
                PoolErrorKind::Connect,
                "the model instance has an invalid address",
            )),
        };
        async move {
            let (authority, prepared) = ready?;
            let resp = self
                .send_keyed(authority.as_str(), None, prepared, || {
                    self.connect(&authority)
                })
                .await?;
            Ok(resp.map(T::from))
        }
    }

    /// Sends `prepared` on `first` if given, else on an idle connection of `key`, else on one
    /// `connect` makes. A request that could not be written at all on a reused connection goes
    /// to the next (idle or new) one, and only then.
    pub async fn send_keyed<B, C, F, E>(
        &self,
        key: &str,
        first: Option<Connection>,
        mut prepared: Prepared<B>,
        mut connect: C,
    ) -> Result<Response<PooledBody>, E>
    where
        B: RequestBody,
        C: FnMut() -> F,
        F: Future<Output = Result<Connection, E>>,
        E: From<PoolError>,
    {
        let mut next = first;
        loop {
            let mut conn = match next.take().or_else(|| self.checkout(key)) {
                Some(conn) => conn.0,
                None => match prepared.deadline {
                    Some(deadline) => {
                        tokio::time::timeout_at(deadline, connect())
                            .await
                            .map_err(|_| first_byte_timeout())??
                            .0
                    }
                    None => connect().await?.0,
                },
            };
            prepared.scanned = 0;
            match poll_fn(|cx| prepared.poll(cx, &mut conn)).await {
                Ok(head) => {
                    // A body cut short by an early answer leaves the connection unusable.
                    let keep_alive =
                        head.keep_alive && prepared.body_done && prepared.out.is_empty();
                    conn.reused = true;
                    let body = PooledBody::new(
                        conn,
                        Arc::downgrade(&self.inner),
                        head.framing,
                        keep_alive,
                    );
                    return Ok(head.response.map(|()| body));
                }
                Err(ExchangeError::Unsent(_)) if conn.reused => {}
                Err(ExchangeError::Unsent(e)) => {
                    return Err(PoolError::new(
                        PoolErrorKind::Protocol,
                        "the model instance closed a new connection before the request was sent",
                    )
                    .with_cause(e)
                    .into());
                }
                Err(ExchangeError::Failed(e)) => {
                    return Err(PoolError::new(
                        PoolErrorKind::Protocol,
                        "the model instance failed before answering",
                    )
                    .with_cause(e)
                    .into());
                }
                Err(ExchangeError::Body(e)) => return Err(body_failed(e).into()),
                Err(ExchangeError::TimedOut) => return Err(first_byte_timeout().into()),
            }
        }
    }

    /// The most recently used idle connection of `key` that has not timed out and is still
    /// usable.
    pub fn checkout(&self, key: &str) -> Option<Connection> {
        self.inner.checkout(key).map(Connection)
    }

    async fn connect(&self, authority: &Authority) -> Result<Connection, PoolError> {
        let io = dial_tcp(authority, 80, self.inner.config.connect_timeout).await?;
        Ok(Connection::new(io, authority.as_str(), Bytes::new()))
    }

    /// Idle connections (for tests).
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.inner.lock().values().map(Vec::len).sum()
    }
}

impl PoolInner {
    fn lock(&self) -> parking_lot::MutexGuard<'_, HashMap<Arc<str>, Vec<Idle>, FastBuild>> {
        self.idle.lock()
    }

    /// The most recently used idle connection to `key` that has not timed out and is still
    /// usable.
    fn checkout(&self, key: &str) -> Option<Box<Conn>> {
        let mut retired = Vec::new();
        let found = {
            let mut idle = self.lock();
            let list = idle.get_mut(key)?;
            loop {
                match list.pop() {
                    Some(entry) if entry.since.elapsed() < self.config.idle_timeout => {
                        let mut conn = entry.conn;
                        if conn.is_usable() {
                            break Some(conn);
                        }
                        retired.push(conn);
                    }
                    Some(entry) => {
                        // The newest one is too old, so are the others.
                        retired.push(entry.conn);
                        retired.extend(list.drain(..).map(|e| e.conn));
                        break None;
                    }
                    None => break None,
                }
            }
        };
        // Closed outside the lock.
        drop(retired);
        found
    }

    fn put(self: &Arc<Self>, conn: Box<Conn>) {
        start_reaper(self);
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

/// Dials `authority` (`default_port` when it names none) within `timeout`, with
/// `TCP_NODELAY`; the error is a [`PoolErrorKind::Connect`].
pub async fn dial_tcp(
    authority: &Authority,
    default_port: u16,
    timeout: Duration,
) -> Result<TcpStream, PoolError> {
    let connect_error = |e: io::Error| {
        PoolError::new(
            PoolErrorKind::Connect,
            "could not connect to the model instance",
        )
        .with_cause(e)
    };
    let port = authority.port_u16().unwrap_or(default_port);
    let target = (bare_host(authority), port);
    let io = match tokio::time::timeout(timeout, TcpStream::connect(target)).await {
        Ok(Ok(io)) => io,
        Ok(Err(e)) => return Err(connect_error(e)),
        Err(_) => {
            return Err(connect_error(io::Error::new(
                io::ErrorKind::TimedOut,
                "connect timed out",
            )));
        }
    };
    let _ = io.set_nodelay(true);
    Ok(io)
}

/// The host of `authority` without the brackets of an IPv6 address: what a socket address or
/// a TLS server name is made from.
pub fn bare_host(authority: &Authority) -> &str {
    let host = authority.host();
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Closes idle connections past the idle timeout even when no request comes (started with the
/// first idle connection).
fn start_reaper(pool: &Arc<PoolInner>) {
    if pool.reaper.swap(true, Ordering::Relaxed) {
        return;
    }
    let weak = Arc::downgrade(pool);
    let stop = pool.stop_reaper.clone();
    let every = pool.config.idle_timeout.max(Duration::from_millis(100));
    // Ends with the pool: `stop_reaper` is cancelled when the pool is dropped.
    crate::task::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(every) => {}
            }
            let Some(pool) = weak.upgrade() else { break };
            pool.reap();
        }
    });
}

/// `Host` for a request URI: its authority, with the port only when it is not the scheme's
/// default (80, or 443 for `https`), as hyper-util's client writes it; empty without one.
fn host(uri: &http::Uri) -> &str {
    let Some(authority) = uri.authority() else {
        return "";
    };
    let default = if uri.scheme() == Some(&http::uri::Scheme::HTTPS) {
        443
    } else {
        80
    };
    match authority.port_u16() {
        Some(port) if port != default => authority.as_str(),
        _ => authority.host(),
    }
}

fn body_failed(e: BoxError) -> PoolError {
    PoolError::new(
        PoolErrorKind::RequestBody,
        "reading the request body failed",
    )
    .with_cause(e)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)]

    use super::*;
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

    /// One exchange of `req` on the given connection (never a dialled one), with a 5 s
    /// deadline for the answer's head; the answer's body.
    async fn exchange_on(conn: Connection, req: Request<Full<Bytes>>) -> String {
        let prepared = Prepared::new(req)
            .unwrap()
            .within(Instant::now() + Duration::from_secs(5));
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

    const T: Duration = Duration::from_secs(5);

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
                        if head.contains("transfer-encoding: chunked")
                            && !seen.ends_with(b"0\r\n\r\n")
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
        let (addr, mut seen) =
            scripted(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", false).await;
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
            // Keep the connection open without reading more.
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let pool = Pool::new(config());
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tx.send(Bytes::from_static(b"first")).await.unwrap();
        let req = Request::post(format!("http://{addr}/big"))
            .body(Streamed(rx))
            .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(2), pool.send(req))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(resp.status(), 413);
        assert_eq!(body_of(resp).await, "big");
        assert_eq!(pool.idle_count(), 0, "the body was cut short");
        drop(tx);
    }
}
