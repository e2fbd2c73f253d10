//! The read side: frames parsed from the read buffer, payloads handed to the reader.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf as _, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::frame::{
    FrameError, MAX_CONTROL_PAYLOAD, OP_BINARY, OP_CLOSE, OP_PING, OP_TEXT, apply_mask,
    parse_header,
};
use super::moving::MOVE_PAYLOAD;
use super::{DIRECT_READ_MIN, Endpoint, IDLE_PROBE, Payload, READ_CHUNK, SMALL_BUFFER, WsIo};
use crate::protocol::MAX_MESSAGE_BYTES;

impl<S> WsIo<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    /// Reads more bytes into the read buffer, `need` bytes in it at least when it is done.
    /// Without a read buffer (an idle connection), waits for bytes with a small one on the
    /// stack and takes a read buffer only once they are there.
    pub(super) fn poll_fill(
        &mut self,
        cx: &mut Context<'_>,
        need: usize,
    ) -> Poll<io::Result<usize>> {
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
    pub(super) fn on_control(&mut self, opcode: u8, payload: &[u8]) {
        match opcode {
            OP_PING => {
                if payload == MOVE_PAYLOAD
                    && let Some(moves) = &self.moves
                {
                    moves.received();
                }
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
    pub(super) fn next_frame(&mut self) -> io::Result<Option<usize>> {
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
