//! One natively served HTTP/1.1 connection: heads in, answers out, keep-alive, pipelining,
//! cancel on disconnect, and nothing held while idle.

use std::future::{Future, poll_fn};
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Method, Request, Response, Version};
use http_body::{Body as _, Frame, SizeHint};
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

use super::ClientBody;
use super::body::{BodyError, CHUNKED, Decoded, Decoder};
use super::head::{self, Framing, Head, HeadError};
use super::write::{self, LAST_CHUNK, Out};
use crate::BoxError;
use crate::events::ConnectionEvents;

/// Bytes reserved per read of a head or a chunked body.
pub(crate) const READ_CHUNK: usize = 8 * 1024;
/// Largest single read reservation for a `Content-Length` body.
const READ_MAX: usize = 64 * 1024;
/// Bytes read ahead of the current request (pipelined requests) while it is in flight, at
/// most; reading ahead is how a client that closes its connection is noticed.
const READ_AHEAD: usize = 16 * 1024;
/// After a refused head, how long the connection is kept to read (and discard) what the
/// client still sends, so that closing does not reset the answer away.
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES: usize = 64 * 1024;

/// A request body read from a natively served HTTP/1 connection: its bytes come straight from
/// the connection's read side (the connection's task polls it, so no channel and no wake-up
/// stand between the socket and the handler).
#[derive(Debug)]
pub struct Body {
    shared: Arc<Shared>,
    hint: SizeHint,
}

impl Body {
    pub(crate) fn new(shared: Arc<Shared>, hint: SizeHint) -> Self {
        Self { shared, hint }
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let shared = &*self.shared;
        let mut read = shared.read.lock();
        loop {
            let state = &mut *read;
            match state.decoder.decode(&mut state.buf) {
                Ok(Decoded::Data(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Ok(Decoded::End) => return Poll::Ready(None),
                Ok(Decoded::More) => {}
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
            if state.continue_due {
                ready!(shared.send_continue(cx))?;
                state.continue_due = false;
            }
            if state.eof {
                state.decoder = Decoder::Failed;
                return Poll::Ready(Some(Err(BodyError::Truncated)));
            }
            let want = match state.decoder {
                Decoder::Length(left) => usize::try_from(left).unwrap_or(usize::MAX),
                _ => READ_CHUNK,
            };
            match ready!(shared.poll_fill(cx, state, want)) {
                Ok(0) => state.eof = true,
                Ok(_) => {}
                Err(e) => {
                    state.decoder = Decoder::Failed;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.shared.read.lock().decoder.is_done()
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

/// Per-listener settings of natively served connections.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    /// Keep-alive idle time plus head time of every request after the first.
    pub(crate) head_timeout: Duration,
    pub(crate) max_head: usize,
    pub(crate) write_stall: Option<Duration>,
}

/// The socket and its read side, shared by the connection loop and the request body.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The write half; its `&TcpStream` also serves readiness waits and lingering reads.
    write: OwnedWriteHalf,
    pub(crate) read: Mutex<ReadSide>,
    write_stall: Option<Duration>,
}

#[derive(Debug)]
pub(crate) struct ReadSide {
    /// Read through `AsyncRead`, which tokio lets skip the `EAGAIN` read after a short one.
    half: OwnedReadHalf,
    /// Bytes read and not yet consumed. Empty and without capacity while the connection idles.
    pub(crate) buf: BytesMut,
    pub(crate) decoder: Decoder,
    /// The client closed its side.
    pub(crate) eof: bool,
    /// `100 Continue` is owed before the body is read.
    pub(crate) continue_due: bool,
}

impl Shared {
    /// Reads what the socket has into `state.buf` (reserving room for about `want` bytes).
    /// `Ok(0)` is the end of the stream.
    pub(crate) fn poll_fill(
        &self,
        cx: &mut Context<'_>,
        state: &mut ReadSide,
        want: usize,
    ) -> Poll<io::Result<usize>> {
        // No buffer is reserved before the socket reports bytes.
        ready!(state.half.as_ref().poll_read_ready(cx))?;
        super::rewind(&mut state.buf);
        if state.buf.capacity() - state.buf.len() < 1024 {
            state.buf.reserve(want.clamp(READ_CHUNK / 2, READ_MAX));
        }
        let polled = tokio_util::io::poll_read_buf(Pin::new(&mut state.half), cx, &mut state.buf);
        if polled.is_pending() && state.buf.is_empty() {
            // Readiness was stale (tokio keeps it until a read would block): do not keep a
            // buffer reserved for an idle connection.
            state.buf = BytesMut::new();
        }
        polled
    }

    fn io(&self) -> &TcpStream {
        self.write.as_ref()
    }

    /// Writes `100 Continue`.
    pub(crate) fn send_continue(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";
        loop {
            ready!(self.io().poll_write_ready(cx))?;
            match self.io().try_write(CONTINUE) {
                Ok(n) if n == CONTINUE.len() => return Poll::Ready(Ok(())),
                Ok(_) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "partial write of 100 Continue",
                    )));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// While a request is in flight and its body was read: reads ahead, within
    /// [`READ_AHEAD`], to notice a client that closes. Ready once the client is gone.
    fn poll_gone(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.read.lock();
        if state.eof {
            return Poll::Ready(());
        }
        if !state.decoder.is_done() {
            // The body's reader notices a close.
            return Poll::Pending;
        }
        while state.buf.len() < READ_AHEAD {
            match self.poll_fill(cx, &mut state, 1024) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0) | Err(_)) => {
                    state.eof = true;
                    return Poll::Ready(());
                }
                Poll::Ready(Ok(_)) => {}
            }
        }
        Poll::Pending
    }

    /// Writes the three parts in order, waiting (within the write-stall limit) when the
    /// client's window is full.
    ///
    /// A lone part goes out with `send`, several with `writev` (see [`write::GATHER_MAX`]: the
    /// callers copy small parts together first).
    async fn write_all(&self, parts: [&[u8]; 3]) -> io::Result<()> {
        let mut parts = parts;
        loop {
            let first = parts.iter().position(|p| !p.is_empty());
            let Some(first) = first else { return Ok(()) };
            let written = match write::lone(&parts) {
                Some(one) => self.io().try_write(one),
                None => self
                    .io()
                    .try_write_vectored(&parts.map(IoSlice::new)[first..]),
            };
            match written {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(mut n) => {
                    for part in &mut parts {
                        let k = n.min(part.len());
                        *part = &part[k..];
                        n -= k;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => match self.write_stall {
                    None => self.io().writable().await?,
                    Some(limit) => tokio::time::timeout(limit, self.io().writable())
                        .await
                        .map_err(|_| crate::framing::write_stalled(limit))??,
                },
                Err(e) => return Err(e),
            }
        }
    }

    /// Closes the write side and reads (and drops) what the client still sends, briefly and
    /// boundedly, so that the close does not reset an answer the client has not read yet.
    async fn linger(&self) {
        let _ = socket2::SockRef::from(self.io()).shutdown(std::net::Shutdown::Write);
        let mut scratch = vec![0u8; 2048];
        let mut read = 0;
        let _ = tokio::time::timeout(LINGER, async {
            while read < LINGER_BYTES {
                if self.io().readable().await.is_err() {
                    return;
                }
                match self.io().try_read(&mut scratch) {
                    Ok(0) => return,
                    Ok(n) => read += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(_) => return,
                }
            }
        })
        .await;
    }
}

/// Why no head was read.
enum NoHead {
    /// The client closed, or the listener is draining an idle connection.
    Closed,
    TimedOut,
    Refused(HeadError),
}

/// Serves one plain HTTP/1 connection until it closes, its keep-alive time ends, or `stop`
/// fires (an idle connection closes at once, a busy one after its current answer).
/// `first_deadline` bounds the first head (the pending-connection deadline); `on_first_head`
/// runs once it is read.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve<H, Fut, B>(
    stream: TcpStream,
    peer: SocketAddr,
    handler: &H,
    settings: Settings,
    first_deadline: Instant,
    on_first_head: impl FnOnce(),
    stop: &CancellationToken,
    events: Option<&dyn ConnectionEvents>,
) where
    H: Fn(Request<ClientBody>, SocketAddr) -> Fut,
    Fut: Future<Output = Response<B>>,
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let (half, write) = stream.into_split();
    let shared = Arc::new(Shared {
        write,
        read: Mutex::new(ReadSide {
            half,
            buf: BytesMut::new(),
            decoder: Decoder::Done,
            eof: false,
            continue_due: false,
        }),
        write_stall: settings.write_stall,
    });
    let mut on_first_head = Some(on_first_head);
    let mut deadline = first_deadline;
    let mut timer = None;
    loop {
        let head = match read_head(&shared, deadline, &mut timer, settings.max_head, stop).await {
            Ok(head) => head,
            Err(NoHead::Closed) => return,
            Err(NoHead::TimedOut) => {
                if on_first_head.is_some() {
                    tracing::debug!("closed: no complete request head in time");
                    if let Some(events) = events {
                        events.head_timeout();
                    }
                }
                return;
            }
            Err(NoHead::Refused(e)) => {
                tracing::debug!(error = %e, "request head refused");
                if e == HeadError::Conflict
                    && let Some(events) = events
                {
                    events.framing_conflict();
                }
                // Boxed, like the closing linger below: rare paths whose futures would
                // otherwise widen every idle connection's task.
                Box::pin(async {
                    let answer = refusal(e);
                    if shared.write_all([&answer, &[], &[]]).await.is_ok() {
                        shared.linger().await;
                    }
                })
                .await;
                return;
            }
        };
        if let Some(first) = on_first_head.take() {
            first();
        }
        // The exchange (handler future, answer body, write state) lives in a box of its own:
        // an idle connection's task holds only the small loop state. The box is allocated
        // first and the future built in it: `Box::pin(exchange(..))` builds the future on the
        // stack and copies all of it (every state's room, about 2 KB) into the box.
        let slot = Box::new_uninit();
        let keep = Box::into_pin(Box::write(
            slot,
            exchange(&shared, head, peer, handler, stop),
        ))
        .await;
        match keep {
            Keep::Yes => {}
            Keep::No => return,
            Keep::Linger => {
                Box::pin(shared.linger()).await;
                return;
            }
        }
        let mut state = shared.read.lock();
        if state.buf.is_empty() {
            state.buf = BytesMut::new();
        }
        drop(state);
        deadline = Instant::now() + settings.head_timeout;
    }
}

/// Reads the next request head, within `deadline`.
///
/// `timer` is the connection's one head timer, made at the first wait and kept: it is moved
/// only when it fires before the current deadline (or would fire after it), not for every
/// request, so a busy keep-alive connection does not insert and remove a timer per request.
async fn read_head(
    shared: &Shared,
    deadline: Instant,
    timer: &mut Option<Pin<Box<Sleep>>>,
    max: usize,
    stop: &CancellationToken,
) -> Result<Head, NoHead> {
    let mut scanned = 0;
    loop {
        {
            let mut guard = shared.read.lock();
            let state = &mut *guard;
            if state.buf.len() > scanned {
                if let Some(end) = head::find_end(&state.buf, scanned) {
                    if end > max {
                        return Err(NoHead::Refused(HeadError::TooLarge));
                    }
                    let head = head::parse(&mut state.buf, end).map_err(NoHead::Refused)?;
                    state.decoder = match head.framing {
                        Framing::Empty => Decoder::Done,
                        Framing::Length(n) => Decoder::Length(n),
                        Framing::Chunked => CHUNKED,
                    };
                    state.continue_due = head.expect_continue && head.framing != Framing::Empty;
                    return Ok(head);
                }
                if state.buf.len() >= max {
                    return Err(NoHead::Refused(HeadError::TooLarge));
                }
                scanned = state.buf.len();
            }
            if state.eof {
                return Err(NoHead::Closed);
            }
        }
        let idle = scanned == 0;
        let fill = poll_fn(|cx| {
            let mut state = shared.read.lock();
            shared.poll_fill(cx, &mut state, READ_CHUNK)
        });
        let sleep = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.deadline() > deadline {
            sleep.as_mut().reset(deadline);
        }
        let filled = tokio::select! {
            biased;
            () = stop.cancelled(), if idle => return Err(NoHead::Closed),
            filled = fill => filled,
            () = sleep.as_mut() => {
                if Instant::now() < deadline {
                    // Set for an earlier wait: move it to this one's deadline.
                    sleep.as_mut().reset(deadline);
                    continue;
                }
                return Err(NoHead::TimedOut);
            }
        };
        match filled {
            Ok(0) | Err(_) => return Err(NoHead::Closed),
            Ok(_) => {}
        }
    }
}

/// What the connection does after an exchange.
enum Keep {
    Yes,
    /// Close now.
    No,
    /// Close after reading what the client still sends (unread request body).
    Linger,
}

/// One request and its answer.
async fn exchange<H, Fut, B>(
    shared: &Arc<Shared>,
    head: Head,
    peer: SocketAddr,
    handler: &H,
    stop: &CancellationToken,
) -> Keep
where
    H: Fn(Request<ClientBody>, SocketAddr) -> Fut,
    Fut: Future<Output = Response<B>>,
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let Head {
        request,
        framing,
        keep_alive,
        last,
        ..
    } = head;
    let bodiless = request.method() == Method::HEAD;
    let http10 = request.version() == Version::HTTP_10;
    let hint = match framing {
        Framing::Empty => SizeHint::with_exact(0),
        Framing::Length(n) => SizeHint::with_exact(n),
        Framing::Chunked => SizeHint::default(),
    };
    let request = request.map(|()| ClientBody::Native(Body::new(shared.clone(), hint)));

    // The handler's future is built straight into the wait (a `pin!` of it would keep a
    // second copy of its state in the exchange: 4 KB more per request, and copied).
    let response = tokio::select! {
        biased;
        response = handler(request, peer) => Some(response),
        () = poll_fn(|cx| shared.poll_gone(cx)) => None,
    };
    let Some((parts, mut body)) = response.map(Response::into_parts) else {
        tracing::debug!("client closed before its answer: cancelled");
        return Keep::No;
    };

    let mut keep = keep_alive && !last && !stop.is_cancelled();
    // Room for the head, and for a small body sent in the same write.
    let exact = body.size_hint().exact();
    let room = exact
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n <= write::GATHER_MAX);
    let mut out = Vec::with_capacity(256 + room.unwrap_or(0));
    let framing = write::head(
        &mut out,
        parts.status,
        &parts.headers,
        exact,
        bodiless,
        http10,
        keep,
    );
    drop(parts);
    if framing == Out::UntilClose {
        keep = false;
    }
    let complete = match framing {
        Out::None => shared.write_all([&out, &[], &[]]).await.is_ok(),
        _ => stream_body(shared, Pin::new(&mut body), framing, out).await,
    };
    if !complete {
        return Keep::No;
    }
    if !keep {
        return Keep::Linger;
    }
    // The request body must be over (read by the handler, or already buffered whole) for the
    // next head to be found; otherwise the connection ends here.
    if Arc::strong_count(shared) > 1 {
        return Keep::Linger;
    }
    let mut guard = shared.read.lock();
    let state = &mut *guard;
    loop {
        match state.decoder.decode(&mut state.buf) {
            Ok(Decoded::End) => return Keep::Yes,
            Ok(Decoded::Data(_)) => {}
            Ok(Decoded::More) | Err(_) => return Keep::Linger,
        }
    }
}

/// Writes the answer body as it comes: every data frame is written when it arrives, never held
/// for a later one; the head and the frames that are ready at once (up to
/// [`write::GATHER_MAX`] bytes) leave together in one `send`. Returns whether the body was
/// delivered whole and properly ended.
async fn stream_body<B>(
    shared: &Shared,
    mut body: Pin<&mut B>,
    framing: Out,
    mut out: Vec<u8>,
) -> bool
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut left = match framing {
        Out::Length(n) => n,
        _ => u64::MAX,
    };
    loop {
        let frame = if out.is_empty() {
            // Wait for the next frame, watching for the client going away meanwhile.
            let next = poll_fn(|cx| match poll_frame(body.as_mut(), cx) {
                Poll::Ready(frame) => Poll::Ready(Some(frame)),
                Poll::Pending => shared.poll_gone(cx).map(|()| None),
            })
            .await;
            match next {
                Some(frame) => frame,
                None => {
                    tracing::debug!("client closed during the answer: cancelled");
                    return false;
                }
            }
        } else {
            // Bytes are waiting (the head): take a frame only if one is ready now.
            let polled = poll_fn(|cx| Poll::Ready(poll_frame(body.as_mut(), cx))).await;
            match polled {
                Poll::Ready(frame) => frame,
                Poll::Pending => {
                    if shared.write_all([&out, &[], &[]]).await.is_err() {
                        return false;
                    }
                    out.clear();
                    continue;
                }
            }
        };
        match frame {
            None => {
                if framing == Out::Chunked {
                    out.extend_from_slice(LAST_CHUNK);
                }
                let written = shared.write_all([&out, &[], &[]]).await.is_ok();
                return written && !matches!(framing, Out::Length(_) if left != 0);
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "answer body failed: ending the connection");
                // What came before the failure (an SSE error event) still goes out.
                let _ = shared.write_all([&out, &[], &[]]).await;
                return false;
            }
            Some(Ok(frame)) => {
                let Ok(mut data) = frame.into_data() else {
                    continue; // trailers are not forwarded
                };
                if data.is_empty() {
                    continue;
                }
                let mut overflow = false;
                if let Out::Length(_) = framing {
                    if data.len() as u64 > left {
                        data.truncate(usize::try_from(left).unwrap_or(0));
                        overflow = true;
                    }
                    left -= data.len() as u64;
                }
                let suffix: &[u8] = if framing == Out::Chunked {
                    write::chunk_size(&mut out, data.len());
                    if body.is_end_stream() {
                        b"\r\n0\r\n\r\n"
                    } else {
                        b"\r\n"
                    }
                } else {
                    &[]
                };
                let written = if out.len() + data.len() + suffix.len() <= write::GATHER_MAX {
                    // One `send` rather than a `writev` of three parts.
                    out.extend_from_slice(&data);
                    out.extend_from_slice(suffix);
                    if !overflow && !body.is_end_stream() {
                        // Frames that are ready now (events an engine sent together, read in
                        // one go) join this one in the same `send`; the first that is not
                        // ready sends what is gathered at once (the branch at the top), so
                        // nothing waits for a later frame.
                        continue;
                    }
                    shared.write_all([&out, &[], &[]]).await
                } else {
                    shared.write_all([&out, &data, suffix]).await
                };
                if written.is_err() || overflow {
                    return false;
                }
                out.clear();
                if body.is_end_stream() {
                    return !matches!(framing, Out::Length(_) if left != 0);
                }
            }
        }
    }
}

/// A body frame, its error boxed (so that no `B::Error` is held across an await).
fn poll_frame<B>(
    body: Pin<&mut B>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    body.poll_frame(cx)
        .map(|f| f.map(|r| r.map_err(Into::into)))
}

/// The answer to a refused head (the connection closes after it).
fn refusal(e: HeadError) -> Vec<u8> {
    let status = e.status();
    let body = crate::error_body(&e.to_string(), "invalid_request_error", e.code());
    let mut out = Vec::with_capacity(192 + body.len());
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    write::head(
        &mut out,
        status,
        &headers,
        Some(body.len() as u64),
        false,
        false,
        false,
    );
    out.extend_from_slice(&body);
    out
}
