//! The native HTTP/1 parsers behind a small public surface, for the fuzz targets and the
//! differential test against hyper. Not an API: nothing else may depend on it.

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Method, Request, Response, StatusCode};

use super::body::{self, Decoded, Decoder};
use super::client::{self, RequestFraming, ResponseFraming};
use super::head::{self, Framing};

pub use super::body::BodyError;
pub use super::client::ResponseHeadError;
/// Header lines per head at most (more: 431 for requests, refused responses).
pub const MAX_HEADERS: usize = super::head::MAX_HEADERS;

/// How a message body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyFraming {
    Empty,
    Length(u64),
    Chunked,
    UntilClose,
}

/// A request head the server accepted.
#[derive(Debug)]
pub struct RequestHead {
    /// Method, target, version, and the headers kept in the map (framing and standard
    /// hop-by-hop ones are read and left out).
    pub request: Request<()>,
    pub framing: BodyFraming,
    pub keep_alive: bool,
    pub expect_continue: bool,
    /// The connection ends after this request (`CONNECT`, `Upgrade`).
    pub last: bool,
    /// Bytes of the head, its blank line included.
    pub len: usize,
}

/// Why a request head was refused, and the status the server answers with.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    pub status: StatusCode,
    pub reason: String,
}

/// Parses the request head at the start of `input` as the native server does; `None` while it
/// is incomplete.
pub fn request_head(input: &[u8]) -> Option<Result<RequestHead, Refused>> {
    let len = head::find_end(input, 0)?;
    let mut buf = BytesMut::from(&input[..len]);
    Some(
        head::parse(&mut buf, len)
            .map(|h| RequestHead {
                request: h.request,
                framing: match h.framing {
                    Framing::Empty => BodyFraming::Empty,
                    Framing::Length(n) => BodyFraming::Length(n),
                    Framing::Chunked => BodyFraming::Chunked,
                },
                keep_alive: h.keep_alive,
                expect_continue: h.expect_continue,
                last: h.last,
                len,
            })
            .map_err(|e| Refused {
                status: e.status(),
                reason: e.to_string(),
            }),
    )
}

/// Writes a request head as the gateway's upstream client does (origin-form `target`, no
/// `host` added, the framing's own header).
pub fn encode_request_head(
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    framing: BodyFraming,
) -> Vec<u8> {
    let framing = match framing {
        BodyFraming::Empty => RequestFraming::None,
        BodyFraming::Length(n) => RequestFraming::Length(n),
        BodyFraming::Chunked | BodyFraming::UntilClose => RequestFraming::Chunked,
    };
    let mut out = Vec::new();
    client::encode_head(&mut out, method, target, "", headers, framing);
    out
}

/// A response head the client accepted.
#[derive(Debug)]
pub struct ResponseHead {
    pub response: Response<()>,
    pub framing: BodyFraming,
    pub keep_alive: bool,
    pub len: usize,
}

/// Parses the response head at the start of `input` as the upstream client does; `None` while
/// it is incomplete. `head_request`: the request was `HEAD`.
pub fn response_head(
    input: &[u8],
    head_request: bool,
) -> Option<Result<ResponseHead, ResponseHeadError>> {
    let len = head::find_end(input, 0)?;
    let mut buf = BytesMut::from(&input[..len]);
    Some(
        client::parse_response(&mut buf, len, head_request).map(|h| ResponseHead {
            response: h.response,
            framing: match h.framing {
                ResponseFraming::Empty => BodyFraming::Empty,
                ResponseFraming::Length(n) => BodyFraming::Length(n),
                ResponseFraming::Chunked => BodyFraming::Chunked,
                ResponseFraming::UntilClose => BodyFraming::UntilClose,
            },
            keep_alive: h.keep_alive,
            len,
        }),
    )
}

/// Writes a response head as the native server does (the body's framing chosen from the
/// headers' `Content-Length`, else chunked).
pub fn encode_response_head(status: StatusCode, headers: &HeaderMap, keep_alive: bool) -> Vec<u8> {
    let mut out = Vec::new();
    super::write::head(&mut out, status, headers, None, false, false, keep_alive);
    out
}

/// What one call of [`BodyDecoder::decode`] gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    Data(Bytes),
    /// More bytes are needed.
    More,
    /// The body is complete; bytes left in the buffer belong to the next message.
    End,
}

/// The body decoder both directions use (request bodies on the server, response bodies in the
/// upstream client).
#[derive(Debug)]
pub struct BodyDecoder(Decoder);

impl BodyDecoder {
    pub fn new(framing: BodyFraming) -> Self {
        Self(match framing {
            BodyFraming::Empty => Decoder::Done,
            BodyFraming::Length(n) => Decoder::Length(n),
            BodyFraming::Chunked => body::CHUNKED,
            BodyFraming::UntilClose => Decoder::Length(u64::MAX),
        })
    }

    /// Takes the next piece of body from `buf`.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Piece, BodyError> {
        Ok(match self.0.decode(buf)? {
            Decoded::Data(d) => Piece::Data(d),
            Decoded::More => Piece::More,
            Decoded::End => Piece::End,
        })
    }
}
