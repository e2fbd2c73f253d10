//! A native HTTP/1.1 server for the gateway's plain listener.
//!
//! hyper serves each connection with buffers it keeps for the connection's whole life (an
//! 8 KiB read buffer, a write buffer, a slot for the service future), which is about 27–40 KB
//! per idle keep-alive connection once the connection task is counted. A gateway in front of
//! thousands of mostly idle clients pays that for nothing. Here a connection holds, between
//! requests, only its socket and a small loop state: the read buffer is taken when bytes
//! arrive and given back when the request is done, and the exchange (handler future, answer
//! body, write state) lives in a box allocated per request.
//!
//! What it does, for the plain (`http`) gateway listener:
//! - heads found by a linear scan (a byte-at-a-time client costs linear time), parsed with
//!   `httparse`, target and header values sliced from one frozen buffer (`head`); the
//!   framing headers and the standard hop-by-hop ones (`host` too) are read there and left out
//!   of the request's map, since the gateway never forwards them;
//! - strict framing: both `Content-Length` and `Transfer-Encoding` → 400 (counted as a framing
//!   conflict), conflicting lengths or a list of lengths, any transfer coding but one `chunked`, obs-fold,
//!   whitespace before a colon, control characters → 400; heads over the limit or with more
//!   than `head::MAX_HEADERS` lines → 431; HTTP/2 request lines → 505; each answered with an
//!   OpenAI-shaped JSON error and a closed connection;
//! - request bodies decoded on the connection's own task (`conn::Body`), `100 Continue`
//!   sent when the handler first reads a body that was announced with `Expect`; chunked
//!   bodies (requests and upstream responses alike) read by RFC 9112 §7.1: chunk extensions
//!   by their grammar, trailers as field lines ending in CRLF, never looser than hyper's
//!   decoder (`tests/h1_differential.rs` lists where it is stricter);
//! - answers: the handler's `Content-Length`, else the body's exact size, else chunked (HTTP/1.0
//!   clients: until close); each body frame written as it arrives, the head together with the
//!   first frame when that one is ready at once; a body that fails ends the connection without
//!   a last chunk (an abnormal end the client sees);
//! - keep-alive and pipelining (read-ahead bounded to `conn`'s 16 KiB); a client that closes
//!   while its request is in flight drops the handler and the answer body (which cancels the
//!   upstream request);
//! - the same deadlines as the hyper listeners: the first head within the pending-connection
//!   deadline, every later head (idle time included) within the header read timeout, writes
//!   within the write-stall timeout; on shutdown idle connections close at once and busy ones
//!   after their current answer.
//!
//! HTTP/2 (prior knowledge) and TLS connections stay on hyper; [`ClientBody`] is the request
//! body type of both.

pub mod body;
pub mod client;
pub mod conn;
pub mod head;
pub mod write;

#[doc(hidden)]
pub mod fuzzing;

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;

use crate::BoxError;

pub use body::BodyError;

/// A client's request body, from a natively served HTTP/1 connection or from hyper (HTTP/2,
/// TLS).
#[derive(Debug)]
pub enum ClientBody {
    Native(conn::Body),
    Hyper(Incoming),
}

impl From<Incoming> for ClientBody {
    fn from(body: Incoming) -> Self {
        ClientBody::Hyper(body)
    }
}

impl http_body::Body for ClientBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ClientBody::Native(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            ClientBody::Hyper(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ClientBody::Native(b) => b.is_end_stream(),
            ClientBody::Hyper(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ClientBody::Native(b) => b.size_hint(),
            ClientBody::Hyper(b) => b.size_hint(),
        }
    }
}

/// Before a read into `buf`: an empty buffer whose allocation no `Bytes` split from it still
/// shares goes back to the start of that allocation. Heads and bodies are split off the front
/// and frozen, so without this each request would be read a little further into the
/// allocation, touching lines that went cold since the last pass; with it, a keep-alive
/// connection reads every request into the same few lines. No copy (the buffer is empty) and
/// never an allocation: `try_reclaim` asked for one byte more than the handle holds reclaims
/// the whole allocation when it is unique and the handle is not at its start already.
pub(crate) fn rewind(buf: &mut BytesMut) {
    if buf.is_empty() {
        let _ = buf.try_reclaim(buf.capacity() + 1);
    }
}

#[cfg(test)]
mod tests {
    use bytes::{Buf, BufMut, BytesMut};

    use super::rewind;

    #[test]
    fn rewind_reuses_the_allocation_once_nothing_shares_it() {
        let mut buf = BytesMut::with_capacity(4096);
        let start = buf.as_ptr();
        buf.put_slice(b"GET / HTTP/1.1\r\n\r\n");
        let head = buf.split_to(buf.len()).freeze();
        assert_ne!(buf.as_ptr(), start, "the next read lands after the head");
        // The head is still alive: its bytes must not be written over.
        rewind(&mut buf);
        assert_ne!(buf.as_ptr(), start);
        drop(head);
        rewind(&mut buf);
        assert_eq!(buf.as_ptr(), start, "back at the start of the allocation");
        assert!(buf.capacity() >= 4096);

        // Never while bytes wait to be consumed, and consumed bytes (no split) rewind too.
        buf.put_slice(b"abc");
        buf.advance(1);
        let at = buf.as_ptr();
        rewind(&mut buf);
        assert_eq!(buf.as_ptr(), at);
        buf.advance(2);
        rewind(&mut buf);
        assert_eq!(buf.as_ptr(), start);

        // An empty, unallocated buffer stays so.
        let mut empty = BytesMut::new();
        rewind(&mut empty);
        assert_eq!(empty.capacity(), 0);
    }
}
