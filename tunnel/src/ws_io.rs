//! A WebSocket carrying binary messages, seen as one byte stream (`AsyncRead + AsyncWrite`) for
//! yamux, with the tunnel's liveness built in.
//!
//! The HTTP upgrade is done elsewhere (`client`, `server`); this module speaks the frames of
//! RFC 6455 itself, on the upgraded connection:
//!
//! - Reads hand out the payload of each binary frame (fragmented messages included) in order;
//!   ping, pong and close are handled here and count as signs of life, like every byte read.
//!   A text message, an unmasked client frame or a masked server frame, a reserved bit or
//!   opcode, a fragmented or oversized control frame, and a message over
//!   [`MAX_MESSAGE_BYTES`] are protocol errors (`InvalidData`), which end the connection.
//! - Frame payloads are copied straight into the reader's buffer (and unmasked there); a large
//!   payload is read from the connection directly into it. Frame headers and small frames go
//!   through a read buffer ([`READ_CHUNK`] bytes while bytes keep arriving).
//! - Writes are gathered in one buffer and sent as one binary message per flush (yamux flushes
//!   after every frame, so a message is usually one yamux frame), at most
//!   [`MAX_OUT_MESSAGE`] bytes. The buffer keeps room in front for the frame header, is masked
//!   in place (client side) and written out as is. While a message is being written out,
//!   further writes wait: the write side never holds more than one message.
//! - Both buffers exist only while the connection is busy: they are dropped after
//!   [`IDLE_RELEASE`] without a byte read or a message sent, and an idle connection waits for
//!   bytes with a small buffer on the stack. They start small (a ping or a window update costs
//!   a few hundred bytes for a second) and grow with the traffic, bounded as above.
//! - Every `ping_interval` a WebSocket ping goes out; pings are answered with pongs. When
//!   nothing at all has been received for `dead_after`, reads fail with `TimedOut`, which ends
//!   the yamux connection and with it every stream: a silently stalled peer is detected even
//!   while writes are blocked.
//! - Shutting down writes sends a close frame (1000), then shuts the connection down; a close
//!   frame from the peer is answered (best effort) and reads end there. A connection that ends
//!   without a close frame is an error (`UnexpectedEof`).
//!
//! So an idle tunnel holds no buffer here, however much it carried before.
//! Everything runs inside the one task that polls the yamux connection, so there is no lock.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use bytes::{Buf as _, BufMut as _, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::protocol::MAX_MESSAGE_BYTES;

/// Liveness settings of one tunnel connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Liveness {
    /// A WebSocket ping is sent this often (at most 30 s: middleboxes cut idle connections).
    pub ping_interval: Duration,
    /// The peer is declared dead after this long without any frame from it.
    pub dead_after: Duration,
}

impl Default for Liveness {
    fn default() -> Self {
        Self {
            ping_interval: Duration::from_secs(30),
            dead_after: Duration::from_secs(45),
        }
    }
}

/// Which end of the WebSocket this is: the client masks what it sends and refuses masked
/// frames, the server refuses unmasked ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Client,
    Server,
}

/// The largest binary message this side sends (the write buffer is pushed out beyond it).
pub const MAX_OUT_MESSAGE: usize = 64 * 1024;

/// The read buffer's size while bytes keep arriving.
pub const READ_CHUNK: usize = 8 * 1024;

/// The stack buffer an idle connection waits for bytes with. When what arrives fits, the read
/// buffer starts at [`SMALL_BUFFER`] (a ping, a yamux window update or ping).
const IDLE_PROBE: usize = 64;

/// The first size of either buffer for a few bytes: a burst of small frames (pings, window
/// updates, the yamux ping of a new connection) costs no more than this.
const SMALL_BUFFER: usize = 256;

/// Buffers are dropped after this long without a byte read or a message sent.
pub const IDLE_RELEASE: Duration = Duration::from_millis(100);

/// A frame payload at least this long, with the reader asking for at least as much, is read
/// from the connection straight into the reader's buffer.
const DIRECT_READ_MIN: usize = 2 * 1024;

/// The longest frame header: 2 bytes, an 8-byte length, a 4-byte mask.
const MAX_HEADER: usize = 14;

/// The longest control frame payload.
const MAX_CONTROL_PAYLOAD: usize = 125;

const OP_CONTINUATION: u8 = 0x0;
const OP_TEXT: u8 = 0x1;
const OP_BINARY: u8 = 0x2;
const OP_CLOSE: u8 = 0x8;
const OP_PING: u8 = 0x9;
const OP_PONG: u8 = 0xa;

/// The close code sent on shutdown: normal closure.
const CLOSE_NORMAL: u16 = 1000;

/// A WebSocket protocol violation by the peer.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("a reserved bit is set in a WebSocket frame (no extension was negotiated)")]
    ReservedBits,
    #[error("reserved WebSocket opcode {0:#x}")]
    ReservedOpcode(u8),
    #[error("a fragmented WebSocket control frame")]
    FragmentedControl,
    #[error("a WebSocket control frame of {0} bytes (at most 125)")]
    ControlTooLong(u64),
    #[error("an unmasked frame from the WebSocket client")]
    Unmasked,
    #[error("a masked frame from the WebSocket server")]
    Masked,
    #[error("a WebSocket message of more than {MAX_MESSAGE_BYTES} bytes")]
    TooLarge,
    #[error("a text message on a binary tunnel")]
    Text,
    #[error("a WebSocket continuation frame outside a fragmented message")]
    UnexpectedContinuation,
    #[error("a new WebSocket message inside a fragmented one")]
    ExpectedContinuation,
}

impl From<FrameError> for io::Error {
    fn from(e: FrameError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// A parsed frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    fin: bool,
    opcode: u8,
    mask: Option<[u8; 4]>,
    len: u64,
    /// Bytes the header itself takes.
    size: usize,
}

impl Header {
    fn is_control(&self) -> bool {
        self.opcode & 0x8 != 0
    }
}

/// Parses a frame header from the start of `b`; `None` while it is incomplete. Checks what
/// does not depend on the connection's state: reserved bits and opcodes, control frame rules,
/// the frame length bound.
fn parse_header(b: &[u8]) -> Result<Option<Header>, FrameError> {
    let Some(&b0) = b.first() else {
        return Ok(None);
    };
    if b0 & 0x70 != 0 {
        return Err(FrameError::ReservedBits);
    }
    let fin = b0 & 0x80 != 0;
    let opcode = b0 & 0x0f;
    if !matches!(
        opcode,
        OP_CONTINUATION | OP_TEXT | OP_BINARY | OP_CLOSE | OP_PING | OP_PONG
    ) {
        return Err(FrameError::ReservedOpcode(opcode));
    }
    let Some(&b1) = b.get(1) else {
        return Ok(None);
    };
    let masked = b1 & 0x80 != 0;
    let (len, mut size) = match b1 & 0x7f {
        126 => {
            let Some(l) = b.get(2..4) else {
                return Ok(None);
            };
            (u64::from(u16::from_be_bytes([l[0], l[1]])), 4)
        }
        127 => {
            let Some(l) = b.get(2..10) else {
                return Ok(None);
            };
            let mut n = [0u8; 8];
            n.copy_from_slice(l);
            (u64::from_be_bytes(n), 10)
        }
        short => (u64::from(short), 2),
    };
    // Refused as soon as the length is known.
    if opcode & 0x8 != 0 {
        if !fin {
            return Err(FrameError::FragmentedControl);
        }
        if len > MAX_CONTROL_PAYLOAD as u64 {
            return Err(FrameError::ControlTooLong(len));
        }
    } else if len > MAX_MESSAGE_BYTES as u64 {
        return Err(FrameError::TooLarge);
    }
    let mask = if masked {
        let Some(m) = b.get(size..size + 4) else {
            return Ok(None);
        };
        size += 4;
        Some([m[0], m[1], m[2], m[3]])
    } else {
        None
    };
    Ok(Some(Header {
        fin,
        opcode,
        mask,
        len,
        size,
    }))
}

/// Writes a frame header (FIN set) into `out`; returns its length.
fn encode_header(
    out: &mut [u8; MAX_HEADER],
    opcode: u8,
    len: usize,
    mask: Option<[u8; 4]>,
) -> usize {
    out[0] = 0x80 | opcode;
    let mask_bit = if mask.is_some() { 0x80 } else { 0 };
    let mut size = if len < 126 {
        out[1] = mask_bit | len as u8;
        2
    } else if let Ok(short) = u16::try_from(len) {
        out[1] = mask_bit | 126;
        out[2..4].copy_from_slice(&short.to_be_bytes());
        4
    } else {
        out[1] = mask_bit | 127;
        out[2..10].copy_from_slice(&(len as u64).to_be_bytes());
        10
    };
    if let Some(key) = mask {
        out[size..size + 4].copy_from_slice(&key);
        size += 4;
    }
    size
}

/// XORs `data` with the mask `key`, `data` starting `offset` bytes into the frame payload.
fn apply_mask(data: &mut [u8], key: [u8; 4], offset: usize) {
    let mut k = [0u8; 4];
    for (i, b) in k.iter_mut().enumerate() {
        *b = key[(offset + i) % 4];
    }
    let word = u32::from_ne_bytes(k);
    let mut chunks = data.chunks_exact_mut(4);
    for c in &mut chunks {
        let w = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]) ^ word;
        c.copy_from_slice(&w.to_ne_bytes());
    }
    for (b, m) in chunks.into_remainder().iter_mut().zip(k) {
        *b ^= m;
    }
}

/// The data frame whose payload is being handed out.
#[derive(Debug)]
struct Payload {
    remaining: usize,
    mask: Option<[u8; 4]>,
    /// Payload bytes handed out so far (the mask's phase).
    done: usize,
}

/// One control frame being written out (header and payload, at most 139 bytes).
#[derive(Debug)]
struct ControlOut {
    bytes: [u8; MAX_HEADER + MAX_CONTROL_PAYLOAD],
    len: u8,
    pos: u8,
}

/// A control frame waiting to go out, between data messages.
#[derive(Debug, Default)]
struct ControlQueue {
    close: bool,
    pong: Option<([u8; MAX_CONTROL_PAYLOAD], u8)>,
    ping: bool,
}

/// A WebSocket as a byte stream. See the module documentation.
#[derive(Debug)]
pub struct WsIo<S> {
    io: S,
    endpoint: Endpoint,
    /// Bytes read and not yet parsed or handed out; no allocation while the connection is idle.
    read: BytesMut,
    /// Whether `read` holds an allocation (its `capacity` does not count consumed bytes).
    read_held: bool,
    /// The data frame being handed out.
    payload: Option<Payload>,
    /// Inside a fragmented message: its length so far.
    fragmented: Option<usize>,
    /// A close frame was received: reads end.
    eof: bool,
    /// The message being gathered (after [`MAX_HEADER`] bytes of room for its header), or
    /// being written out from `sending`. Kept between messages while the connection is busy.
    write: BytesMut,
    sending: Option<usize>,
    /// A control frame being written out (never in the middle of a message).
    control: Option<ControlOut>,
    queue: ControlQueue,
    close_sent: bool,
    /// Bytes went to `io` since its last flush (a TLS stream may hold them until flushed).
    io_dirty: bool,
    liveness: Liveness,
    /// When the last bytes were read, and when the last message went out.
    last_rx: Instant,
    last_tx: Instant,
    next_ping: Instant,
    /// Fires at the earliest of: the next ping, the dead-peer deadline, and (while a buffer
    /// is held) the idle-release check.
    timer: Pin<Box<Sleep>>,
    /// The waker the timer was last polled with, until it is reset.
    timer_waker: Option<Waker>,
}

impl<S> WsIo<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    /// Frames over `io`, an upgraded connection; `read_ahead` holds bytes already read past the
    /// handshake (the start of the first frames).
    pub fn new(io: S, endpoint: Endpoint, liveness: Liveness, read_ahead: BytesMut) -> Self {
        let now = Instant::now();
        let mut this = Self {
            io,
            endpoint,
            read_held: read_ahead.capacity() > 0,
            read: read_ahead,
            payload: None,
            fragmented: None,
            eof: false,
            write: BytesMut::new(),
            sending: None,
            control: None,
            queue: ControlQueue::default(),
            close_sent: false,
            io_dirty: false,
            liveness,
            last_rx: now,
            last_tx: now,
            next_ping: now + liveness.ping_interval,
            timer: Box::pin(tokio::time::sleep_until(
                now + liveness.ping_interval.min(liveness.dead_after),
            )),
            timer_waker: None,
        };
        if this.read_held {
            this.arm_release();
        }
        this
    }

    /// Whether a read buffer is allocated, and the write buffer's capacity (for tests and
    /// measurements).
    pub fn buffers(&self) -> (bool, usize) {
        (self.read_held, self.write.capacity())
    }

    fn mask_key(&self) -> Option<[u8; 4]> {
        match self.endpoint {
            Endpoint::Client => Some(rand::random()),
            Endpoint::Server => None,
        }
    }

    /// Runs the timer: queues a ping when one is due, drops idle buffers, and fails with
    /// `TimedOut` once the peer is dead.
    ///
    /// Every read comes here (several per request): while the timer holds this task's waker
    /// and has not fired, it is not polled again (a poll takes the task's budget and
    /// registers the waker anew, about a hundred instructions).
    fn poll_timers(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if !self.timer.is_elapsed()
            && self
                .timer_waker
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
        {
            return Ok(());
        }
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            if now >= self.next_ping {
                self.queue.ping = true;
                self.next_ping = now + self.liveness.ping_interval;
            }
            let dead_at = self.last_rx + self.liveness.dead_after;
            if now >= dead_at {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "tunnel peer silent for longer than the dead-peer timeout",
                ));
            }
            let mut release_at = self.last_rx.max(self.last_tx) + IDLE_RELEASE;
            if now >= release_at {
                self.release_buffers();
                release_at = now + IDLE_RELEASE;
            }
            let mut next = self.next_ping.min(dead_at);
            if self.holds_buffers() {
                next = next.min(release_at);
            }
            self.timer.as_mut().reset(next);
        }
        self.timer_waker = Some(cx.waker().clone());
        Ok(())
    }

    fn holds_buffers(&self) -> bool {
        self.read_held || self.write.capacity() > 0
    }

    /// Drops the buffers that hold nothing. (Without a read buffer, `read` is empty.)
    fn release_buffers(&mut self) {
        if self.read.is_empty() {
            self.read = BytesMut::new();
            self.read_held = false;
        }
        if self.write.is_empty() {
            self.write = BytesMut::new();
        }
    }

    /// A buffer was just allocated: have the timer check for idleness in time.
    fn arm_release(&mut self) {
        let at = Instant::now() + IDLE_RELEASE;
        if self.timer.deadline() > at {
            self.timer.as_mut().reset(at);
            self.timer_waker = None;
        }
    }

    fn has_control(&self) -> bool {
        self.control.is_some() || self.queue.close || self.queue.ping || self.queue.pong.is_some()
    }

    /// Sends queued control frames (and the rest of a message being written) without waiting:
    /// what cannot be written now goes out with the next write or flush.
    fn push_control(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.has_control()
            && let Poll::Ready(r) = self.poll_drain(cx)
        {
            r?;
            match Pin::new(&mut self.io).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.io_dirty = false,
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => {}
            }
        }
        Ok(())
    }

    /// The next queued control frame, encoded; `None` when nothing is queued.
    fn next_control(&mut self) -> Option<ControlOut> {
        if self.close_sent {
            self.queue = ControlQueue::default();
            return None;
        }
        let mut out = ControlOut {
            bytes: [0; MAX_HEADER + MAX_CONTROL_PAYLOAD],
            len: 0,
            pos: 0,
        };
        let code = CLOSE_NORMAL.to_be_bytes();
        let (opcode, payload): (u8, &[u8]) = if self.queue.close {
            self.queue.close = false;
            self.close_sent = true;
            (OP_CLOSE, &code)
        } else if let Some((data, len)) = &self.queue.pong {
            (OP_PONG, &data[..usize::from(*len)])
        } else if self.queue.ping {
            self.queue.ping = false;
            (OP_PING, &[])
        } else {
            return None;
        };
        let mask = self.mask_key();
        let mut header = [0u8; MAX_HEADER];
        let size = encode_header(&mut header, opcode, payload.len(), mask);
        out.bytes[..size].copy_from_slice(&header[..size]);
        let body = &mut out.bytes[size..size + payload.len()];
        body.copy_from_slice(payload);
        if let Some(key) = mask {
            apply_mask(body, key, 0);
        }
        out.len = (size + payload.len()) as u8;
        if opcode == OP_PONG {
            self.queue.pong = None;
        }
        Some(out)
    }

    /// Writes out the control frame and the message under way, then queued control frames.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            if let Some(control) = &mut self.control {
                let bytes = &control.bytes[usize::from(control.pos)..usize::from(control.len)];
                let n = ready!(Pin::new(&mut self.io).poll_write(cx, bytes))?;
                self.io_dirty = true;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                control.pos += n as u8;
                if control.pos == control.len {
                    self.control = None;
                }
                continue;
            }
            if let Some(pos) = self.sending {
                let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.write[pos..]))?;
                self.io_dirty = true;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                if pos + n == self.write.len() {
                    // The message is out; the buffer stays for the next one until idle.
                    self.write.clear();
                    self.sending = None;
                    self.last_tx = Instant::now();
                } else {
                    self.sending = Some(pos + n);
                }
                continue;
            }
            match self.next_control() {
                Some(control) => self.control = Some(control),
                None => return Poll::Ready(Ok(())),
            }
        }
    }

    /// Makes room for `n` more bytes of the message in the write buffer (and for the header in
    /// front of a new message): [`SMALL_BUFFER`] at least, doubling, exactly as much as asked
    /// beyond that, never more than one whole message.
    fn grow_write(&mut self, n: usize) {
        let need = self.write.len().max(MAX_HEADER) + n;
        if need <= self.write.capacity() {
            return;
        }
        if self.write.capacity() == 0 {
            self.arm_release();
        }
        let capacity = need
            .max(MAX_HEADER + SMALL_BUFFER)
            .max(self.write.capacity() * 2)
            .min(MAX_HEADER + MAX_OUT_MESSAGE);
        let mut grown = BytesMut::with_capacity(capacity);
        grown.extend_from_slice(&self.write);
        self.write = grown;
    }

    /// Turns the gathered bytes into one binary message ready to be written out.
    fn seal(&mut self) {
        if self.sending.is_some() || self.write.len() <= MAX_HEADER {
            return;
        }
        let len = self.write.len() - MAX_HEADER;
        let mask = self.mask_key();
        let mut header = [0u8; MAX_HEADER];
        let size = encode_header(&mut header, OP_BINARY, len, mask);
        if let Some(key) = mask {
            apply_mask(&mut self.write[MAX_HEADER..], key, 0);
        }
        let start = MAX_HEADER - size;
        self.write[start..MAX_HEADER].copy_from_slice(&header[..size]);
        self.sending = Some(start);
    }

    /// Reads more bytes into the read buffer, `need` bytes in it at least when it is done.
    /// Without a read buffer (an idle connection), waits for bytes with a small one on the
    /// stack and takes a read buffer only once they are there.
    fn poll_fill(&mut self, cx: &mut Context<'_>, need: usize) -> Poll<io::Result<usize>> {
        if !self.read_held {
            let mut probe = [0u8; IDLE_PROBE];
            let mut probe = ReadBuf::new(&mut probe);
            ready!(Pin::new(&mut self.io).poll_read(cx, &mut probe))?;
            let arrived = probe.filled();
            if !arrived.is_empty() {
                self.read_held = true;
                self.arm_release();
                // A full probe: more is probably waiting.
                let size = if arrived.len() < IDLE_PROBE {
                    SMALL_BUFFER
                } else {
                    READ_CHUNK
                };
                self.read.reserve(size.max(need));
                self.read.extend_from_slice(arrived);
            }
            return Poll::Ready(Ok(arrived.len()));
        }
        let len = self.read.len();
        let spare = self.read.capacity() - len;
        if spare == 0 || spare < need.saturating_sub(len) {
            self.read.reserve(READ_CHUNK.max(need.saturating_sub(len)));
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.read)
    }

    /// Handles a complete control frame whose payload (unmasked) is `payload`.
    fn on_control(&mut self, opcode: u8, payload: &[u8]) {
        match opcode {
            OP_PING => {
                let mut data = [0u8; MAX_CONTROL_PAYLOAD];
                data[..payload.len()].copy_from_slice(payload);
                self.queue.pong = Some((data, payload.len() as u8));
            }
            OP_CLOSE => {
                // Nothing is read after a close.
                self.eof = true;
                self.read = BytesMut::new();
                self.read_held = false;
                if !self.close_sent {
                    self.queue.close = true;
                }
            }
            _ => {} // a pong: a sign of life, like everything else
        }
    }

    /// Parses the next frame header from the read buffer and acts on it. `Ok(None)` when more
    /// bytes are needed, at least the returned count.
    fn next_frame(&mut self) -> io::Result<Option<usize>> {
        let Some(header) = parse_header(&self.read)? else {
            return Ok(Some(self.read.len() + 1));
        };
        match (self.endpoint, header.mask.is_some()) {
            (Endpoint::Server, false) => return Err(FrameError::Unmasked.into()),
            (Endpoint::Client, true) => return Err(FrameError::Masked.into()),
            _ => {}
        }
        // Lengths are bounded above (control: 125, data: MAX_MESSAGE_BYTES).
        let len = header.len as usize;
        if header.is_control() {
            let total = header.size + len;
            if self.read.len() < total {
                return Ok(Some(total));
            }
            let mut payload = [0u8; MAX_CONTROL_PAYLOAD];
            let payload = &mut payload[..len];
            payload.copy_from_slice(&self.read[header.size..total]);
            if let Some(key) = header.mask {
                apply_mask(payload, key, 0);
            }
            self.read.advance(total);
            self.on_control(header.opcode, payload);
            return Ok(None);
        }
        let so_far = match (header.opcode, self.fragmented) {
            (OP_TEXT, _) => return Err(FrameError::Text.into()),
            (OP_BINARY, Some(_)) => return Err(FrameError::ExpectedContinuation.into()),
            (OP_BINARY, None) => 0,
            (_, Some(so_far)) => so_far, // a continuation
            (_, None) => return Err(FrameError::UnexpectedContinuation.into()),
        };
        let total = so_far + len;
        if total > MAX_MESSAGE_BYTES {
            return Err(FrameError::TooLarge.into());
        }
        self.fragmented = if header.fin { None } else { Some(total) };
        self.read.advance(header.size);
        if len > 0 {
            self.payload = Some(Payload {
                remaining: len,
                mask: header.mask,
                done: 0,
            });
        }
        Ok(None)
    }
}

/// The connection ended in the middle of the WebSocket, or without a close frame.
fn unexpected_eof() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the tunnel connection ended without a WebSocket close",
    )
}

impl<S> AsyncRead for WsIo<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        this.poll_timers(cx)?;
        this.push_control(cx)?;
        loop {
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let need = if let Some(payload) = &mut this.payload {
                if !this.read.is_empty() {
                    let n = payload.remaining.min(buf.remaining()).min(this.read.len());
                    let start = buf.filled().len();
                    buf.put_slice(&this.read[..n]);
                    this.read.advance(n);
                    if let Some(key) = payload.mask {
                        apply_mask(&mut buf.filled_mut()[start..], key, payload.done);
                    }
                    payload.done += n;
                    payload.remaining -= n;
                    if payload.remaining == 0 {
                        this.payload = None;
                    }
                    return Poll::Ready(Ok(()));
                }
                let want = payload.remaining.min(buf.remaining());
                if want >= DIRECT_READ_MIN {
                    // Straight from the connection into the reader's buffer.
                    let dst = buf.initialize_unfilled_to(want);
                    let mut direct = ReadBuf::new(dst);
                    ready!(Pin::new(&mut this.io).poll_read(cx, &mut direct))?;
                    let n = direct.filled().len();
                    if n == 0 {
                        return Poll::Ready(Err(unexpected_eof()));
                    }
                    if let Some(key) = payload.mask {
                        apply_mask(&mut dst[..n], key, payload.done);
                    }
                    buf.advance(n);
                    payload.done += n;
                    payload.remaining -= n;
                    if payload.remaining == 0 {
                        this.payload = None;
                    }
                    this.last_rx = Instant::now();
                    return Poll::Ready(Ok(()));
                }
                1
            } else {
                match this.next_frame()? {
                    Some(need) => need,
                    None => {
                        // A pong or close reply goes out now if the connection takes it.
                        this.push_control(cx)?;
                        continue;
                    }
                }
            };
            match ready!(this.poll_fill(cx, need))? {
                0 => return Poll::Ready(Err(unexpected_eof())),
                _ => this.last_rx = Instant::now(),
            }
        }
    }
}

impl<S> AsyncWrite for WsIo<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if this.close_sent {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if this.sending.is_some() {
            ready!(this.poll_drain(cx))?;
        }
        if this.write.len() >= MAX_HEADER + MAX_OUT_MESSAGE {
            this.seal();
            ready!(this.poll_drain(cx))?;
        }
        let n = buf
            .len()
            .min(MAX_HEADER + MAX_OUT_MESSAGE - this.write.len().max(MAX_HEADER));
        this.grow_write(n);
        if this.write.is_empty() {
            this.write.put_bytes(0, MAX_HEADER);
        }
        this.write.extend_from_slice(&buf[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.seal();
        ready!(this.poll_drain(cx))?;
        // yamux flushes after every frame, most often with nothing written since: no call
        // down the stack of `io` (an upgraded connection's boxed IO) for nothing.
        if this.io_dirty {
            ready!(Pin::new(&mut this.io).poll_flush(cx))?;
            this.io_dirty = false;
        }
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.seal();
        ready!(this.poll_drain(cx))?;
        if !this.close_sent {
            this.queue.close = true;
            ready!(this.poll_drain(cx))?;
        }
        ready!(Pin::new(&mut this.io).poll_flush(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::disallowed_methods
    )]

    use std::collections::VecDeque;

    use futures_util::{SinkExt as _, StreamExt as _};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio_tungstenite::WebSocketStream;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::OpCode;
    use tokio_tungstenite::tungstenite::protocol::frame::{Frame, FrameHeader};
    use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
    use tokio_tungstenite::tungstenite::{self, Message};

    use super::*;

    /// A frame as tungstenite writes it (the reference encoder).
    fn frame(opcode: u8, fin: bool, payload: &[u8], masked: bool) -> Vec<u8> {
        let header = FrameHeader {
            is_final: fin,
            opcode: OpCode::from(opcode),
            mask: masked.then(rand::random),
            ..FrameHeader::default()
        };
        let mut out = Vec::new();
        Frame::from_payload(header, payload.to_vec().into())
            .format(&mut out)
            .unwrap();
        out
    }

    fn payload(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// A scripted connection: reads hand out `chunks` one after another (a `Pending` in
    /// between when `stall` is set), then EOF; writes are kept.
    #[derive(Debug, Default)]
    struct Script {
        chunks: VecDeque<Vec<u8>>,
        stall: bool,
        stalled: bool,
        written: Vec<u8>,
    }

    impl Script {
        fn new(chunks: impl IntoIterator<Item = Vec<u8>>, stall: bool) -> Self {
            Self {
                chunks: chunks.into_iter().collect(),
                stall,
                ..Self::default()
            }
        }
    }

    impl AsyncRead for Script {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            if self.stall && !self.stalled {
                self.stalled = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            self.stalled = false;
            while self.chunks.front().is_some_and(Vec::is_empty) {
                self.chunks.pop_front();
            }
            if let Some(mut chunk) = self.chunks.pop_front() {
                let n = chunk.len().min(buf.remaining());
                buf.put_slice(&chunk[..n]);
                if n < chunk.len() {
                    self.chunks.push_front(chunk.split_off(n));
                }
            }
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for Script {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.written.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// Reads everything with reads of `read_size` bytes: the bytes, and how it ended.
    async fn read_all<S: AsyncRead + AsyncWrite + Unpin>(
        ws: &mut WsIo<S>,
        read_size: usize,
    ) -> (Vec<u8>, io::Result<()>) {
        let mut out = Vec::new();
        let mut buf = vec![0u8; read_size];
        loop {
            match ws.read(&mut buf).await {
                Ok(0) => return (out, Ok(())),
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) => return (out, Err(e)),
            }
        }
    }

    /// Every frame the bytes hold (tungstenite's decoder, as the reference).
    fn frames(mut bytes: &[u8]) -> Vec<(FrameHeader, Vec<u8>)> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let mut cursor = io::Cursor::new(bytes);
            let (header, len) = FrameHeader::parse(&mut cursor).unwrap().unwrap();
            let start = cursor.position() as usize;
            let mut data = bytes[start..start + len as usize].to_vec();
            if let Some(key) = header.mask {
                apply_mask(&mut data, key, 0);
            }
            bytes = &bytes[start + len as usize..];
            out.push((header, data));
        }
        out
    }

    fn server(chunks: impl IntoIterator<Item = Vec<u8>>, stall: bool) -> WsIo<Script> {
        WsIo::new(
            Script::new(chunks, stall),
            Endpoint::Server,
            Liveness::default(),
            BytesMut::new(),
        )
    }

    fn client(chunks: impl IntoIterator<Item = Vec<u8>>, stall: bool) -> WsIo<Script> {
        WsIo::new(
            Script::new(chunks, stall),
            Endpoint::Client,
            Liveness::default(),
            BytesMut::new(),
        )
    }

    #[test]
    fn headers_parse_like_tungstenite_writes_them() {
        for len in [0usize, 1, 125, 126, 127, 65535, 65536, MAX_MESSAGE_BYTES] {
            for masked in [false, true] {
                let bytes = frame(OP_BINARY, true, &payload(len, 1), masked);
                let size = bytes.len() - len;
                for cut in 0..size {
                    assert_eq!(parse_header(&bytes[..cut]), Ok(None), "{len} {cut}");
                }
                let header = parse_header(&bytes).unwrap().unwrap();
                assert_eq!(header.size, size);
                assert_eq!(header.len, len as u64);
                assert!(header.fin);
                assert_eq!(header.opcode, OP_BINARY);
                assert_eq!(header.mask.is_some(), masked);
                // And ours encodes the same header.
                let mut ours = [0u8; MAX_HEADER];
                let n = encode_header(&mut ours, OP_BINARY, len, header.mask);
                assert_eq!(&ours[..n], &bytes[..size]);
            }
        }
    }

    #[test]
    fn masking_works_at_any_offset() {
        let key = [1, 2, 3, 4];
        let data = payload(1000, 9);
        let mut whole = data.clone();
        apply_mask(&mut whole, key, 0);
        for split in [0, 1, 2, 3, 5, 333, 999, 1000] {
            let mut parts = data.clone();
            let (a, b) = parts.split_at_mut(split);
            apply_mask(a, key, 0);
            apply_mask(b, key, split);
            assert_eq!(parts, whole, "{split}");
        }
        let expected: Vec<u8> = data
            .iter()
            .enumerate()
            .map(|(i, b)| b ^ key[i % 4])
            .collect();
        assert_eq!(whole, expected);
    }

    #[test]
    fn header_errors() {
        let cases: [(&[u8], FrameError); 6] = [
            (&[0xc2, 0x80, 0, 0, 0, 0], FrameError::ReservedBits),
            (&[0x83, 0x80, 0, 0, 0, 0], FrameError::ReservedOpcode(3)),
            (&[0x8b, 0x80, 0, 0, 0, 0], FrameError::ReservedOpcode(0xb)),
            (&[0x09, 0x80, 0, 0, 0, 0], FrameError::FragmentedControl),
            (
                &[0x89, 0xfe, 0, 126, 0, 0, 0, 0],
                FrameError::ControlTooLong(126),
            ),
            (
                &[0x82, 0xff, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                FrameError::TooLarge,
            ),
        ];
        for (bytes, error) in cases {
            assert_eq!(parse_header(bytes), Err(error), "{bytes:?}");
        }
        // The largest message is allowed, one byte more is not.
        let max = (MAX_MESSAGE_BYTES as u64).to_be_bytes();
        let over = (MAX_MESSAGE_BYTES as u64 + 1).to_be_bytes();
        assert!(parse_header(&[&[0x82, 0x7f][..], &max].concat()).is_ok());
        assert_eq!(
            parse_header(&[&[0x82, 0x7f][..], &over].concat()),
            Err(FrameError::TooLarge)
        );
    }

    /// A client's stream with every kind of frame the server must take: lengths at every
    /// boundary, empty frames, fragments with control frames between them.
    fn client_stream() -> (Vec<u8>, Vec<u8>) {
        let mut wire = Vec::new();
        let mut data = Vec::new();
        let mut binary = |wire: &mut Vec<u8>, opcode, fin, p: Vec<u8>| {
            wire.extend(frame(opcode, fin, &p, true));
            data.extend(p);
        };
        for (i, len) in [0usize, 1, 3, 125, 126, 127, 1000, 65535, 65536, 70000]
            .into_iter()
            .enumerate()
        {
            binary(&mut wire, OP_BINARY, true, payload(len, i as u8));
        }
        binary(&mut wire, OP_BINARY, false, payload(10, 50));
        wire.extend(frame(OP_PING, true, b"are you there", true));
        binary(&mut wire, OP_CONTINUATION, false, payload(0, 51));
        wire.extend(frame(OP_PONG, true, b"", true));
        binary(&mut wire, OP_CONTINUATION, false, payload(3000, 52));
        binary(&mut wire, OP_CONTINUATION, true, payload(7, 53));
        binary(&mut wire, OP_BINARY, true, payload(5, 54));
        (wire, data)
    }

    #[tokio::test]
    async fn reads_every_frame_whatever_the_read_sizes_and_splits() {
        let (wire, data) = client_stream();
        let closed = [wire.clone(), frame(OP_CLOSE, true, &[3, 232], true)].concat();
        // Split in two at a spread of places, reading with several buffer sizes.
        let mut cuts: Vec<usize> = (0..300).collect();
        cuts.extend((300..closed.len()).step_by(997));
        cuts.extend(closed.len() - 300..=closed.len());
        for cut in cuts {
            for read_size in [1usize, 12, 4096, 70_000] {
                // Tiny reads are slow in a debug build: fewer of them.
                if (read_size == 1 && cut % 101 != 0) || (read_size == 12 && cut % 7 != 0) {
                    continue;
                }
                let chunks = [closed[..cut].to_vec(), closed[cut..].to_vec()];
                let mut ws = server(chunks, cut % 2 == 0);
                let (got, end) = read_all(&mut ws, read_size).await;
                assert!(end.is_ok(), "cut {cut}, reads of {read_size}: {end:?}");
                assert!(got == data, "cut {cut}, reads of {read_size}");
            }
        }
    }

    #[tokio::test]
    async fn reads_byte_by_byte_arrivals() {
        let (wire, data) = client_stream();
        let closed = [wire, frame(OP_CLOSE, true, &[], true)].concat();
        let chunks: Vec<Vec<u8>> = closed.iter().map(|b| vec![*b]).collect();
        let mut ws = server(chunks, true);
        let (got, end) = read_all(&mut ws, 4096).await;
        end.unwrap();
        assert!(got == data);
        // The ping got its pong, the close its close; masked by no one (server side).
        let sent = frames(&ws.io.written);
        assert_eq!(sent.len(), 2);
        assert_eq!(sent[0].0.opcode, OpCode::from(OP_PONG));
        assert_eq!(sent[0].1, b"are you there");
        assert!(sent[0].0.mask.is_none());
        assert_eq!(sent[1].0.opcode, OpCode::from(OP_CLOSE));
        assert_eq!(ws.buffers(), (false, 0));
    }

    #[tokio::test]
    async fn the_client_takes_unmasked_frames_and_masks_its_pongs() {
        let wire = [
            frame(OP_BINARY, true, &payload(70000, 1), false),
            frame(OP_PING, true, b"x", false),
            frame(OP_CLOSE, true, &[], false),
        ]
        .concat();
        let mut ws = client([wire], false);
        let (got, end) = read_all(&mut ws, 8192).await;
        end.unwrap();
        assert!(got == payload(70000, 1));
        let sent = frames(&ws.io.written);
        assert_eq!(sent[0].0.opcode, OpCode::from(OP_PONG));
        assert!(sent[0].0.mask.is_some());
        assert_eq!(sent[0].1, b"x");
    }

    async fn read_error(mut ws: WsIo<Script>) -> io::Error {
        let (_, end) = read_all(&mut ws, 4096).await;
        end.unwrap_err()
    }

    fn invalid(e: &io::Error) -> FrameError {
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        e.get_ref()
            .and_then(|e| e.downcast_ref::<FrameError>())
            .cloned_error()
    }

    trait ClonedError {
        fn cloned_error(self) -> FrameError;
    }

    impl ClonedError for Option<&FrameError> {
        fn cloned_error(self) -> FrameError {
            match self.unwrap() {
                FrameError::ReservedOpcode(op) => FrameError::ReservedOpcode(*op),
                FrameError::ControlTooLong(n) => FrameError::ControlTooLong(*n),
                FrameError::ReservedBits => FrameError::ReservedBits,
                FrameError::FragmentedControl => FrameError::FragmentedControl,
                FrameError::Unmasked => FrameError::Unmasked,
                FrameError::Masked => FrameError::Masked,
                FrameError::TooLarge => FrameError::TooLarge,
                FrameError::Text => FrameError::Text,
                FrameError::UnexpectedContinuation => FrameError::UnexpectedContinuation,
                FrameError::ExpectedContinuation => FrameError::ExpectedContinuation,
            }
        }
    }

    #[tokio::test]
    async fn protocol_errors_end_the_stream() {
        let big = payload(MAX_MESSAGE_BYTES / 2 + 1, 0);
        let cases: Vec<(Vec<u8>, FrameError)> = vec![
            (frame(OP_BINARY, true, b"abc", false), FrameError::Unmasked),
            (frame(OP_PING, true, b"", false), FrameError::Unmasked),
            (frame(OP_TEXT, true, b"hello", true), FrameError::Text),
            (frame(OP_TEXT, false, b"he", true), FrameError::Text),
            (
                frame(OP_CONTINUATION, true, b"abc", true),
                FrameError::UnexpectedContinuation,
            ),
            (
                [
                    frame(OP_BINARY, false, b"a", true),
                    frame(OP_BINARY, true, b"b", true),
                ]
                .concat(),
                FrameError::ExpectedContinuation,
            ),
            (
                [
                    frame(OP_BINARY, false, &big, true),
                    frame(OP_CONTINUATION, true, &big, true),
                ]
                .concat(),
                FrameError::TooLarge,
            ),
            (
                frame(OP_PING, true, &[0; 126], true),
                FrameError::ControlTooLong(126),
            ),
            (
                vec![0x82 | 0x40, 0x80, 0, 0, 0, 0],
                FrameError::ReservedBits,
            ),
            (vec![0x83, 0x80, 0, 0, 0, 0], FrameError::ReservedOpcode(3)),
        ];
        for (wire, expected) in cases {
            let e = read_error(server([wire], false)).await;
            assert_eq!(invalid(&e), expected);
        }
        // Masked frames from the server.
        let e = read_error(client([frame(OP_BINARY, true, b"abc", true)], false)).await;
        assert_eq!(invalid(&e), FrameError::Masked);
        // The connection ends without a close frame, between frames or inside one.
        let whole = frame(OP_BINARY, true, &payload(5000, 0), true);
        for cut in [whole.len(), 1, 5, 100, 4000] {
            let e = read_error(server([whole[..cut].to_vec()], false)).await;
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{cut}");
        }
    }

    #[tokio::test]
    async fn writes_one_message_per_flush_from_one_bounded_buffer() {
        for endpoint in [Endpoint::Client, Endpoint::Server] {
            let mut ws = WsIo::new(
                Script::default(),
                endpoint,
                Liveness::default(),
                BytesMut::new(),
            );
            let sizes = [1usize, 12, 125, 126, 65535, 65536, 65537, 200_000];
            for (i, len) in sizes.into_iter().enumerate() {
                ws.write_all(&payload(len, i as u8)).await.unwrap();
                ws.flush().await.unwrap();
                let (read, write) = ws.buffers();
                assert!(!read);
                assert!(write <= MAX_HEADER + MAX_OUT_MESSAGE, "{write}");
            }
            // Two writes, one flush: one message.
            ws.write_all(b"head").await.unwrap();
            ws.write_all(b"body").await.unwrap();
            ws.flush().await.unwrap();
            ws.shutdown().await.unwrap();
            let sent = frames(&ws.io.written);
            let mut messages = sent.iter();
            for (i, len) in sizes.into_iter().enumerate() {
                let mut data = payload(len, i as u8);
                // A message is at most MAX_OUT_MESSAGE bytes; the rest follows.
                while !data.is_empty() {
                    let (header, body) = messages.next().unwrap();
                    let n = data.len().min(MAX_OUT_MESSAGE);
                    assert_eq!(header.opcode, OpCode::from(OP_BINARY));
                    assert!(header.is_final);
                    assert_eq!(header.mask.is_some(), endpoint == Endpoint::Client);
                    assert!(body[..] == data[..n], "{len}");
                    data.drain(..n);
                }
            }
            assert_eq!(messages.next().unwrap().1, b"headbody");
            let (close, code) = messages.next().unwrap();
            assert_eq!(close.opcode, OpCode::from(OP_CLOSE));
            assert_eq!(code, &1000u16.to_be_bytes());
            assert!(messages.next().is_none());
            // Nothing more goes out after the close.
            assert!(ws.write_all(b"late").await.is_err());
        }
    }

    /// Pings every 10 s, dead after 25 s of silence.
    const TEST_LIVENESS: Liveness = Liveness {
        ping_interval: Duration::from_secs(10),
        dead_after: Duration::from_secs(25),
    };

    /// Reads from `ws` until a read fails: the error and when it came.
    fn read_until_error(
        mut ws: WsIo<tokio::io::DuplexStream>,
    ) -> tokio::task::JoinHandle<(io::Error, tokio::time::Instant)> {
        tokio::spawn(async move {
            let mut buf = [0u8; 16];
            let e = ws.read(&mut buf).await.unwrap_err();
            (e, tokio::time::Instant::now())
        })
    }

    #[tokio::test(start_paused = true)]
    async fn pings_on_time_and_declares_a_silent_peer_dead() {
        let (near, mut far) = tokio::io::duplex(64 * 1024);
        let ws = WsIo::new(near, Endpoint::Client, TEST_LIVENESS, BytesMut::new());
        let reader = read_until_error(ws);
        let started = tokio::time::Instant::now();
        let (e, at) = reader.await.unwrap();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(at - started, Duration::from_secs(25));
        let mut sent = vec![0u8; 1024];
        let n = far.read(&mut sent).await.unwrap();
        let pings = frames(&sent[..n]);
        assert_eq!(pings.len(), 2, "pings at 10 s and 20 s");
        for (header, body) in pings {
            assert_eq!(header.opcode, OpCode::from(OP_PING));
            assert!(header.mask.is_some() && body.is_empty());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn any_frame_keeps_the_peer_alive() {
        let (near, mut far) = tokio::io::duplex(64 * 1024);
        let ws = WsIo::new(near, Endpoint::Server, TEST_LIVENESS, BytesMut::new());
        let reader = read_until_error(ws);
        let started = tokio::time::Instant::now();
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_secs(20)).await;
            far.write_all(&frame(OP_PONG, true, b"", true))
                .await
                .unwrap();
        }
        let (e, at) = reader.await.unwrap();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(at - started, Duration::from_secs(80 + 25));
    }

    #[tokio::test]
    async fn writes_wait_for_a_slow_peer_with_one_message_held() {
        let (near, far) = tokio::io::duplex(16 * 1024);
        let mut ws = WsIo::new(near, Endpoint::Server, Liveness::default(), BytesMut::new());
        let chunk = payload(8 * 1024, 3);
        let mut accepted = 0usize;
        let blocked = loop {
            let write = async {
                ws.write_all(&chunk).await.unwrap();
                ws.flush().await.unwrap();
            };
            match tokio::time::timeout(Duration::from_millis(100), write).await {
                Ok(()) => accepted += chunk.len(),
                Err(_) => break true,
            }
            if accepted > 1 << 20 {
                break false;
            }
        };
        assert!(blocked, "writes never waited");
        let (read, write) = ws.buffers();
        assert!(!read);
        assert!(write <= MAX_HEADER + MAX_OUT_MESSAGE, "{write}");
        drop(far);
    }

    /// Both ends against tungstenite's: data both ways, pings answered, a clean close.
    #[tokio::test]
    async fn speaks_with_tungstenite_on_either_side() {
        for ours in [Endpoint::Client, Endpoint::Server] {
            let (near, far) = tokio::io::duplex(256 * 1024);
            let role = match ours {
                Endpoint::Client => Role::Server,
                Endpoint::Server => Role::Client,
            };
            let config = WebSocketConfig::default().max_message_size(Some(MAX_MESSAGE_BYTES));
            let mut peer = WebSocketStream::from_raw_socket(far, role, Some(config)).await;
            let mut ws = WsIo::new(near, ours, Liveness::default(), BytesMut::new());
            let data = payload(300_000, 7);
            let ours_task = tokio::spawn(async move {
                ws.write_all(&data).await.unwrap();
                ws.flush().await.unwrap();
                let mut back = vec![0u8; 100_000];
                ws.read_exact(&mut back).await.unwrap();
                assert!(back == payload(100_000, 8));
                ws.shutdown().await.unwrap();
                let mut rest = Vec::new();
                ws.read_to_end(&mut rest).await.unwrap();
                assert!(rest.is_empty());
                ws.buffers()
            });
            let mut got = Vec::new();
            while got.len() < 300_000 {
                match peer.next().await.unwrap().unwrap() {
                    Message::Binary(b) => got.extend_from_slice(&b),
                    other => panic!("{other:?}"),
                }
            }
            assert!(got == payload(300_000, 7));
            peer.send(Message::Ping(b"hi".to_vec().into()))
                .await
                .unwrap();
            for part in payload(100_000, 8).chunks(30_000) {
                peer.send(Message::Binary(part.to_vec().into()))
                    .await
                    .unwrap();
            }
            let mut pong = false;
            let mut closed = false;
            while let Some(message) = peer.next().await {
                match message {
                    Ok(Message::Pong(p)) => pong = &p[..] == b"hi",
                    Ok(Message::Close(_)) => closed = true,
                    Ok(other) => panic!("{other:?}"),
                    Err(tungstenite::Error::ConnectionClosed) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            assert!(pong && closed, "{ours:?}");
            // Nothing is read after the close.
            assert!(!ours_task.await.unwrap().0);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_drops_its_buffers() {
        let (near, mut far) = tokio::io::duplex(256 * 1024);
        let mut ws = WsIo::new(near, Endpoint::Server, Liveness::default(), BytesMut::new());
        let data = payload(100_000, 5);
        far.write_all(&frame(OP_BINARY, true, &data, true))
            .await
            .unwrap();
        let mut got = vec![0u8; data.len()];
        ws.read_exact(&mut got).await.unwrap();
        assert!(got == data);
        ws.write_all(&data).await.unwrap();
        ws.flush().await.unwrap();
        let (read, write) = ws.buffers();
        assert!(read && write > 0, "{read} {write}");
        // Still held a little before the idle limit, dropped once it has passed.
        let mut buf = [0u8; 64];
        let wait = IDLE_RELEASE - Duration::from_millis(100);
        assert!(tokio::time::timeout(wait, ws.read(&mut buf)).await.is_err());
        assert_ne!(ws.buffers(), (false, 0));
        let wait = Duration::from_millis(200);
        assert!(tokio::time::timeout(wait, ws.read(&mut buf)).await.is_err());
        assert_eq!(ws.buffers(), (false, 0));
        // And they come back with the next traffic.
        far.write_all(&frame(OP_BINARY, true, b"again", true))
            .await
            .unwrap();
        let n = ws.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"again");
    }
}
