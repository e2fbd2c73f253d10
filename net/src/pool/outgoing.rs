//! The bytes of a request queued for the socket.

use bytes::{Buf as _, Bytes};

use crate::h1::write::GATHER_MAX;

/// Bytes to write: an encoded head or chunk-size line, a piece of body, a fixed tail (chunk
/// end, last chunk). Advanced only by what was written, so a write that failed at once leaves
/// it whole for another connection.
#[derive(Debug, Default)]
pub(super) struct Outgoing {
    pub(super) head: Vec<u8>,
    pub(super) head_at: usize,
    pub(super) data: Bytes,
    pub(super) tail: &'static [u8],
    /// Some byte of the request was written.
    pub(super) sent: bool,
}

const CHUNK_END: &[u8] = b"\r\n";
const LAST_CHUNK: &[u8] = b"0\r\n\r\n";
const CHUNK_END_LAST: &[u8] = b"\r\n0\r\n\r\n";

impl Outgoing {
    pub(super) fn is_empty(&self) -> bool {
        self.head_at == self.head.len() && self.data.is_empty() && self.tail.is_empty()
    }

    /// Copies a small piece of body and its framing behind what is left of the head, so that
    /// one `send` carries them ([`GATHER_MAX`]: `writev` costs the kernel more per call).
    pub(super) fn gather(&mut self) {
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

    pub(super) fn advance(&mut self, mut n: usize) {
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
    pub(super) fn push_body(&mut self, data: Bytes, chunked: bool, last: bool) {
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
