//! Refusing HTTP/1 requests that carry both `Content-Length` and `Transfer-Encoding`.
//!
//! Such a request is the classic vehicle of request smuggling: a front and a back that frame
//! the body differently disagree on where the next request starts. hyper 1 frames it by
//! `Transfer-Encoding` (RFC 9112 §6.1), removes `Content-Length` from the parsed headers and
//! closes the connection after answering, so it is safe by itself, but the service never
//! learns that the conflict happened and cannot answer 400. hyper exposes neither the raw head
//! nor a flag for it.
//!
//! So `H1Guard` wraps the connection's IO under hyper and scans the bytes hyper reads: the
//! lines of every request head (request line, header lines) and just enough of each body to
//! find where the next head starts (a `Content-Length` skip, or chunk-size lines and trailers
//! for chunked bodies; body data is skipped without being looked at). When a head holds both
//! headers, the guard withholds the blank line that would complete that head and hands hyper a
//! NUL byte instead, which hyper's parser rejects: hyper answers `400 Bad Request` itself and
//! closes the connection. Nothing of that head reaches the service, and no byte after it is
//! read, so a request smuggled in its body is never answered. Requests before it on the same
//! keep-alive connection are answered normally and in order (hyper answers one head at a
//! time).
//!
//! Cost: one `memchr` per line and a copy of at most `LINE_CAP` bytes of each line; body
//! bytes cost an integer subtraction per read. The guard stops scanning (and becomes a plain
//! pass-through) on an HTTP/2 connection (prior-knowledge preface), after a `CONNECT` or
//! `Upgrade` request (the bytes that follow may not be HTTP/1), and on input it cannot frame
//! the way hyper would (hyper then refuses that input and closes the connection itself). After
//! that point the connection still has hyper's own protection: a request with both headers is
//! framed as chunked and the connection is closed after its response.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::events::ConnectionEvents;

/// The HTTP/2 connection preface.
pub(crate) const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Bytes kept of each line: enough for any header name we look for and a `Content-Length`
/// value with its surrounding spaces.
pub(crate) const LINE_CAP: usize = 96;

/// What hyper reads in place of the blank line of a conflicting head.
const POISON: &[u8] = b"\0\r\n\r\n";

/// Where the scanner is in the byte stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// At the start of the connection, matching the HTTP/2 preface (bytes matched).
    Preface(usize),
    /// In a request head (the request line, then header lines).
    Head,
    /// In a `Content-Length` body (bytes left).
    Body(u64),
    /// In a chunk-size line.
    ChunkSize,
    /// In chunk data (bytes left).
    ChunkData(u64),
    /// In the line break after chunk data.
    ChunkEnd,
    /// In the trailer section of a chunked body.
    Trailers,
    /// Not scanning any more.
    Passthrough,
}

/// What the header lines of the current head said.
#[derive(Clone, Copy, Debug, Default)]
struct HeadFlags {
    request_line: bool,
    content_length: bool,
    length: Option<u64>,
    length_unknown: bool,
    transfer_encoding: bool,
    upgrade: bool,
}

/// What a line told the scanner.
enum Step {
    Continue,
    Conflict,
    Stop,
}

/// The scanner itself, separate from IO so it can be tested on byte sequences (public only for
/// fuzzing).
#[doc(hidden)]
#[derive(Debug)]
pub struct Scanner {
    phase: Phase,
    head: HeadFlags,
    line: [u8; LINE_CAP],
    line_len: usize,
    line_truncated: bool,
}

impl Default for Scanner {
    fn default() -> Self {
        Self::new()
    }
}

impl Scanner {
    pub fn new() -> Self {
        Self {
            phase: Phase::Preface(0),
            head: HeadFlags::default(),
            line: [0; LINE_CAP],
            line_len: 0,
            line_truncated: false,
        }
    }

    /// A scanner that never looks at anything (an ALPN `h2` connection).
    pub(crate) fn passthrough() -> Self {
        Self {
            phase: Phase::Passthrough,
            ..Self::new()
        }
    }

    pub fn is_passthrough(&self) -> bool {
        self.phase == Phase::Passthrough
    }

    /// Scans the next bytes of the stream. `Some(i)`: the head ending at `bytes[i]` (the line
    /// feed of its blank line) has both headers.
    pub fn feed(&mut self, bytes: &[u8]) -> Option<usize> {
        let mut i = 0;
        while i < bytes.len() {
            match self.phase {
                Phase::Passthrough => return None,
                Phase::Preface(matched) => {
                    let want = &PREFACE[matched..];
                    let n = want.len().min(bytes.len() - i);
                    // Matched bytes are consumed whether the whole preface arrives at once or
                    // byte by byte, so the decision below does not depend on the split.
                    let common = bytes[i..i + n]
                        .iter()
                        .zip(&want[..n])
                        .take_while(|(a, b)| a == b)
                        .count();
                    i += common;
                    let matched = matched + common;
                    if common == n {
                        self.phase = if matched == PREFACE.len() {
                            Phase::Passthrough
                        } else {
                            Phase::Preface(matched)
                        };
                    } else if matched >= 16 {
                        // "PRI * HTTP/2.0\r\n" and then something else: hyper refuses it.
                        self.phase = Phase::Passthrough;
                    } else {
                        // An HTTP/1 request line that began like the preface (say "POST").
                        self.push_line(&PREFACE[..matched]);
                        self.phase = Phase::Head;
                    }
                }
                Phase::Body(left) | Phase::ChunkData(left) => {
                    let n = left.min((bytes.len() - i) as u64);
                    i += n as usize;
                    let left = left - n;
                    self.phase = match (self.phase, left) {
                        (Phase::Body(_), 0) => self.next_message(),
                        (Phase::Body(_), _) => Phase::Body(left),
                        (_, 0) => Phase::ChunkEnd,
                        _ => Phase::ChunkData(left),
                    };
                }
                Phase::Head | Phase::ChunkSize | Phase::ChunkEnd | Phase::Trailers => {
                    let rest = &bytes[i..];
                    let Some(at) = memchr::memchr(b'\n', rest) else {
                        self.push_line(rest);
                        return None;
                    };
                    self.push_line(&rest[..at]);
                    let lf = i + at;
                    i = lf + 1;
                    match self.end_line() {
                        Step::Continue => {}
                        Step::Conflict => {
                            self.phase = Phase::Passthrough;
                            return Some(lf);
                        }
                        Step::Stop => {
                            self.phase = Phase::Passthrough;
                            return None;
                        }
                    }
                }
            }
        }
        None
    }

    fn push_line(&mut self, bytes: &[u8]) {
        let room = LINE_CAP - self.line_len;
        let n = room.min(bytes.len());
        self.line[self.line_len..self.line_len + n].copy_from_slice(&bytes[..n]);
        self.line_len += n;
        self.line_truncated |= n < bytes.len();
    }

    fn next_message(&mut self) -> Phase {
        self.head = HeadFlags::default();
        Phase::Head
    }

    /// Handles the complete line in the buffer (its line feed consumed).
    fn end_line(&mut self) -> Step {
        let mut len = self.line_len;
        let truncated = self.line_truncated;
        self.line_len = 0;
        self.line_truncated = false;
        if !truncated && len > 0 && self.line[len - 1] == b'\r' {
            len -= 1;
        }
        let line = &self.line[..len];
        let empty = len == 0 && !truncated;
        match self.phase {
            Phase::Head => self.head_line(empty, truncated, len),
            Phase::ChunkSize => {
                let mut size = 0u64;
                let mut digits = 0;
                for &b in line {
                    let d = match b {
                        b'0'..=b'9' => b - b'0',
                        b'a'..=b'f' => b - b'a' + 10,
                        b'A'..=b'F' => b - b'A' + 10,
                        _ => break,
                    };
                    digits += 1;
                    if digits > 15 {
                        return Step::Stop;
                    }
                    size = (size << 4) | u64::from(d);
                }
                if digits == 0 {
                    return Step::Stop;
                }
                self.phase = if size == 0 {
                    Phase::Trailers
                } else {
                    Phase::ChunkData(size)
                };
                Step::Continue
            }
            Phase::ChunkEnd => {
                if !empty {
                    return Step::Stop;
                }
                self.phase = Phase::ChunkSize;
                Step::Continue
            }
            Phase::Trailers => {
                if empty {
                    self.phase = self.next_message();
                }
                Step::Continue
            }
            _ => Step::Continue,
        }
    }

    fn head_line(&mut self, empty: bool, truncated: bool, len: usize) -> Step {
        let line = &self.line[..len];
        if !self.head.request_line {
            // Empty lines before a request line are allowed (RFC 9112 §2.2).
            if !empty {
                self.head.request_line = true;
                self.head.upgrade = line.starts_with(b"CONNECT ");
            }
            return Step::Continue;
        }
        if empty {
            let head = self.head;
            if head.content_length && head.transfer_encoding {
                return Step::Conflict;
            }
            if head.upgrade {
                return Step::Stop;
            }
            self.phase = if head.transfer_encoding {
                // Anything but a final `chunked` is refused by hyper.
                Phase::ChunkSize
            } else if head.length_unknown {
                return Step::Stop;
            } else {
                match head.length {
                    Some(n) if n > 0 => Phase::Body(n),
                    _ => self.next_message(),
                }
            };
            return Step::Continue;
        }
        let Some(colon) = memchr::memchr(b':', line) else {
            return Step::Continue;
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        if name.eq_ignore_ascii_case(b"content-length") {
            self.head.content_length = true;
            let value = value.trim_ascii();
            let parsed = (!truncated && !value.is_empty() && value.len() <= 19)
                .then(|| {
                    value.iter().try_fold(0u64, |acc, b| {
                        b.is_ascii_digit().then(|| acc * 10 + u64::from(b - b'0'))
                    })
                })
                .flatten();
            match (parsed, self.head.length) {
                (Some(n), None) => self.head.length = Some(n),
                (Some(n), Some(prev)) if n == prev => {}
                _ => self.head.length_unknown = true,
            }
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            self.head.transfer_encoding = true;
        } else if name.eq_ignore_ascii_case(b"upgrade") {
            self.head.upgrade = true;
        }
        Step::Continue
    }
}

/// Connection IO with the scanner on its read side; writes pass through, bounded in time by
/// the write-stall limit when one is set.
pub(crate) struct H1Guard<S> {
    inner: S,
    scanner: Scanner,
    /// Once a conflict is found: the poison bytes still to hand over (then end of stream).
    poison: Option<&'static [u8]>,
    events: Option<Arc<dyn ConnectionEvents>>,
    stall: Option<WriteStall>,
}

/// Fails a write that the client has left pending (its receive window full: it stopped
/// reading) for longer than `limit`. hyper polls a response body only when the client takes
/// bytes, so without this a client that keeps its connection open but reads nothing would hold
/// its upstream request (and the engine's slot) indefinitely. The error closes the connection,
/// which drops the response body and so cancels the upstream request.
struct WriteStall {
    limit: Duration,
    /// Armed while a write is pending; created at the first stall only.
    timer: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl WriteStall {
    /// Called with the outcome of a write: disarms on progress; on `Pending`, arms the timer
    /// (once per stall) and fails the write once it fires.
    fn check<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.armed = false;
            return polled;
        }
        let deadline = Instant::now() + self.limit;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.armed {
            timer.as_mut().reset(deadline);
            self.armed = true;
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(write_stalled(self.limit))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The error that ends a connection whose client left a write pending for `limit` (logged
/// here, once, for every listener).
pub(crate) fn write_stalled(limit: Duration) -> io::Error {
    tracing::debug!(?limit, "client stopped reading: closing the connection");
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the client did not read its answer within the write-stall timeout",
    )
}

impl<S> std::fmt::Debug for H1Guard<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H1Guard")
            .field("scanner", &self.scanner.phase)
            .finish_non_exhaustive()
    }
}

impl<S> H1Guard<S> {
    /// A guard that scans (plain connections, or TLS without ALPN `h2`).
    pub(crate) fn new(inner: S, events: Option<Arc<dyn ConnectionEvents>>) -> Self {
        Self {
            inner,
            scanner: Scanner::new(),
            poison: None,
            events,
            stall: None,
        }
    }

    /// The connection itself, without the guard.
    pub(crate) fn into_socket(self) -> S {
        self.inner
    }

    /// Fails writes left pending for longer than `limit` (see [`WriteStall`]).
    pub(crate) fn with_write_stall(mut self, limit: Option<Duration>) -> Self {
        self.stall = limit.map(|limit| WriteStall {
            limit,
            timer: None,
            armed: false,
        });
        self
    }

    /// A guard that only passes bytes through (ALPN `h2`).
    pub(crate) fn passthrough(inner: S) -> Self {
        Self {
            inner,
            scanner: Scanner::passthrough(),
            poison: None,
            events: None,
            stall: None,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for H1Guard<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(poison) = this.poison {
            let n = poison.len().min(buf.remaining());
            buf.put_slice(&poison[..n]);
            this.poison = Some(&poison[n..]);
            return Poll::Ready(Ok(()));
        }
        if this.scanner.is_passthrough() {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        if let Some(at) = this.scanner.feed(&buf.filled()[before..]) {
            buf.set_filled(before + at);
            let n = POISON.len().min(buf.remaining());
            buf.put_slice(&POISON[..n]);
            this.poison = Some(&POISON[n..]);
            tracing::debug!("request with both Content-Length and Transfer-Encoding refused");
            if let Some(events) = &this.events {
                events.framing_conflict();
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for H1Guard<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        match &mut this.stall {
            Some(stall) => stall.check(cx, polled),
            None => polled,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        match &mut this.stall {
            Some(stall) => stall.check(cx, polled),
            None => polled,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_flush(cx);
        match &mut this.stall {
            Some(stall) => stall.check(cx, polled),
            None => polled,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `input` in pieces of `step` bytes; the absolute offset of a conflict.
    fn scan(input: &[u8], step: usize) -> Option<usize> {
        let mut s = Scanner::new();
        let mut offset = 0;
        for piece in input.chunks(step) {
            if let Some(at) = s.feed(piece) {
                return Some(offset + at);
            }
            offset += piece.len();
        }
        None
    }

    fn every_split(input: &[u8]) -> Vec<Option<usize>> {
        (1..=input.len()).map(|step| scan(input, step)).collect()
    }

    const BOTH: &[u8] = b"POST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";

    #[test]
    fn finds_both_headers_at_the_blank_line() {
        let lf = BOTH.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 3;
        for r in every_split(BOTH) {
            assert_eq!(r, Some(lf));
        }
        let reversed = b"POST / HTTP/1.1\ntransfer-encoding: chunked\nCONTENT-LENGTH: 0\n\n";
        assert_eq!(scan(reversed, 7), Some(reversed.len() - 1));
    }

    #[test]
    fn plain_requests_pass() {
        let input = b"POST /a HTTP/1.1\r\nContent-Length: 11\r\n\r\nhello worldGET /b HTTP/1.1\r\nHost: x\r\n\r\nPOST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n0\r\nTrailer: v\r\n\r\n";
        for r in every_split(input) {
            assert_eq!(r, None);
        }
    }

    #[test]
    fn finds_conflict_after_bodies_that_look_like_heads() {
        // Body bytes that look like a conflicting head are data, not a head.
        let body = b"X\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        let mut input =
            format!("POST /a HTTP/1.1\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
        input.extend_from_slice(body);
        for r in every_split(&input) {
            assert_eq!(r, None);
        }
        // A chunked body first, then a real conflicting head.
        let mut input =
            b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n\n\n\n\r\n0\r\n\r\n"
                .to_vec();
        let start = input.len();
        input.extend_from_slice(BOTH);
        let lf = start + BOTH.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 3;
        for r in every_split(&input) {
            assert_eq!(r, Some(lf));
        }
    }

    #[test]
    fn stops_on_http2_and_upgrades() {
        let mut h2 = PREFACE.to_vec();
        h2.extend_from_slice(BOTH);
        for r in every_split(&h2) {
            assert_eq!(r, None);
        }
        let mut up = b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n".to_vec();
        up.extend_from_slice(BOTH);
        assert_eq!(scan(&up, 5), None);
    }

    /// Found by fuzzing (`h1_framing`): a stream starting with the preface's request line and
    /// then something else was passed through when it arrived byte by byte, but scanned as
    /// HTTP/1 (finding the conflict) when it arrived in one read.
    #[test]
    fn preface_lookalike_is_judged_the_same_for_every_split() {
        let input = b"PRI * HTTP/2.0\r\n\rPOST /a HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        let results = every_split(input);
        assert!(results.iter().all(|r| *r == results[0]), "{results:?}");
        assert_eq!(results[0], None);
        // Matching fewer than 16 bytes of the preface is an HTTP/1 request line.
        let input = b"PRI /x HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        let lf = input.len() - 1;
        assert!(every_split(input).iter().all(|r| *r == Some(lf)));
    }

    #[test]
    fn post_is_not_mistaken_for_the_preface() {
        assert!(scan(BOTH, 1).is_some());
        let pri = b"PRI /x HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(scan(pri, 3).is_some());
    }
}
