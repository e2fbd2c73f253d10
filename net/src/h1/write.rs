//! Response heads and body framing on the wire.

use std::cell::RefCell;
use std::time::{SystemTime, UNIX_EPOCH};

use http::{HeaderMap, StatusCode, header};

use super::head::decimal;

/// Largest write whose parts (a head, a piece of body, its chunk framing) are copied into one
/// buffer and sent with one `send(2)` rather than handed to `writev(2)` as they lie. The
/// kernel's `writev` path (the iovec import, the VFS layer) costs more per call than `send`:
/// about 350 ns of a 4.7 µs write of 480 bytes on loopback here, many times what the copy
/// costs, and a proxied request makes two such writes (to the upstream, to the client).
/// Larger parts go out vectored, uncopied.
pub(crate) const GATHER_MAX: usize = 4096;

/// The one part of `parts` that is not empty, if exactly one is: it goes out with a plain
/// write (`send`), where several go out vectored.
pub(crate) fn lone<'a>(parts: &[&'a [u8]]) -> Option<&'a [u8]> {
    let mut live = parts.iter().filter(|p| !p.is_empty());
    match (live.next(), live.next()) {
        (Some(one), None) => Some(one),
        _ => None,
    }
}

/// How a response body goes on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Out {
    /// No body bytes at all (`HEAD`, 1xx, 204, 304).
    None,
    /// Exactly this many bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the connection closes (HTTP/1.0 client, unknown length).
    UntilClose,
}

/// Writes the status line and headers of a response into `out`, choosing the body framing:
/// the handler's `Content-Length` if it set one, else the body's exact size, else chunked (or
/// until-close for HTTP/1.0 clients). Hop-by-hop headers of the handler are not written; the
/// connection's own `connection` header is.
pub(crate) fn head(
    out: &mut Vec<u8>,
    status: StatusCode,
    headers: &HeaderMap,
    exact: Option<u64>,
    bodiless: bool,
    http10: bool,
    keep_alive: bool,
) -> Out {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut declared = None;
    let mut dated = false;
    for (name, value) in headers {
        match *name {
            header::CONNECTION | header::TRANSFER_ENCODING => continue,
            header::CONTENT_LENGTH => {
                declared = decimal(value.as_bytes().trim_ascii());
                if declared.is_none() {
                    continue;
                }
            }
            header::DATE => dated = true,
            _ => {}
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let no_body = bodiless || status.is_informational() || status == StatusCode::NO_CONTENT;
    let framing = if no_body || status == StatusCode::NOT_MODIFIED {
        Out::None
    } else if let Some(n) = declared {
        Out::Length(n)
    } else if let Some(n) = exact {
        content_length(out, n);
        Out::Length(n)
    } else if http10 {
        Out::UntilClose
    } else {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        Out::Chunked
    };
    if !dated {
        out.extend_from_slice(b"date: ");
        date(out);
        out.extend_from_slice(b"\r\n");
    }
    if !keep_alive || framing == Out::UntilClose {
        out.extend_from_slice(b"connection: close\r\n");
    } else if http10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
    framing
}

/// The chunk-size line of a chunk of `len` bytes.
pub(crate) fn chunk_size(out: &mut Vec<u8>, len: usize) {
    push_digits(out, len as u64, 16);
    out.extend_from_slice(b"\r\n");
}

/// `content-length: <n>` and its line end.
pub(crate) fn content_length(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(b"content-length: ");
    push_digits(out, n, 10);
    out.extend_from_slice(b"\r\n");
}

/// Appends `n` in `radix` (10 or 16, lowercase), without the formatting machinery.
fn push_digits(out: &mut Vec<u8>, n: u64, radix: u64) {
    let mut buf = [0u8; 20];
    out.extend_from_slice(digits(n, radix, &mut buf));
}

/// `n` in `radix` (10 or 16, lowercase) written at the end of `buf`: the digits (ASCII).
pub fn digits(mut n: u64, radix: u64, buf: &mut [u8; 20]) -> &[u8] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = DIGITS[(n % radix) as usize];
        n /= radix;
        if n == 0 {
            break;
        }
    }
    &buf[at..]
}

/// The last chunk and an empty trailer section.
pub(crate) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Appends the current `Date` value (IMF-fixdate), formatted once per second per thread.
fn date(out: &mut Vec<u8>) {
    thread_local! {
        static CACHED: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHED.with_borrow_mut(|(at, text)| {
        if *at != secs {
            *text = httpdate::fmt_http_date(now);
            *at = secs;
        }
        out.extend_from_slice(text.as_bytes());
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use http::HeaderValue;

    fn text(out: &[u8]) -> String {
        String::from_utf8(out.to_vec()).unwrap()
    }

    #[test]
    fn a_lone_part_is_the_only_one_not_empty() {
        assert_eq!(lone(&[b"head", b"", b""]), Some(&b"head"[..]));
        assert_eq!(lone(&[b"", b"body", b""]), Some(&b"body"[..]));
        assert_eq!(lone(&[b"", b"", b"\r\n"]), Some(&b"\r\n"[..]));
        assert_eq!(lone(&[b"head", b"body", b""]), None);
        assert_eq!(lone(&[b"", b"body", b"\r\n"]), None);
        assert_eq!(lone(&[b"", b"", b""]), None);
    }

    #[test]
    fn declared_lengths_are_plain_decimal() {
        assert_eq!(decimal(b"0"), Some(0));
        assert_eq!(decimal(b"305"), Some(305));
        assert_eq!(
            decimal(b"9999999999999999999"),
            Some(9_999_999_999_999_999_999)
        );
        for bad in [
            &b""[..],
            b"+5",
            b"-1",
            b"5 5",
            b"5,5",
            b"0x10",
            b"99999999999999999999",
        ] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
        // A handler's unusable length is dropped and the body's size decides.
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_LENGTH,
            http::HeaderValue::from_static("5, 5"),
        );
        h.insert(
            header::DATE,
            http::HeaderValue::from_static("Mon, 30 Nov 2026 00:00:00 GMT"),
        );
        let mut out = Vec::new();
        assert_eq!(
            head(&mut out, StatusCode::OK, &h, Some(3), false, false, true),
            Out::Length(3)
        );
        let t = text(&out);
        assert!(
            t.contains("content-length: 3\r\n") && !t.contains("5, 5"),
            "{t}"
        );
        assert_eq!(
            t.matches("date: ").count(),
            1,
            "the handler's date only: {t}"
        );
    }

    #[test]
    fn numbers_are_written_in_decimal_and_hex() {
        let mut out = Vec::new();
        for n in [0u64, 9, 10, 255, 4096, u64::MAX] {
            out.clear();
            content_length(&mut out, n);
            assert_eq!(text(&out), format!("content-length: {n}\r\n"));
            out.clear();
            chunk_size(&mut out, n as usize);
            assert_eq!(text(&out), format!("{n:x}\r\n"));
        }
    }

    #[test]
    fn framing_follows_the_handler_then_the_body() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        h.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("gzip"));
        let mut out = Vec::new();
        assert_eq!(
            head(&mut out, StatusCode::OK, &h, None, false, false, true),
            Out::Chunked
        );
        let t = text(&out);
        assert!(
            t.starts_with("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"),
            "{t}"
        );
        assert!(
            t.contains("transfer-encoding: chunked\r\n") && !t.contains("gzip"),
            "{t}"
        );
        assert!(
            t.contains("\r\ndate: ") && t.ends_with("\r\n\r\n") && !t.contains("connection"),
            "{t}"
        );

        let mut out = Vec::new();
        assert_eq!(
            head(
                &mut out,
                StatusCode::NOT_FOUND,
                &HeaderMap::new(),
                Some(7),
                false,
                false,
                false
            ),
            Out::Length(7)
        );
        let t = text(&out);
        assert!(
            t.contains("content-length: 7\r\n") && t.contains("connection: close\r\n"),
            "{t}"
        );

        let mut declared = HeaderMap::new();
        declared.insert(header::CONTENT_LENGTH, HeaderValue::from_static("12"));
        let mut out = Vec::new();
        assert_eq!(
            head(&mut out, StatusCode::OK, &declared, None, true, false, true),
            Out::None
        );
        assert!(text(&out).contains("content-length: 12\r\n"));

        let mut out = Vec::new();
        assert_eq!(
            head(
                &mut out,
                StatusCode::OK,
                &HeaderMap::new(),
                None,
                false,
                true,
                true
            ),
            Out::UntilClose
        );
        assert!(text(&out).contains("connection: close\r\n"));
        let mut out = Vec::new();
        assert_eq!(
            head(
                &mut out,
                StatusCode::NO_CONTENT,
                &HeaderMap::new(),
                None,
                false,
                false,
                true
            ),
            Out::None
        );
        let mut out = Vec::new();
        chunk_size(&mut out, 255);
        assert_eq!(out, b"ff\r\n");
    }
}
