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
//!   [`MAX_MESSAGE_BYTES`](crate::protocol::MAX_MESSAGE_BYTES) are protocol errors
//!   (`InvalidData`), which end the connection.
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
//!
//! The pieces: the connection's state, its timers and buffers (here); `frame` the frame header
//! codec and masking; `read` the read side; `write` the write side.

mod frame;
mod moving;
mod read;
#[cfg(test)]
mod tests;
mod write;

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Waker};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, Sleep};

pub use frame::FrameError;
pub use moving::MoveSignal;

use frame::{MAX_CONTROL_PAYLOAD, MAX_HEADER};

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
    /// The move ping ([`MoveSignal`]).
    move_ping: bool,
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
    /// Move requests, sent (server) or received (worker); see [`WsIo::with_moves`].
    moves: Option<MoveSignal>,
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
            moves: None,
        };
        if this.read_held {
            this.arm_release();
        }
        this
    }

    /// Carries move requests ([`MoveSignal`]): the server sends them, the worker hears them.
    pub fn with_moves(mut self, moves: MoveSignal) -> Self {
        self.moves = Some(moves);
        self
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
        if let Some(moves) = &self.moves
            && moves.take_request()
        {
            self.queue.move_ping = true;
        }
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
        if let Some(moves) = &self.moves {
            moves.register(cx.waker());
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
}
