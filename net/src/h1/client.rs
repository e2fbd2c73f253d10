//! The client side of HTTP/1.1 on the wire: request heads out, response heads in.
//!
//! [`crate::pool`] drives the exchange; this module only encodes and parses. A response head is
//! parsed in place as request heads are ([`super::head`]): frozen into one `Bytes`, every header
//! value a slice of it. Framing follows RFC 9112 §6.3, strictly: a response with both
//! `Content-Length` and `Transfer-Encoding`, or with conflicting lengths, is refused rather than
//! guessed at (an upstream that frames ambiguously is broken, and guessing is how response
//! splitting starts).

use std::mem::MaybeUninit;

use bytes::BytesMut;
use http::header::{self, HeaderValue};
use http::{HeaderMap, Method, Response, StatusCode, Version};

use super::head::{
    ConnectionTokens, MAX_HEADERS, content_length, header_name, left_out_hop_by_hop,
};

/// How a request body goes on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RequestFraming {
    /// No framing header, no body (a bodiless `GET` and the like).
    None,
    /// `Content-Length`.
    Length(u64),
    /// `Transfer-Encoding: chunked` (the body's size is not known in advance).
    Chunked,
}

impl RequestFraming {
    /// The framing of a body of `exact` size (`None`: unknown) for `method`; `declared` says the
    /// caller's headers had a `Content-Length` (an empty body then still gets `content-length: 0`).
    pub(crate) fn choose(method: &Method, exact: Option<u64>, declared: bool) -> Self {
        match exact {
            Some(0) if !declared && bodiless_by_default(method) => RequestFraming::None,
            Some(n) => RequestFraming::Length(n),
            None => RequestFraming::Chunked,
        }
    }
}

/// Methods whose requests normally carry no body (no `content-length: 0` is sent for them).
fn bodiless_by_default(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE
    )
}

/// Writes the request line and headers of a request into `out`: `target` in origin form,
/// `host` when `headers` has none (and `host` is not empty), the caller's headers except framing ones, then the
/// framing's own header.
pub(crate) fn encode_head(
    out: &mut Vec<u8>,
    method: &Method,
    target: &str,
    host: &str,
    headers: &HeaderMap,
    framing: RequestFraming,
) {
    // One reservation for the whole head (growing by doubling cost several reallocations),
    // and for a body small enough to be copied behind it (`GATHER_MAX`).
    let size: usize = headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    let body = match framing {
        RequestFraming::Length(n) => usize::try_from(n)
            .ok()
            .filter(|&n| n <= super::write::GATHER_MAX)
            .unwrap_or(0),
        _ => 0,
    };
    out.reserve(size + target.len() + host.len() + 96 + body);
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    if !host.is_empty() && !headers.contains_key(header::HOST) {
        out.extend_from_slice(b"host: ");
        out.extend_from_slice(host.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in headers {
        if matches!(*name, header::CONTENT_LENGTH | header::TRANSFER_ENCODING) {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        RequestFraming::None => {}
        RequestFraming::Length(n) => super::write::content_length(out, n),
        RequestFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    out.extend_from_slice(b"\r\n");
}

/// How a response body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ResponseFraming {
    /// No body (`HEAD`, 1xx, 204, 304, `Content-Length: 0`).
    Empty,
    Length(u64),
    Chunked,
    /// Until the upstream closes the connection (no length given): never reusable.
    UntilClose,
}

/// A parsed response head.
#[derive(Debug)]
pub(crate) struct ResponseHead {
    pub(crate) response: Response<()>,
    pub(crate) framing: ResponseFraming,
    /// The upstream allows another request on this connection.
    pub(crate) keep_alive: bool,
}

/// Why a response head was refused (the connection is closed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResponseHeadError {
    #[error("malformed response head from the model instance: {0}")]
    Malformed(&'static str),
    #[error("the model instance framed its response ambiguously: {0}")]
    Framing(&'static str),
}

/// Parses the response head that ends at `len` in `buf` and splits it off the buffer.
/// `head_request`: the request was `HEAD` (the response has no body whatever it says).
pub(crate) fn parse_response(
    buf: &mut BytesMut,
    len: usize,
    head_request: bool,
) -> Result<ResponseHead, ResponseHeadError> {
    use ResponseHeadError::{Framing, Malformed};
    let bytes = buf.split_to(len).freeze();
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    match httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut resp, &bytes, &mut slots)
    {
        Ok(httparse::Status::Complete(n)) if n == len => {}
        Ok(_) => return Err(Malformed("incomplete head")),
        Err(httparse::Error::TooManyHeaders) => return Err(Malformed("too many headers")),
        Err(_) => return Err(Malformed("invalid status line or header")),
    }
    let status = resp
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or(Malformed("invalid status code"))?;
    let version = match resp.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let mut headers = HeaderMap::with_capacity(resp.headers.len());
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut coded = false;
    let mut connection = ConnectionTokens::default();
    for h in resp.headers.iter() {
        let name = header_name(h.name.as_bytes()).map_err(|_| Malformed("invalid header"))?;
        let value = HeaderValue::from_maybe_shared(bytes.slice_ref(h.value))
            .map_err(|_| Malformed("invalid header value"))?;
        // Whether the header goes into the response's map. As for requests (`super::head`),
        // the standard hop-by-hop headers are read here and left out, since no user of this
        // client forwards them (`headers::sanitize_response` would remove them); a
        // `connection` value stays when it names other headers, for the sanitiser.
        // `content-length` stays: the servers answer with the upstream's length.
        let keep = match name {
            header::CONTENT_LENGTH => {
                let n = content_length(value.as_bytes())
                    .map_err(|_| Framing("invalid or conflicting Content-Length"))?;
                if length.is_some_and(|seen| seen != n) {
                    return Err(Framing("conflicting Content-Length values"));
                }
                length = Some(n);
                true
            }
            header::TRANSFER_ENCODING => {
                // The last coding decides: `chunked` delimits the body, anything else leaves
                // it to the close of the connection.
                for coding in value.as_bytes().split(|&b| b == b',') {
                    let coding = coding.trim_ascii();
                    if !coding.is_empty() {
                        coded = true;
                        chunked = coding.eq_ignore_ascii_case(b"chunked");
                    }
                }
                false
            }
            header::CONNECTION => connection.add(value.as_bytes()),
            header::UPGRADE => false,
            _ => !left_out_hop_by_hop(&name),
        };
        if keep {
            headers.append(name, value);
        }
    }
    let bodiless = head_request
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let framing = if bodiless {
        ResponseFraming::Empty
    } else if coded {
        if length.is_some() {
            return Err(Framing("both Content-Length and Transfer-Encoding"));
        }
        if version == Version::HTTP_10 {
            return Err(Framing("Transfer-Encoding in an HTTP/1.0 response"));
        }
        if chunked {
            ResponseFraming::Chunked
        } else {
            ResponseFraming::UntilClose
        }
    } else {
        match length {
            Some(0) => ResponseFraming::Empty,
            Some(n) => ResponseFraming::Length(n),
            None => ResponseFraming::UntilClose,
        }
    };
    let keep_alive = framing != ResponseFraming::UntilClose && connection.persistent(version);
    let mut response = Response::new(());
    *response.status_mut() = status;
    *response.version_mut() = version;
    *response.headers_mut() = headers;
    Ok(ResponseHead {
        response,
        framing,
        keep_alive,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::h1::head::find_end;

    fn parse(text: &str, head_request: bool) -> Result<ResponseHead, ResponseHeadError> {
        let mut buf = BytesMut::from(text);
        let len = find_end(&buf, 0).unwrap();
        parse_response(&mut buf, len, head_request)
    }

    #[test]
    fn encodes_heads_with_host_and_one_framing_header() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("content-length", HeaderValue::from_static("999"));
        headers.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        let mut out = Vec::new();
        encode_head(
            &mut out,
            &Method::POST,
            "/v1/x?a=1",
            "10.0.0.1:8000",
            &headers,
            RequestFraming::Length(5),
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /v1/x?a=1 HTTP/1.1\r\nhost: 10.0.0.1:8000\r\ncontent-type: application/json\r\n\
             content-length: 5\r\n\r\n"
        );
        headers.insert("host", HeaderValue::from_static("given"));
        let mut out = Vec::new();
        encode_head(
            &mut out,
            &Method::GET,
            "/",
            "ignored",
            &headers,
            RequestFraming::None,
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "GET / HTTP/1.1\r\ncontent-type: application/json\r\nhost: given\r\n\r\n"
        );
    }

    #[test]
    fn chooses_request_framing() {
        assert_eq!(
            RequestFraming::choose(&Method::GET, Some(0), false),
            RequestFraming::None
        );
        assert_eq!(
            RequestFraming::choose(&Method::GET, Some(0), true),
            RequestFraming::Length(0)
        );
        assert_eq!(
            RequestFraming::choose(&Method::POST, Some(0), false),
            RequestFraming::Length(0)
        );
        assert_eq!(
            RequestFraming::choose(&Method::POST, None, true),
            RequestFraming::Chunked
        );
    }

    #[test]
    fn parses_framing_and_keep_alive() {
        let h = parse(
            "HTTP/1.1 200 OK\r\ncontent-length: 12\r\nx-a: b\r\n\r\nrest",
            false,
        )
        .unwrap();
        assert_eq!(h.framing, ResponseFraming::Length(12));
        assert!(h.keep_alive);
        assert_eq!(h.response.status(), 200);
        assert_eq!(h.response.headers()["x-a"], "b");

        let h = parse(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!(h.framing, ResponseFraming::Chunked);
        assert!(!h.keep_alive);
        assert!(
            h.response.headers().is_empty(),
            "framing and hop-by-hop are left out"
        );

        let h = parse("HTTP/1.0 200 OK\r\n\r\n", false).unwrap();
        assert_eq!(h.framing, ResponseFraming::UntilClose);
        assert!(!h.keep_alive);
        let h = parse(
            "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 1\r\n\r\n",
            false,
        )
        .unwrap();
        assert!(h.keep_alive);

        let h = parse("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n", false).unwrap();
        assert_eq!(h.framing, ResponseFraming::UntilClose);
        assert!(!h.keep_alive);

        for bodiless in [
            "HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n",
            "HTTP/1.1 304 Not Modified\r\n\r\n",
            "HTTP/1.1 100 Continue\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        ] {
            let h = parse(bodiless, false).unwrap();
            assert_eq!(h.framing, ResponseFraming::Empty, "{bodiless}");
            assert!(h.keep_alive);
        }
        let h = parse("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", true).unwrap();
        assert_eq!(h.framing, ResponseFraming::Empty);
    }

    #[test]
    fn leaves_hop_by_hop_headers_out_of_the_map() {
        let h = parse(
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\
             Connection: keep-alive\r\nConnection: x-hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\n\
             TE: trailers\r\nTrailer: x\r\nUpgrade: h2c\r\nProxy-Authenticate: Basic\r\n\
             Server: engine\r\nDate: Tue, 01 Dec 2026 04:28:50 GMT\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!(h.framing, ResponseFraming::Chunked);
        assert!(h.keep_alive);
        let kept: Vec<(&str, &str)> = h
            .response
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str(), v.to_str().unwrap()))
            .collect();
        // The `connection` value that names another header stays, for the sanitiser.
        assert_eq!(
            kept,
            [
                ("content-type", "text/event-stream"),
                ("connection", "x-hop"),
                ("x-hop", "1"),
                ("keep-alive", "timeout=5"),
                ("server", "engine"),
                ("date", "Tue, 01 Dec 2026 04:28:50 GMT"),
            ]
        );
        let mut forwarded = h.response.headers().clone();
        crate::headers::sanitize_response(&mut forwarded);
        let forwarded: Vec<&str> = forwarded.keys().map(|k| k.as_str()).collect();
        assert_eq!(forwarded, ["content-type", "server", "date"]);
    }

    #[test]
    fn header_lines_are_capped_at_max_headers() {
        let head = |n: usize| {
            let lines: String = (0..n).map(|i| format!("x-{i}: v\r\n")).collect();
            format!("HTTP/1.1 200 OK\r\n{lines}\r\n")
        };
        let h = parse(&head(MAX_HEADERS), false).unwrap();
        assert_eq!(h.response.headers().len(), MAX_HEADERS);
        // What the native server writes for it has more lines (framing, `date`): refused.
        let mut out = Vec::new();
        super::super::write::head(
            &mut out,
            StatusCode::OK,
            h.response.headers(),
            None,
            false,
            false,
            true,
        );
        let text = String::from_utf8(out).unwrap();
        assert!(matches!(
            parse(&text, false),
            Err(ResponseHeadError::Malformed(_))
        ));
        assert!(parse(&head(MAX_HEADERS + 1), false).is_err());
    }

    #[test]
    fn refuses_ambiguous_and_malformed_heads() {
        for bad in [
            "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
            "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        ] {
            assert!(
                matches!(parse(bad, false), Err(ResponseHeadError::Framing(_))),
                "{bad}"
            );
        }
        for bad in [
            "HTTP/1.1 2000 OK\r\n\r\n",
            "HTTP/2 200 OK\r\n\r\n",
            "HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
        ] {
            assert!(
                matches!(parse(bad, false), Err(ResponseHeadError::Malformed(_))),
                "{bad}"
            );
        }
    }
}
