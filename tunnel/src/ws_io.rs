//! A WebSocket carrying binary messages, seen as one byte stream (`AsyncRead + AsyncWrite`) for
//! yamux, with the tunnel's liveness built in.
//!
//! - Reads hand out each binary message's bytes in order; ping, pong and any other frame only
//!   count as a sign of life. A text message is a protocol error.
//! - Writes are gathered in one reusable buffer and sent as one binary message per flush (yamux
//!   flushes after every frame, so a message is usually one yamux frame). The buffer is frozen
//!   into the message without another copy; no `to_vec` per write.
//! - Every `ping_interval` a WebSocket ping goes out. When nothing at all has been received for
//!   `dead_after`, reads fail with `TimedOut`, which ends the yamux connection and with it every
//!   stream: a silently stalled peer is detected even while writes are blocked.
//!
//! Everything runs inside the one task that polls the yamux connection, so there is no lock.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf as _, Bytes, BytesMut};
use futures_util::{Sink, Stream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message};

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

/// The largest binary message this side sends (the write buffer is pushed out beyond it).
const MAX_OUT_MESSAGE: usize = 64 * 1024;

/// The WebSocket settings of tunnel connections: small buffers (idle tunnels cost little),
/// a bounded write buffer (writes wait instead of growing it), bounded incoming messages.
/// permessage-deflate is never negotiated (tungstenite does not offer it).
pub fn ws_config() -> WebSocketConfig {
    WebSocketConfig::default()
        .read_buffer_size(8 * 1024)
        .write_buffer_size(8 * 1024)
        .max_write_buffer_size(8 * 1024 + 2 * (MAX_OUT_MESSAGE + 64))
        .max_message_size(Some(MAX_MESSAGE_BYTES))
        .max_frame_size(Some(MAX_MESSAGE_BYTES))
}

/// A WebSocket as a byte stream. See the module documentation.
#[derive(Debug)]
pub struct WsIo<S> {
    ws: WebSocketStream<S>,
    /// The unread rest of the current incoming message.
    read: Bytes,
    /// Bytes written since the last message went out.
    write: BytesMut,
    liveness: Liveness,
    last_rx: Instant,
    ping_timer: Pin<Box<Sleep>>,
    dead_timer: Pin<Box<Sleep>>,
    ping_due: bool,
    eof: bool,
}

fn ws_err(e: tungstenite::Error) -> io::Error {
    match e {
        tungstenite::Error::Io(e) => e,
        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed => {
            io::ErrorKind::BrokenPipe.into()
        }
        other => io::Error::other(other),
    }
}

impl<S> WsIo<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    pub fn new(ws: WebSocketStream<S>, liveness: Liveness) -> Self {
        let now = Instant::now();
        Self {
            ws,
            read: Bytes::new(),
            write: BytesMut::new(),
            liveness,
            last_rx: now,
            ping_timer: Box::pin(tokio::time::sleep_until(now + liveness.ping_interval)),
            dead_timer: Box::pin(tokio::time::sleep_until(now + liveness.dead_after)),
            ping_due: false,
            eof: false,
        }
    }

    /// Runs the ping and dead-peer timers; `Err(TimedOut)` once the peer is dead.
    fn poll_timers(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        while self.ping_timer.as_mut().poll(cx).is_ready() {
            self.ping_due = true;
            let next = Instant::now() + self.liveness.ping_interval;
            self.ping_timer.as_mut().reset(next);
        }
        while self.dead_timer.as_mut().poll(cx).is_ready() {
            let deadline = self.last_rx + self.liveness.dead_after;
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "tunnel peer silent for longer than the dead-peer timeout",
                ));
            }
            self.dead_timer.as_mut().reset(deadline);
        }
        if self.ping_due {
            self.poll_send_ping(cx)?;
        }
        Ok(())
    }

    /// Queues a ping when the sink has room; otherwise it stays due.
    fn poll_send_ping(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let mut ws = Pin::new(&mut self.ws);
        if let Poll::Ready(r) = ws.as_mut().poll_ready(cx) {
            r.map_err(ws_err)?;
            ws.as_mut()
                .start_send(Message::Ping(Bytes::new()))
                .map_err(ws_err)?;
            self.ping_due = false;
            // Best effort: a pending flush finishes with the next write or flush.
            if let Poll::Ready(Err(e)) = ws.poll_flush(cx) {
                return Err(ws_err(e));
            }
        }
        Ok(())
    }

    /// Sends the gathered bytes as one binary message.
    fn poll_push(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.write.is_empty() {
            return Poll::Ready(Ok(()));
        }
        let mut ws = Pin::new(&mut self.ws);
        ready!(ws.as_mut().poll_ready(cx)).map_err(ws_err)?;
        let payload = self.write.split().freeze();
        ws.start_send(Message::Binary(payload)).map_err(ws_err)?;
        Poll::Ready(Ok(()))
    }
}

impl<S> AsyncRead for WsIo<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.read.is_empty() {
                let n = this.read.len().min(buf.remaining());
                buf.put_slice(&this.read[..n]);
                this.read.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            this.poll_timers(cx)?;
            match Pin::new(&mut this.ws).poll_next(cx) {
                Poll::Ready(Some(Ok(message))) => {
                    this.last_rx = Instant::now();
                    match message {
                        Message::Binary(data) => this.read = data,
                        Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => {}
                        Message::Close(_) => this.eof = true,
                        Message::Text(_) => {
                            return Poll::Ready(Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                "text message on a binary tunnel",
                            )));
                        }
                    }
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(ws_err(e))),
                Poll::Ready(None) => this.eof = true,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl<S> AsyncWrite for WsIo<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.write.len() >= MAX_OUT_MESSAGE {
            ready!(this.poll_push(cx))?;
        }
        let n = buf.len().min(MAX_OUT_MESSAGE - this.write.len());
        this.write.extend_from_slice(&buf[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_push(cx))?;
        Pin::new(&mut this.ws).poll_flush(cx).map_err(ws_err)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_push(cx))?;
        Pin::new(&mut this.ws).poll_close(cx).map_err(ws_err)
    }
}
