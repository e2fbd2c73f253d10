//! Message bodies: the `Content-Length` and chunked decoders (also used for upstream responses
//! by [`crate::pool`]), and [`Body`], which reads a request body's
//! bytes straight from the connection (the connection's task polls it, so no channel and no
//! wake-up stand between the socket and the handler).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Frame, SizeHint};

use super::conn::Shared;

/// Longest chunk-size line (with extensions) and trailer section accepted.
const MAX_CHUNK_LINE: usize = 4096;
const MAX_TRAILERS: usize = 16 * 1024;

/// Where a request body's decoding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decoder {
    /// The body ended (or there was none).
    Done,
    /// Bytes of a `Content-Length` body still to come.
    Length(u64),
    /// In a chunked body.
    Chunked(Chunk),
    /// The body was malformed or the connection ended early: the connection cannot be reused.
    Failed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Chunk {
    /// In a chunk-size line: the size so far, whether digits ended (extensions), bytes seen.
    Size {
        size: u64,
        digits: u8,
        ext: bool,
        seen: usize,
    },
    /// After the CR of a chunk-size line.
    SizeLf { size: u64 },
    /// In chunk data.
    Data(u64),
    /// The CRLF after chunk data (bytes of it matched).
    DataEnd(u8),
    /// In the trailer section: bytes of the current line, bytes in all.
    Trailer { line: usize, total: usize },
}

/// What decoding the buffered bytes gave.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decoded {
    Data(Bytes),
    /// More bytes are needed.
    More,
    /// The body is complete.
    End,
}

/// A malformed or truncated message body (a client's request, or an upstream's response).
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("malformed chunked body: {0}")]
    Chunked(&'static str),
    #[error("the connection closed before the body ended")]
    Truncated,
    #[error("reading the body failed: {0}")]
    Io(#[from] std::io::Error),
}

impl Decoder {
    pub(crate) fn is_done(self) -> bool {
        self == Decoder::Done
    }

    /// Takes the next piece of body from `buf` (data is split off without copying).
    pub(crate) fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, BodyError> {
        loop {
            match *self {
                Decoder::Done => return Ok(Decoded::End),
                Decoder::Failed => return Err(BodyError::Truncated),
                Decoder::Length(left) => {
                    let Some((data, left)) = take(buf, left) else {
                        return Ok(Decoded::More);
                    };
                    *self = if left == 0 {
                        Decoder::Done
                    } else {
                        Decoder::Length(left)
                    };
                    return Ok(Decoded::Data(data));
                }
                Decoder::Chunked(Chunk::Data(left)) => {
                    let Some((data, left)) = take(buf, left) else {
                        return Ok(Decoded::More);
                    };
                    *self = Decoder::Chunked(if left == 0 {
                        Chunk::DataEnd(0)
                    } else {
                        Chunk::Data(left)
                    });
                    return Ok(Decoded::Data(data));
                }
                Decoder::Chunked(state) => {
                    let Some(&byte) = buf.first() else {
                        return Ok(Decoded::More);
                    };
                    buf.advance(1);
                    *self = match chunk_step(state, byte) {
                        Ok(next) => next,
                        Err(e) => {
                            *self = Decoder::Failed;
                            return Err(e);
                        }
                    };
                }
            }
        }
    }
}

/// Splits off up to `left` buffered body bytes (without copying) and says how many are still
/// to come; `None` when nothing is buffered.
fn take(buf: &mut BytesMut, left: u64) -> Option<(Bytes, u64)> {
    if buf.is_empty() {
        return None;
    }
    let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
    Some((buf.split_to(n).freeze(), left - n as u64))
}

/// One byte of chunk framing (size lines, data line ends, trailers).
fn chunk_step(state: Chunk, byte: u8) -> Result<Decoder, BodyError> {
    let next = match state {
        Chunk::Size {
            size,
            digits,
            ext,
            seen,
        } => {
            if seen >= MAX_CHUNK_LINE {
                return Err(BodyError::Chunked("chunk-size line too long"));
            }
            let seen = seen + 1;
            match byte {
                b'\r' if digits > 0 => Chunk::SizeLf { size },
                _ if ext => Chunk::Size {
                    size,
                    digits,
                    ext,
                    seen,
                },
                b';' | b' ' | b'\t' if digits > 0 => Chunk::Size {
                    size,
                    digits,
                    ext: true,
                    seen,
                },
                _ => {
                    let Some(d) = (byte as char).to_digit(16) else {
                        return Err(BodyError::Chunked("invalid chunk size"));
                    };
                    if digits >= 16 {
                        return Err(BodyError::Chunked("chunk size too large"));
                    }
                    Chunk::Size {
                        size: size << 4 | u64::from(d),
                        digits: digits + 1,
                        ext,
                        seen,
                    }
                }
            }
        }
        Chunk::SizeLf { size } => {
            if byte != b'\n' {
                return Err(BodyError::Chunked("expected LF after the chunk size"));
            }
            if size == 0 {
                Chunk::Trailer { line: 0, total: 0 }
            } else {
                Chunk::Data(size)
            }
        }
        Chunk::Data(_) => unreachable!("chunk data is split off, not stepped"),
        Chunk::DataEnd(0) if byte == b'\r' => Chunk::DataEnd(1),
        Chunk::DataEnd(1) if byte == b'\n' => Chunk::Size {
            size: 0,
            digits: 0,
            ext: false,
            seen: 0,
        },
        Chunk::DataEnd(_) => return Err(BodyError::Chunked("expected CRLF after chunk data")),
        Chunk::Trailer { line, total } => {
            if total >= MAX_TRAILERS {
                return Err(BodyError::Chunked("trailer section too long"));
            }
            match byte {
                b'\n' if line == 0 => return Ok(Decoder::Done),
                b'\n' => Chunk::Trailer {
                    line: 0,
                    total: total + 1,
                },
                // A CR is part of the line end; a blank line is CRLF or LF alone.
                b'\r' => Chunk::Trailer {
                    line,
                    total: total + 1,
                },
                _ => Chunk::Trailer {
                    line: line + 1,
                    total: total + 1,
                },
            }
        }
    };
    Ok(Decoder::Chunked(next))
}

/// The first state of a chunked body.
pub(crate) const CHUNKED: Decoder = Decoder::Chunked(Chunk::Size {
    size: 0,
    digits: 0,
    ext: false,
    seen: 0,
});

/// A request body read from a natively served HTTP/1 connection.
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
                _ => super::conn::READ_CHUNK,
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    /// Decodes `input` fed in pieces of `step` bytes; returns the body or the error.
    fn decode_all(mut decoder: Decoder, input: &[u8], step: usize) -> Result<Vec<u8>, String> {
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut fed = 0;
        loop {
            match decoder.decode(&mut buf).map_err(|e| e.to_string())? {
                Decoded::Data(d) => out.extend_from_slice(&d),
                Decoded::End => return Ok(out),
                Decoded::More => {
                    if fed == input.len() {
                        return Err("incomplete".into());
                    }
                    let n = step.min(input.len() - fed);
                    buf.extend_from_slice(&input[fed..fed + n]);
                    fed += n;
                }
            }
        }
    }

    #[test]
    fn chunked_bodies_decode_whatever_the_read_splits() {
        let input = b"5\r\nhello\r\n6;name=v\r\n world\r\nA \r\n0123456789\r\n0\r\nx-t: 1\r\n\r\n";
        for step in 1..input.len() {
            assert_eq!(
                decode_all(CHUNKED, input, step).unwrap(),
                b"hello world0123456789",
                "{step}"
            );
        }
        assert_eq!(decode_all(CHUNKED, b"0\r\n\r\n", 3).unwrap(), b"");
        assert_eq!(
            decode_all(CHUNKED, b"3\r\nabc\r\n0\r\n\n", 2).unwrap(),
            b"abc"
        );
    }

    #[test]
    fn malformed_chunked_bodies_fail() {
        for bad in [
            &b"x\r\n"[..],
            b"\r\n",
            b"5\nhello\r\n0\r\n\r\n",
            b"5\r\nhelloXX0\r\n\r\n",
            b"11111111111111111\r\n",
            b";ext\r\n",
        ] {
            assert!(decode_all(CHUNKED, bad, 1).is_err(), "{bad:?}");
        }
        let mut long = b"1;".to_vec();
        long.extend(std::iter::repeat_n(b'x', MAX_CHUNK_LINE));
        assert!(decode_all(CHUNKED, &long, 64).is_err());
        let mut trailers = b"0\r\n".to_vec();
        trailers.extend(std::iter::repeat_n(b'x', MAX_TRAILERS + 1));
        assert!(decode_all(CHUNKED, &trailers, 512).is_err());
    }

    #[test]
    fn length_bodies_stop_at_the_length() {
        let mut buf = BytesMut::from(&b"helloGET /"[..]);
        let mut d = Decoder::Length(5);
        assert_eq!(
            d.decode(&mut buf).unwrap(),
            Decoded::Data(Bytes::from_static(b"hello"))
        );
        assert_eq!(d.decode(&mut buf).unwrap(), Decoded::End);
        assert_eq!(&buf[..], b"GET /");
        assert_eq!(decode_all(Decoder::Length(3), b"abc", 1).unwrap(), b"abc");
    }
}
