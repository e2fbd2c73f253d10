//! The write side: the gathered bytes sealed into one binary message per flush, control frames
//! between messages.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{BufMut as _, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

use super::frame::{
    CLOSE_NORMAL, MAX_CONTROL_PAYLOAD, MAX_HEADER, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG,
    apply_mask, encode_header,
};
use super::moving::MOVE_PAYLOAD;
use super::{ControlOut, ControlQueue, MAX_OUT_MESSAGE, SMALL_BUFFER, WsIo};

impl<S> WsIo<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    pub(super) fn has_control(&self) -> bool {
        self.control.is_some()
            || self.queue.close
            || self.queue.ping
            || self.queue.move_ping
            || self.queue.pong.is_some()
    }

    /// Sends queued control frames (and the rest of a message being written) without waiting:
    /// what cannot be written now goes out with the next write or flush.
    pub(super) fn push_control(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
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
    pub(super) fn next_control(&mut self) -> Option<ControlOut> {
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
        } else if self.queue.move_ping {
            self.queue.move_ping = false;
            (OP_PING, MOVE_PAYLOAD)
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
    pub(super) fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
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
    pub(super) fn grow_write(&mut self, n: usize) {
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
    pub(super) fn seal(&mut self) {
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
