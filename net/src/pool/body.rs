//! The response body, read and decoded straight from its pooled connection.

use std::pin::Pin;
use std::sync::Weak;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::conn::{Conn, READ_CHUNK};
use super::idle::PoolInner;
use crate::h1::body::{BodyError, CHUNKED, Decoded, Decoder};
use crate::h1::client::ResponseFraming;

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
    pub(super) fn new(
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
