//! Message bodies' framing: the `Content-Length` and chunked decoders, for request bodies
//! ([`super::conn::Body`]) and upstream responses ([`crate::pool`]).

use bytes::{Buf, Bytes, BytesMut};

/// Longest chunk-size line (with extensions) and trailer section accepted.
const MAX_CHUNK_LINE: usize = 4096;
const MAX_TRAILERS: usize = 16 * 1024;
/// Trailer field lines at most (hyper's server and client refuse more than 100).
const MAX_TRAILER_LINES: u8 = super::head::MAX_HEADERS as u8;
/// Bytes after the size digits of all chunk-size lines of a body, at most (hyper's cap on
/// chunk extensions).
const MAX_EXTENSIONS: u16 = 16 * 1024;

/// Where a request body's decoding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decoder {
    /// The body ended (or there was none).
    Done,
    /// Bytes of a `Content-Length` body still to come.
    Length(u64),
    /// In a chunked body; `ext`: bytes after the size digits of its chunk-size lines so far.
    Chunked { at: Chunk, ext: u16 },
    /// The body was malformed or the connection ended early: the connection cannot be reused.
    Failed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Chunk {
    /// In chunk data (bytes left): split off the buffer, never stepped through.
    Data(u64),
    /// In the framing around chunk data, read one byte at a time.
    Line(Line),
}

/// The framing lines of a chunked body (RFC 9112 §7.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Line {
    /// In a chunk-size line: the size so far, where in the line, bytes of the line seen.
    Size { size: u64, at: SizeAt, seen: usize },
    /// After the CR of a chunk-size line.
    SizeLf { size: u64 },
    /// The CR after chunk data.
    DataCr,
    /// The LF after chunk data.
    DataLf,
    /// In the trailer section: where in the current field line, bytes of the section seen,
    /// field lines seen.
    Trailer {
        at: TrailerAt,
        total: usize,
        lines: u8,
    },
}

/// Where a chunk-size line is: `chunk-size *( BWS ";" BWS name [ BWS "=" BWS value ] )`, with
/// BWS also accepted before the CR (as hyper does after the size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SizeAt {
    /// Before the first hex digit.
    Start,
    /// In the hex digits.
    Digits,
    /// Whitespace after the size or a value: `;` or CR next.
    Space,
    /// After `;`: whitespace, then an extension name.
    Semicolon,
    /// In an extension name.
    Name,
    /// Whitespace after a name: `=`, `;` or CR next.
    NameSpace,
    /// After `=`: whitespace, then a token or a quoted string.
    Equals,
    /// In a token value.
    Token,
    /// In a quoted-string value.
    Quoted,
    /// After a backslash in a quoted string.
    Escape,
}

/// Where a trailer field line (`name ":" value CRLF`) is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TrailerAt {
    /// At the start of a line: a name, or the CR of the closing blank line.
    Start,
    Name,
    Value,
    /// After the CR of a field line.
    Lf,
    /// After the CR of the closing blank line.
    EndLf,
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
                Decoder::Chunked {
                    at: Chunk::Data(left),
                    ext,
                } => {
                    let Some((data, left)) = take(buf, left) else {
                        return Ok(Decoded::More);
                    };
                    let at = if left == 0 {
                        Chunk::Line(Line::DataCr)
                    } else {
                        Chunk::Data(left)
                    };
                    *self = Decoder::Chunked { at, ext };
                    return Ok(Decoded::Data(data));
                }
                Decoder::Chunked {
                    at: Chunk::Line(line),
                    ext,
                } => {
                    let Some(&byte) = buf.first() else {
                        return Ok(Decoded::More);
                    };
                    buf.advance(1);
                    *self = match chunk_step(line, ext, byte) {
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

/// `tchar` of RFC 9110 §5.6.2: the bytes of a token.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A byte of a field value: HTAB, SP, VCHAR or obs-text (RFC 9110 §5.5).
fn is_field_byte(b: u8) -> bool {
    matches!(b, b'\t' | b' ' | 0x21..=0x7e | 0x80..=0xff)
}

/// One byte of chunk framing (size lines, data line ends, trailers).
fn chunk_step(line: Line, mut ext: u16, byte: u8) -> Result<Decoder, BodyError> {
    let bad = |what| Err(BodyError::Chunked(what));
    let next = match line {
        Line::Size { size, at, seen } => {
            if seen >= MAX_CHUNK_LINE {
                return bad("chunk-size line too long");
            }
            let seen = seen + 1;
            let digit = matches!(at, SizeAt::Start | SizeAt::Digits) && byte.is_ascii_hexdigit();
            if !digit && at != SizeAt::Start {
                if ext >= MAX_EXTENSIONS {
                    return bad("chunk extensions too long");
                }
                ext += 1;
            }
            let to = |at| Line::Size { size, at, seen };
            if let (SizeAt::Start | SizeAt::Digits, Some(digit)) = (at, (byte as char).to_digit(16))
            {
                let Some(size) = size
                    .checked_mul(16)
                    .and_then(|s| s.checked_add(u64::from(digit)))
                else {
                    return bad("chunk size too large");
                };
                return Ok(Decoder::Chunked {
                    at: Chunk::Line(Line::Size {
                        size,
                        at: SizeAt::Digits,
                        seen,
                    }),
                    ext,
                });
            }
            match (at, byte) {
                (SizeAt::Start, _) => return bad("invalid chunk size"),
                (SizeAt::Semicolon | SizeAt::Name, b) if is_tchar(b) => to(SizeAt::Name),
                (SizeAt::Equals | SizeAt::Token, b) if is_tchar(b) => to(SizeAt::Token),
                (SizeAt::Equals, b'"') => to(SizeAt::Quoted),
                (SizeAt::Quoted, b'"') => to(SizeAt::Space),
                (SizeAt::Quoted, b'\\') => to(SizeAt::Escape),
                (SizeAt::Quoted | SizeAt::Escape, b) if is_field_byte(b) => to(SizeAt::Quoted),
                (SizeAt::Quoted | SizeAt::Escape, _) => {
                    return bad("invalid byte in a chunk extension value");
                }
                (SizeAt::Semicolon | SizeAt::Equals, b' ' | b'\t') => to(at),
                (SizeAt::Name | SizeAt::NameSpace, b' ' | b'\t') => to(SizeAt::NameSpace),
                (SizeAt::Name | SizeAt::NameSpace, b'=') => to(SizeAt::Equals),
                (SizeAt::Digits | SizeAt::Space | SizeAt::Token, b' ' | b'\t') => to(SizeAt::Space),
                (
                    SizeAt::Digits
                    | SizeAt::Space
                    | SizeAt::Name
                    | SizeAt::NameSpace
                    | SizeAt::Token,
                    b';',
                ) => to(SizeAt::Semicolon),
                (
                    SizeAt::Digits
                    | SizeAt::Space
                    | SizeAt::Name
                    | SizeAt::NameSpace
                    | SizeAt::Token,
                    b'\r',
                ) => Line::SizeLf { size },
                (SizeAt::Digits, _) => return bad("invalid chunk size"),
                _ => return bad("malformed chunk extension"),
            }
        }
        Line::SizeLf { size } => {
            if byte != b'\n' {
                return bad("expected LF after the chunk size");
            }
            if size == 0 {
                Line::Trailer {
                    at: TrailerAt::Start,
                    total: 0,
                    lines: 0,
                }
            } else {
                return Ok(Decoder::Chunked {
                    at: Chunk::Data(size),
                    ext,
                });
            }
        }
        Line::DataCr if byte == b'\r' => Line::DataLf,
        Line::DataLf if byte == b'\n' => Line::Size {
            size: 0,
            at: SizeAt::Start,
            seen: 0,
        },
        Line::DataCr | Line::DataLf => return bad("expected CRLF after chunk data"),
        Line::Trailer { at, total, lines } => {
            if total >= MAX_TRAILERS {
                return bad("trailer section too long");
            }
            let to = |at| Line::Trailer {
                at,
                total: total + 1,
                lines,
            };
            match (at, byte) {
                (TrailerAt::Start, b'\r') => to(TrailerAt::EndLf),
                (TrailerAt::EndLf, b'\n') => return Ok(Decoder::Done),
                (TrailerAt::Start | TrailerAt::Name, b) if is_tchar(b) => to(TrailerAt::Name),
                (TrailerAt::Name, b':') => to(TrailerAt::Value),
                (TrailerAt::Value, b'\r') => to(TrailerAt::Lf),
                (TrailerAt::Value, b) if is_field_byte(b) => to(TrailerAt::Value),
                (TrailerAt::Lf, b'\n') if lines < MAX_TRAILER_LINES => Line::Trailer {
                    at: TrailerAt::Start,
                    total: total + 1,
                    lines: lines + 1,
                },
                (TrailerAt::Lf, b'\n') => return bad("too many trailer field lines"),
                (TrailerAt::Lf | TrailerAt::EndLf, _) => {
                    return bad("expected LF after CR in the trailer section");
                }
                _ => return bad("malformed trailer field line"),
            }
        }
    };
    Ok(Decoder::Chunked {
        at: Chunk::Line(next),
        ext,
    })
}

/// The first state of a chunked body.
pub(crate) const CHUNKED: Decoder = Decoder::Chunked {
    at: Chunk::Line(Line::Size {
        size: 0,
        at: SizeAt::Start,
        seen: 0,
    }),
    ext: 0,
};

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
    }

    #[test]
    fn chunk_sizes_are_hex_with_any_leading_zeros_and_no_overflow() {
        for (line, size) in [
            ("1", 1u64),
            ("01", 1),
            ("00000000000000000000000001", 1),
            ("fF", 255),
            ("Ff   ", 255),
            ("Ff\t", 255),
            ("ffffffffffffffff", u64::MAX),
            ("000ffffffffffffffff", u64::MAX),
        ] {
            let mut d = CHUNKED;
            let mut buf = BytesMut::from(format!("{line}\r\n").as_bytes());
            assert_eq!(d.decode(&mut buf).unwrap(), Decoded::More, "{line:?}");
            assert!(
                matches!(d, Decoder::Chunked { at: Chunk::Data(n), .. } if n == size),
                "{line:?}"
            );
        }
        for bad in [
            "10000000000000000",
            "f0000000000000003",
            "-1",
            "+1",
            "0x1",
            "1 A",
            "1 1",
            " 1",
            "",
            "g",
        ] {
            let input = format!("{bad}\r\n");
            assert!(decode_all(CHUNKED, input.as_bytes(), 1).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn chunk_extensions_follow_the_rfc_grammar() {
        for ext in [
            &b";a"[..],
            b";a=b",
            b"; a = b ",
            b"\t;\ta\t=\tb\t",
            b";a;b=c;d",
            b";a=\"\"",
            b";a=\"x y;z=\\\"q\\\\\"",
            b";a=\"\x80\xff\"",
            b";extension...",
            b";!#$%&'*+-.^_`|~=!#$%&'*+-.^_`|~",
            b"   ;   a",
        ] {
            let mut input = b"1".to_vec();
            input.extend_from_slice(ext);
            input.extend_from_slice(b"\r\nx\r\n0\r\n\r\n");
            assert_eq!(decode_all(CHUNKED, &input, 1).unwrap(), b"x", "{ext:?}");
        }
        for ext in [
            &b";"[..],
            b";;",
            b";a;;b",
            b"; ",
            b";a=",
            b";a= ",
            b";=b",
            b";a b",
            b";a=b c",
            b";a=b=c",
            b";a=\"b",
            b";a=\"b\"c",
            b";a=b\"",
            b";a\0",
            b";a=\0",
            b";a=\"\0\"",
            b";a=\"\x7f\"",
            b";a=\"\\\x01\"",
            b";a\nb",
            b";a=b\n",
            b";a\rb",
            b";a=\"b\r\"",
            b";a@b",
            b";a=b,c",
            b";(a)",
            b"\x0b;a",
        ] {
            let mut input = b"1".to_vec();
            input.extend_from_slice(ext);
            input.extend_from_slice(b"\r\nx\r\n0\r\n\r\n");
            assert!(decode_all(CHUNKED, &input, 1).is_err(), "{ext:?}");
        }
    }

    #[test]
    fn trailers_are_field_lines_ending_in_crlf() {
        for trailers in [
            &b""[..],
            b"x: 1\r\n",
            b"x:1\r\n",
            b"x:\r\n",
            b"X-A: a b\tc\r\ny: \x80\r\n",
            b"x: \"q\"\r\n",
        ] {
            let mut input = b"0\r\n".to_vec();
            input.extend_from_slice(trailers);
            input.extend_from_slice(b"\r\n");
            assert_eq!(decode_all(CHUNKED, &input, 1).unwrap(), b"", "{trailers:?}");
        }
        for trailers in [
            &b"\n"[..],
            b"x: 1\n\r\n",
            b"x: 1\r\n\n",
            b"x: 1\r\r\n\r\n",
            b"x: 1\rx\r\n\r\n",
            b"x: a\rb\r\n\r\n",
            b"\r\r\n",
            b"\rx",
            b"x: 1\r\n y\r\n\r\n",
            b" x: 1\r\n\r\n",
            b"x : 1\r\n\r\n",
            b": 1\r\n\r\n",
            b"x\r\n\r\n",
            b"x: a\0b\r\n\r\n",
            b"x: a\x7fb\r\n\r\n",
            b"x: a\x01\r\n\r\n",
            b"x@y: 1\r\n\r\n",
        ] {
            let mut input = b"0\r\n".to_vec();
            input.extend_from_slice(trailers);
            assert!(decode_all(CHUNKED, &input, 1).is_err(), "{trailers:?}");
        }
    }

    #[test]
    fn every_byte_after_every_prefix_is_handled_without_panicking() {
        // Every framing state, each given every byte: an error or a next state, never a panic.
        let valid = b"1;a=\"b\\c\" ; d\r\nx\r\n0\r\nk: v\r\n\r\n";
        for cut in 0..valid.len() {
            for byte in 0..=255u8 {
                let mut input = valid[..cut].to_vec();
                input.push(byte);
                let _ = decode_all(CHUNKED, &input, 1);
            }
        }
    }

    #[test]
    fn malformed_chunked_bodies_fail() {
        for bad in [
            &b"x\r\n"[..],
            b"\r\n",
            b"5\nhello\r\n0\r\n\r\n",
            b"5\r\nhelloXX0\r\n\r\n",
            b"5\r\nhello\n0\r\n\r\n",
            b"5\r\nhello\r0\r\n\r\n",
            b"11111111111111111\r\n",
            b";ext\r\n",
            b"3\r\nabc\r\n0\r\n\n",
            b"3\r\nabc\r\n0\n\r\n",
            b"3\r\nabc\r\n0\r\r\n",
        ] {
            assert!(decode_all(CHUNKED, bad, 1).is_err(), "{bad:?}");
        }
        let mut long = b"1;".to_vec();
        long.extend(std::iter::repeat_n(b'x', MAX_CHUNK_LINE));
        assert!(decode_all(CHUNKED, &long, 64).is_err());
        let mut zeros = vec![b'0'; MAX_CHUNK_LINE + 1];
        zeros.extend_from_slice(b"1\r\n");
        assert!(decode_all(CHUNKED, &zeros, 64).is_err());
        let mut trailers = b"0\r\n".to_vec();
        trailers.extend(std::iter::repeat_n(b'x', MAX_TRAILERS + 1));
        assert!(decode_all(CHUNKED, &trailers, 512).is_err());
    }

    #[test]
    fn trailer_lines_and_extensions_are_capped_over_the_body() {
        let trailers = |n: u8| {
            let mut t = b"0\r\n".to_vec();
            for _ in 0..n {
                t.extend_from_slice(b"a:\r\n");
            }
            t.extend_from_slice(b"\r\n");
            t
        };
        assert!(decode_all(CHUNKED, &trailers(MAX_TRAILER_LINES), 64).is_ok());
        assert!(decode_all(CHUNKED, &trailers(MAX_TRAILER_LINES + 1), 64).is_err());

        // Each line counts 2046 bytes after its digit (`;`, the name, the CR): 8 fit, 9 do not.
        let ext = format!(";{}", "e".repeat(2044));
        let body = |chunks: usize| {
            let mut b = format!("1{ext}\r\nx\r\n").repeat(chunks).into_bytes();
            b.extend_from_slice(b"0\r\n\r\n");
            b
        };
        assert_eq!(decode_all(CHUNKED, &body(8), 512).unwrap(), b"xxxxxxxx");
        assert!(decode_all(CHUNKED, &body(9), 512).is_err());
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
