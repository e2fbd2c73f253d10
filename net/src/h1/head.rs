//! Request heads: finding where one ends, parsing it with `httparse` and deciding its framing.
//!
//! The head's bytes are frozen into one `Bytes`; the request target and every header value are
//! slices of it (no copy per header). Anything that would let two HTTP implementations frame
//! the request differently is refused: both `Content-Length` and `Transfer-Encoding`,
//! conflicting or malformed lengths, any transfer coding but a single `chunked`, obs-fold,
//! whitespace before a colon, control characters in values.

use std::mem::MaybeUninit;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Uri, Version};

/// Header lines per request head at most (more: 431).
pub(crate) const MAX_HEADERS: usize = 96;

/// How a request body is framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body.
    Empty,
    /// `Content-Length` bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

/// A parsed request head.
#[derive(Debug)]
pub(crate) struct Head {
    pub(crate) request: Request<()>,
    pub(crate) framing: Framing,
    /// The client allows another request on this connection after this one.
    pub(crate) keep_alive: bool,
    /// `Expect: 100-continue` (HTTP/1.1 only).
    pub(crate) expect_continue: bool,
    /// `CONNECT` or `Upgrade`: whatever follows may not be HTTP/1, so the connection ends with
    /// this request's answer.
    pub(crate) last: bool,
}

/// Why a head was refused; each maps to an answer and a closed connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HeadError {
    #[error("request head larger than the limit")]
    TooLarge,
    #[error("malformed request head: {0}")]
    Malformed(&'static str),
    #[error("both Content-Length and Transfer-Encoding")]
    Conflict,
    #[error("unsupported HTTP version")]
    Version,
}

impl HeadError {
    pub(crate) fn status(self) -> http::StatusCode {
        match self {
            HeadError::TooLarge => http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            HeadError::Version => http::StatusCode::HTTP_VERSION_NOT_SUPPORTED,
            HeadError::Malformed(_) | HeadError::Conflict => http::StatusCode::BAD_REQUEST,
        }
    }

    pub(crate) fn code(self) -> &'static str {
        match self {
            HeadError::TooLarge => "request_header_fields_too_large",
            HeadError::Version => "http_version_not_supported",
            HeadError::Malformed(_) => "bad_request",
            HeadError::Conflict => "conflicting_framing",
        }
    }
}

/// Where the head ends in `buf` (the index just after its blank line), looking only at bytes
/// from `from` on (the caller remembers how far it already looked, so that a client sending
/// one byte at a time costs linear time). Accepts CRLF and bare LF line ends, as `httparse`
/// does.
pub(crate) fn find_end(buf: &[u8], from: usize) -> Option<usize> {
    // Clamped: a `from` past the end must not panic.
    let start = from.saturating_sub(3).min(buf.len());
    for nl in memchr::memchr_iter(b'\n', &buf[start..]) {
        let at = start + nl;
        let before = &buf[..at];
        if before.ends_with(b"\n") || before.ends_with(b"\n\r") {
            return Some(at + 1);
        }
    }
    None
}

/// Parses the head that ends at `len` in `buf` and splits it off the buffer.
pub(crate) fn parse(buf: &mut BytesMut, len: usize) -> Result<Head, HeadError> {
    // The head is frozen first and parsed in place: every slice `httparse` returns is then a
    // slice of `bytes`, taken without copying. The header slots are not initialised (zeroing
    // 96 of them cost more than parsing a typical head).
    let bytes = buf.split_to(len).freeze();
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    match req.parse_with_uninit_headers(&bytes, &mut slots) {
        Ok(httparse::Status::Complete(n)) if n == len => {}
        Ok(_) => return Err(HeadError::Malformed("incomplete head")),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Err(httparse::Error::Version) => return Err(HeadError::Version),
        Err(e) => return Err(HeadError::Malformed(error_text(e))),
    }
    let method = Method::from_bytes(req.method.unwrap_or_default().as_bytes())
        .map_err(|_| HeadError::Malformed("invalid method"))?;
    let version = match req.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let uri = target_uri(&bytes, req.path.unwrap_or_default().as_bytes())
        .map_err(|_| HeadError::Malformed("invalid request target"))?;
    let count = req.headers.len();

    let mut headers = HeaderMap::with_capacity(count);
    let mut framing = Framing::Empty;
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut connection = ConnectionTokens::default();
    let mut expect_continue = false;
    let mut upgrade = false;
    for h in req.headers.iter() {
        let name = header_name(h.name.as_bytes())
            .map_err(|_| HeadError::Malformed("invalid header name"))?;
        let value = HeaderValue::from_maybe_shared(bytes.slice_ref(h.value))
            .map_err(|_| HeadError::Malformed("invalid header value"))?;
        // Whether the header goes into the request's map. The framing headers are read here
        // (their meaning is in `framing` and the body's size hint), and they and the other
        // standard hop-by-hop headers are left out: the gateway, the only user of this
        // server, never forwards them (`headers::sanitize_request` would remove them, one map
        // insert and one removal each for nothing). A `connection` value stays when it names
        // other headers, because the sanitiser also removes the headers it names.
        let keep = match name {
            header::CONTENT_LENGTH => {
                // One number per line, as hyper's server reads it (a list, even of equal
                // numbers, is refused); repeated lines must agree.
                let n = decimal(value.as_bytes())
                    .ok_or(HeadError::Malformed("invalid Content-Length"))?;
                if length.is_some_and(|seen| seen != n) {
                    return Err(HeadError::Malformed("conflicting Content-Length values"));
                }
                length = Some(n);
                false
            }
            header::TRANSFER_ENCODING => {
                if chunked
                    || !value
                        .as_bytes()
                        .trim_ascii()
                        .eq_ignore_ascii_case(b"chunked")
                {
                    return Err(HeadError::Malformed(
                        "unsupported Transfer-Encoding (only a single `chunked` is accepted)",
                    ));
                }
                chunked = true;
                false
            }
            header::CONNECTION => connection.add(value.as_bytes()),
            header::EXPECT => {
                if value.as_bytes().eq_ignore_ascii_case(b"100-continue") {
                    expect_continue = true;
                } else {
                    return Err(HeadError::Malformed("unsupported Expect"));
                }
                false
            }
            header::UPGRADE => {
                upgrade = true;
                false
            }
            header::HOST => false,
            _ => !left_out_hop_by_hop(&name),
        };
        if keep {
            headers.append(name, value);
        }
    }
    if chunked {
        if length.is_some() {
            return Err(HeadError::Conflict);
        }
        if version == Version::HTTP_10 {
            return Err(HeadError::Malformed(
                "Transfer-Encoding in an HTTP/1.0 request",
            ));
        }
        framing = Framing::Chunked;
    } else if let Some(n) = length.filter(|&n| n > 0) {
        framing = Framing::Length(n);
    }
    let keep_alive = connection.persistent(version);
    let last = upgrade || connection.upgrade || method == Method::CONNECT;
    let mut request = Request::new(());
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = version;
    *request.headers_mut() = headers;
    Ok(Head {
        request,
        framing,
        keep_alive,
        expect_continue: expect_continue && version == Version::HTTP_11,
        last,
    })
}

/// The `Connection` tokens faden acts on, over every `Connection` header of a head (requests
/// and upstream responses alike).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ConnectionTokens {
    close: bool,
    keep_alive: bool,
    pub(crate) upgrade: bool,
}

impl ConnectionTokens {
    /// Adds the tokens of one `Connection` value. Returns whether the value names any other
    /// header (a token but `close`, `keep-alive` and `upgrade`), which a proxy must then
    /// remove; the parsers keep only such values in the map, for the sanitisers.
    pub(crate) fn add(&mut self, value: &[u8]) -> bool {
        let mut names_others = false;
        for token in value.split(|&b| b == b',') {
            let token = token.trim_ascii();
            if token.eq_ignore_ascii_case(b"close") {
                self.close = true;
            } else if token.eq_ignore_ascii_case(b"keep-alive") {
                self.keep_alive = true;
            } else if token.eq_ignore_ascii_case(b"upgrade") {
                self.upgrade = true;
            } else {
                names_others |= !token.is_empty();
            }
        }
        names_others
    }

    /// Whether the peer allows another message on the connection: HTTP/1.1 unless `close`,
    /// HTTP/1.0 only with `keep-alive`.
    pub(crate) fn persistent(self, version: Version) -> bool {
        match version {
            Version::HTTP_10 => self.keep_alive && !self.close,
            _ => !self.close,
        }
    }
}

/// The standard hop-by-hop headers both parsers leave out of their maps without reading them
/// (no user of the parsed heads forwards them; `headers::sanitize_request` and
/// `headers::sanitize_response` would remove them).
pub(crate) fn left_out_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        *name,
        header::TE | header::TRAILER | header::PROXY_AUTHENTICATE | header::PROXY_AUTHORIZATION
    )
}

/// The request target `raw` (a slice of `bytes`) as a `Uri`, checked byte by byte by `Uri`'s
/// parser.
fn target_uri(bytes: &Bytes, raw: &[u8]) -> Result<Uri, http::uri::InvalidUri> {
    Uri::from_maybe_shared(bytes.slice_ref(raw))
}

/// `raw` as a header name. The names most heads carry are recognised in any case by their
/// length and first letter and one comparison, without `HeaderName::from_bytes`, which copies
/// the name through a lower-casing table, then compares it with the standard names of its
/// length, and allocates for a name that is not standard. Every other name goes through
/// `from_bytes`, with its validation.
pub(crate) fn header_name(raw: &[u8]) -> Result<HeaderName, header::InvalidHeaderName> {
    use crate::headers::{KEEP_ALIVE, X_API_KEY};
    let first = raw.first().map_or(0, |b| b | 0x20);
    let (lower, name): (&[u8], HeaderName) = match (raw.len(), first) {
        (4, b'h') => (b"host", header::HOST),
        (4, b'd') => (b"date", header::DATE),
        (6, b'a') => (b"accept", header::ACCEPT),
        (6, b'e') => (b"expect", header::EXPECT),
        (6, b's') => (b"server", header::SERVER),
        (9, b'x') => (b"x-api-key", X_API_KEY),
        (10, b'c') => (b"connection", header::CONNECTION),
        (10, b'k') => (b"keep-alive", KEEP_ALIVE),
        (10, b'u') => (b"user-agent", header::USER_AGENT),
        (12, b'c') => (b"content-type", header::CONTENT_TYPE),
        (13, b'a') => (b"authorization", header::AUTHORIZATION),
        (13, b'c') => (b"cache-control", header::CACHE_CONTROL),
        (14, b'c') => (b"content-length", header::CONTENT_LENGTH),
        (15, b'a') => (b"accept-encoding", header::ACCEPT_ENCODING),
        (17, b't') => (b"transfer-encoding", header::TRANSFER_ENCODING),
        _ => return HeaderName::from_bytes(raw),
    };
    if eq_lowercase(raw, lower) {
        Ok(name)
    } else {
        HeaderName::from_bytes(raw)
    }
}

/// Whether `raw` is `lower` (lowercase letters, `-` and digits, at least 4 bytes, the same
/// length as `raw`) in any case, compared a word at a time: each letter of `lower` has bit
/// 0x40 set, so `(lower & 0x40…) >> 1` puts 0x20 exactly where a letter is, and only the two
/// cases of that letter OR 0x20 to it; every other byte must be equal. (`eq_ignore_ascii_case`
/// goes byte by byte, about 13 instructions a byte.)
fn eq_lowercase(raw: &[u8], lower: &[u8]) -> bool {
    fn word<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
        let mut w = [0u8; N];
        w.copy_from_slice(&b[at..at + N]);
        w
    }
    let n = raw.len();
    if n != lower.len() || n < 4 {
        return false;
    }
    if n < 8 {
        // Two overlapping 4-byte words.
        return [0, n - 4].into_iter().all(|at| {
            let (r, l) = (
                u32::from_le_bytes(word(raw, at)),
                u32::from_le_bytes(word(lower, at)),
            );
            r | ((l & 0x4040_4040) >> 1) == l
        });
    }
    let same = |at: usize| {
        let (r, l) = (
            u64::from_le_bytes(word(raw, at)),
            u64::from_le_bytes(word(lower, at)),
        );
        r | ((l & 0x4040_4040_4040_4040) >> 1) == l
    };
    let mut at = 0;
    while at + 8 < n {
        if !same(at) {
            return false;
        }
        at += 8;
    }
    same(n - 8)
}

/// A non-empty string of at most 19 ASCII digits as a number (no sign, no spaces: the form of a
/// length on the wire).
pub(crate) fn decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        digits
            .iter()
            .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0')),
    )
}

/// A response's `Content-Length` value: digits, or a list of equal digit strings (RFC 9110
/// §8.6), as hyper's client reads it.
pub(crate) fn content_length(value: &[u8]) -> Result<u64, HeadError> {
    let mut found: Option<u64> = None;
    for part in value.split(|&b| b == b',') {
        let n = decimal(part.trim_ascii()).ok_or(HeadError::Malformed("invalid Content-Length"))?;
        if found.is_some_and(|f| f != n) {
            return Err(HeadError::Malformed("conflicting Content-Length values"));
        }
        found = Some(n);
    }
    found.ok_or(HeadError::Malformed("invalid Content-Length"))
}

fn error_text(e: httparse::Error) -> &'static str {
    match e {
        httparse::Error::HeaderName => "invalid header name",
        httparse::Error::HeaderValue => "invalid header value",
        httparse::Error::NewLine => "invalid line ending",
        httparse::Error::Status | httparse::Error::Token => "invalid request line",
        httparse::Error::TooManyHeaders => "too many headers",
        httparse::Error::Version => "invalid HTTP version",
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn head(text: &str) -> Result<Head, HeadError> {
        let mut buf = BytesMut::from(text.as_bytes());
        let end = find_end(&buf, 0).expect("complete head");
        parse(&mut buf, end)
    }

    #[test]
    fn lowercase_comparison_by_words_is_exact() {
        let names = [
            "host",
            "date",
            "accept",
            "x-api-key",
            "connection",
            "content-type",
            "transfer-encoding",
            "x-gpustack-model-instance",
            "abc1-xyz",
        ];
        for lower in names {
            let n = lower.len();
            assert!(eq_lowercase(lower.as_bytes(), lower.as_bytes()));
            assert!(eq_lowercase(
                lower.to_ascii_uppercase().as_bytes(),
                lower.as_bytes()
            ));
            // Every single byte changed to every other value: equal only when it is the
            // other case of the same letter.
            for i in 0..n {
                for b in 0..=255u8 {
                    let mut raw = lower.as_bytes().to_vec();
                    let original = raw[i];
                    raw[i] = b;
                    let want = b == original
                        || (original.is_ascii_lowercase() && b == original.to_ascii_uppercase());
                    assert_eq!(
                        eq_lowercase(&raw, lower.as_bytes()),
                        want,
                        "{lower} {i} {b}"
                    );
                }
            }
            assert!(!eq_lowercase(&lower.as_bytes()[1..], lower.as_bytes()));
        }
        assert!(
            !eq_lowercase(b"ab", b"ab"),
            "shorter than a word: not compared"
        );
    }

    #[test]
    fn common_header_names_are_the_names_from_bytes_gives() {
        let names = [
            "host",
            "date",
            "accept",
            "expect",
            "server",
            "x-api-key",
            "connection",
            "keep-alive",
            "user-agent",
            "content-type",
            "authorization",
            "cache-control",
            "content-length",
            "accept-encoding",
            "transfer-encoding",
            // Same length and first letter as a recognised name, but another name.
            "hash",
            "dnt1",
            "accent",
            "exempt",
            "sorter",
            "x-api-kez",
            "connectioN2",
            "keep-alivf",
            "u-agent-ua",
            "content-typf",
            "authorizatioN",
            "cache-controm",
            "content-lengtg",
            "accept-encodinh",
            "transfer-encodinf",
            "x-custom",
        ];
        for name in names {
            for raw in [
                name.to_string(),
                name.to_ascii_uppercase(),
                name.split('-')
                    .map(|w| {
                        let mut w = w.to_string();
                        w[..1].make_ascii_uppercase();
                        w
                    })
                    .collect::<Vec<_>>()
                    .join("-"),
            ] {
                let want = HeaderName::from_bytes(raw.as_bytes()).unwrap();
                assert_eq!(header_name(raw.as_bytes()).unwrap(), want, "{raw}");
            }
        }
        for bad in ["", "ho st", "con\u{e9}ction", "content-type:", "x y"] {
            assert!(header_name(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn finds_the_end_of_a_head_incrementally() {
        let text = b"GET / HTTP/1.1\r\nhost: x\r\n\r\nrest";
        assert_eq!(find_end(text, 0), Some(text.len() - 4));
        for split in 0..text.len() {
            // Looking again from where the previous look stopped finds the same end.
            let first = find_end(&text[..split], 0);
            if first.is_none() {
                assert_eq!(find_end(text, split), Some(text.len() - 4), "{split}");
            }
        }
        assert_eq!(find_end(b"GET / HTTP/1.1\nhost: x\n\n", 0), Some(24));
        assert_eq!(find_end(b"GET / HTTP/1.1\r\nhost: x\r\n", 0), None);
        assert_eq!(find_end(b"\n\n", 100), None);
    }

    #[test]
    fn parses_a_post_without_copying_values() {
        let mut buf = BytesMut::from(
            &b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: gw\r\nContent-Length: 12\r\nX-Custom: v\r\n\r\n{\"model\":1}\nGET"[..],
        );
        let end = find_end(&buf, 0).unwrap();
        let h = parse(&mut buf, end).unwrap();
        assert_eq!(&buf[..], b"{\"model\":1}\nGET");
        assert_eq!(h.request.method(), Method::POST);
        assert_eq!(h.request.uri().path(), "/v1/chat/completions");
        assert_eq!(h.request.uri().query(), Some("x=1"));
        assert_eq!(h.framing, Framing::Length(12));
        assert!(h.keep_alive && !h.expect_continue && !h.last);
        assert_eq!(h.request.headers()["x-custom"], "v");
        // Read for framing (or never forwarded), not kept in the map.
        assert!(!h.request.headers().contains_key("host"));
        assert!(!h.request.headers().contains_key("content-length"));
    }

    #[test]
    fn leaves_framing_and_hop_by_hop_headers_out_of_the_map() {
        let h = head(
            "POST / HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\
             TE: trailers\r\nTrailer: x\r\nUpgrade: h2c\r\nProxy-Authorization: p\r\n\
             Connection: x-hop\r\nX-Hop: 1\r\nKeep-Alive: 5\r\nAuthorization: Bearer k\r\n\
             Content-Type: application/json\r\n\r\n",
        )
        .unwrap();
        assert_eq!(h.framing, Framing::Chunked);
        assert!(h.expect_continue && h.last);
        let kept: Vec<&str> = h.request.headers().keys().map(|k| k.as_str()).collect();
        // `connection` (it names headers the sanitiser removes), the headers it names and the
        // non-standard hop-by-hop ones stay for `headers::sanitize_request`.
        assert_eq!(
            kept,
            [
                "connection",
                "x-hop",
                "keep-alive",
                "authorization",
                "content-type"
            ]
        );
        let mut forwarded = h.request.headers().clone();
        crate::headers::sanitize_request(&mut forwarded);
        let forwarded: Vec<&str> = forwarded.keys().map(|k| k.as_str()).collect();
        assert_eq!(forwarded, ["content-type"]);
    }

    #[test]
    fn framing_and_connection_rules() {
        let h = head("POST / HTTP/1.1\r\ntransfer-encoding: Chunked\r\n\r\n").unwrap();
        assert_eq!(h.framing, Framing::Chunked);
        let h = head("POST / HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\n");
        assert_eq!(h.unwrap().framing, Framing::Length(5));
        assert_eq!(
            head("POST / HTTP/1.1\r\ncontent-length: 5, 5\r\n\r\n").unwrap_err(),
            HeadError::Malformed("invalid Content-Length")
        );
        assert_eq!(
            head("GET / HTTP/1.1\r\ncontent-length: 0\r\n\r\n")
                .unwrap()
                .framing,
            Framing::Empty
        );
        assert!(!head("GET / HTTP/1.0\r\n\r\n").unwrap().keep_alive);
        assert!(
            head("GET / HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
                .unwrap()
                .keep_alive
        );
        assert!(
            !head("GET / HTTP/1.1\r\nconnection: foo, close\r\n\r\n")
                .unwrap()
                .keep_alive
        );
        assert!(
            head("GET / HTTP/1.1\r\nconnection: upgrade\r\nupgrade: x\r\n\r\n")
                .unwrap()
                .last
        );
        assert!(head("CONNECT a:1 HTTP/1.1\r\n\r\n").unwrap().last);
        assert!(
            head("POST / HTTP/1.1\r\nexpect: 100-Continue\r\ncontent-length: 1\r\n\r\n")
                .unwrap()
                .expect_continue
        );
    }

    #[test]
    fn refuses_ambiguous_or_malformed_heads() {
        let refused = [
            (
                "POST / HTTP/1.1\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n",
                HeadError::Conflict,
            ),
            (
                "POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 4\r\n\r\n",
                HeadError::Conflict,
            ),
            (
                "POST / HTTP/1.1\r\ncontent-length: 4\r\ncontent-length: 5\r\n\r\n",
                HeadError::Malformed("conflicting Content-Length values"),
            ),
            (
                "POST / HTTP/1.1\r\ncontent-length: 4, 5\r\n\r\n",
                HeadError::Malformed("invalid Content-Length"),
            ),
            (
                "POST / HTTP/1.1\r\ncontent-length: +4\r\n\r\n",
                HeadError::Malformed("invalid Content-Length"),
            ),
            (
                "POST / HTTP/1.1\r\ncontent-length: 99999999999999999999\r\n\r\n",
                HeadError::Malformed("invalid Content-Length"),
            ),
            ("GET / HTTP/2.0\r\n\r\n", HeadError::Version),
            (
                "GET / HTTP/1.1\r\nx : y\r\n\r\n",
                HeadError::Malformed("invalid header name"),
            ),
            (
                "GET / HTTP/1.1\r\nx: a\0b\r\n\r\n",
                HeadError::Malformed("invalid header value"),
            ),
            (
                "GET / HTTP/1.1\r\nx: a\r\n b\r\n\r\n",
                HeadError::Malformed("invalid header name"),
            ),
            (
                "\x16\x03\x01 junk\r\n\r\n",
                HeadError::Malformed("invalid request line"),
            ),
        ];
        for (text, want) in refused {
            assert_eq!(head(text).unwrap_err(), want, "{text:?}");
        }
        for te in ["chunked, identity", "identity", "gzip, chunked"] {
            let text = format!("POST / HTTP/1.1\r\ntransfer-encoding: {te}\r\n\r\n");
            assert!(matches!(head(&text), Err(HeadError::Malformed(_))), "{te}");
        }
        let text =
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n";
        assert!(matches!(head(text), Err(HeadError::Malformed(_))));
        let many: String = (0..MAX_HEADERS + 1)
            .map(|i| format!("x{i}: v\r\n"))
            .collect();
        let text = format!("GET / HTTP/1.1\r\n{many}\r\n");
        assert_eq!(head(&text).unwrap_err(), HeadError::TooLarge);
    }
}
