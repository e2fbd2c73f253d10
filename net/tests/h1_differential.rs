//! The native HTTP/1 parsers against hyper, on one corpus of valid and invalid messages.
//!
//! Requests: each case is parsed by the native server's head parser and body decoder
//! (`net::h1::fuzzing`) and sent to a real hyper 1 server on 127.0.0.1 (configured as the
//! gateway's hyper listeners are), whose service echoes what hyper made of it. Responses: each
//! case is parsed by the native upstream client and served raw to a real hyper client. Both
//! sides must accept with the same meaning (request line or status, headers, body bytes) or
//! both refuse, except for the deliberate differences in [`DIFFERENCES`], where the native side
//! refuses what hyper accepts (never the other way round). The same table is in
//! `docs/security.md` (HTTP/1).
//!
//! | key | native parsers | hyper 1.x | why |
//! |---|---|---|---|
//! | `cl-te` | refuse `Content-Length` with `Transfer-Encoding` (400) | frames by `Transfer-Encoding`, drops `Content-Length`, closes after the answer | the classic smuggling vehicle: refused outright, and counted |
//! | `te-codings` | refuse any transfer coding but a single `chunked` | accept codings before a final `chunked` (left to the service) | the gateway decodes no transfer coding; one meaning only |
//! | `te-repeated` | refuse a second `Transfer-Encoding` line | the last line decides | two framing lines are ambiguous to some peer |
//! | `cl-digits` | refuse a `Content-Length` of more than 19 digits | accept any number of leading zeros | a length needs at most 19 digits; longer is padding no client sends |
//! | `expect` | refuse an `Expect` other than `100-continue` (400) | ignore it | RFC 9110 §10.1.1 lets a server refuse an expectation it cannot meet |
//! | `head-size` | a head over `max_header_bytes` (64 KiB) is refused (431) | the same limit bounds its read buffer before each parse, so a head completed by the read that crosses it passes | one exact limit |
//! | `max-headers` | at most 96 header lines (431) | at most 100 | the native head keeps a fixed array of slots |
//! | `chunk-ext-grammar` | chunk extensions by RFC 9112 §7.1.1 (`;` BWS token [BWS `=` BWS token / quoted-string]) | any bytes but LF up to the CR | bytes no grammar allows are where two decoders can disagree |
//! | `chunk-line-length` | a chunk-size line of at most 4 KiB | no per-line cap (16 KiB of extensions per body) | a size line is a few bytes; 4 KiB is already generous |
//! | `trailer-bare-lf` | trailer lines end in CRLF, no bare LF | a bare LF inside the trailer section can pass to `httparse` | a line end one peer sees and another does not |
//! | `trailer-count` | at most 96 trailer lines | at most 100 | the same cap as header lines |

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::convert::Infallible;
use std::fmt::Write as _;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use net::h1::fuzzing::{self, BodyDecoder, BodyFraming, Piece};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Deliberate differences: key, what the native parsers do, what hyper does, why.
const DIFFERENCES: &[(&str, &str, &str, &str)] = &[
    (
        "cl-te",
        "refuse Content-Length with Transfer-Encoding",
        "frame by Transfer-Encoding, drop Content-Length, close after the answer",
        "the classic smuggling vehicle: refused outright, and counted",
    ),
    (
        "te-codings",
        "refuse any transfer coding but a single chunked",
        "accept codings before a final chunked",
        "the gateway decodes no transfer coding",
    ),
    (
        "te-repeated",
        "refuse a second Transfer-Encoding line",
        "the last line decides",
        "two framing lines are ambiguous to some peer",
    ),
    (
        "cl-digits",
        "refuse a Content-Length of more than 19 digits",
        "accept any number of leading zeros",
        "a length needs at most 19 digits",
    ),
    (
        "expect",
        "refuse an Expect other than 100-continue",
        "ignore it",
        "RFC 9110 §10.1.1 lets a server refuse an expectation it cannot meet",
    ),
    (
        "head-size",
        "a head over max_header_bytes (64 KiB) is refused",
        "the limit bounds the read buffer before each parse: a head completed by the read that crosses it passes",
        "one exact limit",
    ),
    (
        "max-headers",
        "at most 96 header lines",
        "at most 100",
        "the native head keeps a fixed array of slots",
    ),
    (
        "chunk-ext-grammar",
        "chunk extensions by the RFC 9112 §7.1.1 grammar",
        "any bytes but LF up to the CR",
        "bytes no grammar allows are where two decoders can disagree",
    ),
    (
        "chunk-line-length",
        "a chunk-size line of at most 4 KiB",
        "no per-line cap (16 KiB of extensions per body)",
        "a size line is a few bytes",
    ),
    (
        "trailer-bare-lf",
        "trailer lines end in CRLF",
        "a bare LF inside the trailer section can pass to httparse",
        "a line end one peer sees and another does not",
    ),
    (
        "trailer-count",
        "at most 96 trailer lines",
        "at most 100",
        "the same cap as header lines",
    ),
];

/// The gateway's default `max_header_bytes`: larger heads get 431 on both listeners.
const MAX_HEAD: usize = 64 * 1024;

/// Headers neither side is compared on: framing and hop-by-hop ones, which the native parsers
/// read and leave out of their maps (and `host`).
const NOT_COMPARED: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "expect",
    "upgrade",
    "te",
    "trailer",
    "proxy-authenticate",
    "proxy-authorization",
];

/// What one side made of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    Accept(Meaning),
    Refuse(String),
}

impl Verdict {
    fn accepted(&self) -> bool {
        matches!(self, Verdict::Accept(_))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Meaning {
    /// `METHOD target version` of a request, the status of a response.
    line: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

fn compared(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .filter(|(n, _)| !NOT_COMPARED.contains(&n.as_str()))
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// A body decoded from all of `rest`; `until_close` bodies end where the input does.
fn decode(framing: BodyFraming, rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut d = BodyDecoder::new(framing);
    let mut buf = BytesMut::from(rest);
    let mut out = Vec::new();
    loop {
        match d.decode(&mut buf).map_err(|e| e.to_string())? {
            Piece::Data(data) => out.extend_from_slice(&data),
            Piece::End => return Ok(out),
            Piece::More if framing == BodyFraming::UntilClose => return Ok(out),
            Piece::More => return Err("incomplete body".into()),
        }
    }
}

fn native_request(input: &[u8]) -> Verdict {
    let head = match fuzzing::request_head(input) {
        None => return Verdict::Refuse("incomplete head".into()),
        Some(Err(refused)) => return Verdict::Refuse(refused.status.to_string()),
        Some(Ok(head)) => head,
    };
    if head.len > MAX_HEAD {
        return Verdict::Refuse("431".into());
    }
    match decode(head.framing, &input[head.len..]) {
        Ok(body) => {
            let r = &head.request;
            Verdict::Accept(Meaning {
                line: format!("{} {} {:?}", r.method(), r.uri(), r.version()),
                headers: compared(r.headers()),
                body,
            })
        }
        Err(e) => Verdict::Refuse(e),
    }
}

fn native_response(input: &[u8], head_request: bool) -> Verdict {
    let head = match fuzzing::response_head(input, head_request) {
        None => return Verdict::Refuse("incomplete head".into()),
        Some(Err(e)) => return Verdict::Refuse(e.to_string()),
        Some(Ok(head)) => head,
    };
    match decode(head.framing, &input[head.len..]) {
        Ok(body) => Verdict::Accept(Meaning {
            line: head.response.status().as_str().to_owned(),
            headers: compared(head.response.headers()),
            body,
        }),
        Err(e) => Verdict::Refuse(e),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unhex(text: &[u8]) -> Vec<u8> {
    text.chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

/// The hyper server's service: what hyper parsed, one header a line (values in hex), a blank
/// line, then the body, all in hex in `x-echo`; a body hyper refused answers 500.
async fn echo(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            let mut r = Response::new(Full::new(Bytes::from(e.to_string())));
            *r.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
            return Ok(r);
        }
    };
    let mut out = format!("{} {} {:?}\n", parts.method, parts.uri, parts.version);
    for (n, v) in compared(&parts.headers) {
        let _ = writeln!(out, "{n}:{}", hex(&v));
    }
    out.push('\n');
    let mut out = out.into_bytes();
    out.extend_from_slice(&body);
    // In a header: hyper sends no body in a 2xx answer to CONNECT.
    let mut r = Response::new(Full::new(Bytes::new()));
    r.headers_mut().insert("x-echo", hex(&out).parse().unwrap());
    Ok(r)
}

/// A hyper 1 HTTP/1 server configured as the gateway's hyper listener (plus half-close, so a
/// request followed by the client's FIN is still answered).
async fn hyper_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .max_buf_size(MAX_HEAD)
                    .keep_alive(true)
                    .half_close(true)
                    .serve_connection(TokioIo::new(stream), hyper::service::service_fn(echo))
                    .await;
            });
        }
    });
    addr
}

/// The first final response in `raw` (1xx skipped): its status and its `x-echo` (else its
/// body).
fn first_response(mut raw: &[u8]) -> Option<(u16, Vec<u8>)> {
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut headers);
        let httparse::Status::Complete(n) = resp.parse(raw).ok()? else {
            return None;
        };
        let code = resp.code?;
        let length = resp
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .map(|h| {
                std::str::from_utf8(h.value)
                    .unwrap()
                    .parse::<usize>()
                    .unwrap()
            });
        let echo = resp
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("x-echo"))
            .map(|h| unhex(h.value));
        raw = &raw[n..];
        if (100..200).contains(&code) {
            continue;
        }
        if let Some(echo) = echo {
            return Some((code, echo));
        }
        let body = match length {
            Some(len) => raw.get(..len)?.to_vec(),
            None => raw.to_vec(),
        };
        return Some((code, body));
    }
}

async fn hyper_request(addr: std::net::SocketAddr, input: &[u8]) -> Verdict {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    // hyper may refuse and close before everything is written.
    let _ = stream.write_all(input).await;
    let _ = stream.shutdown().await;
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    match first_response(&raw) {
        None => Verdict::Refuse("closed without an answer".into()),
        Some((200, echo)) => {
            let split = echo.windows(2).position(|w| w == b"\n\n").unwrap();
            let mut lines = echo[..split].split(|&b| b == b'\n');
            let line = String::from_utf8(lines.next().unwrap().to_vec()).unwrap();
            let headers = lines
                .map(|l| {
                    let colon = l.iter().position(|&b| b == b':').unwrap();
                    (
                        String::from_utf8(l[..colon].to_vec()).unwrap(),
                        unhex(&l[colon + 1..]),
                    )
                })
                .collect();
            Verdict::Accept(Meaning {
                line,
                headers,
                body: echo[split + 2..].to_vec(),
            })
        }
        Some((code, body)) => Verdict::Refuse(format!(
            "{code} {}",
            String::from_utf8_lossy(&body[..body.len().min(80)])
        )),
    }
}

/// Serves `input` raw to a real hyper client sending a `GET` (or `HEAD`).
async fn hyper_response(input: &[u8], head_request: bool) -> Verdict {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let answer = input.to_vec();
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut buf).await.unwrap();
            if n == 0 {
                return;
            }
            seen.extend_from_slice(&buf[..n]);
        }
        let _ = stream.write_all(&answer).await;
        let _ = stream.shutdown().await;
    });
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    let driver = tokio::spawn(conn);
    let method = if head_request {
        http::Method::HEAD
    } else {
        http::Method::GET
    };
    let req = Request::builder()
        .method(method)
        .uri("/")
        .header("host", "upstream")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let verdict = match sender.send_request(req).await {
        Err(e) => Verdict::Refuse(e.to_string()),
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            match body.collect().await {
                Err(e) => Verdict::Refuse(e.to_string()),
                Ok(b) => Verdict::Accept(Meaning {
                    line: parts.status.as_str().to_owned(),
                    headers: compared(&parts.headers),
                    body: b.to_bytes().to_vec(),
                }),
            }
        }
    };
    drop(sender);
    let _ = driver.await;
    server.await.unwrap();
    verdict
}

/// One message of the corpus; `diff` names the deliberate difference it shows, if any.
struct Case {
    name: String,
    input: Vec<u8>,
    diff: Option<&'static str>,
}

fn case(name: &str, input: impl Into<Vec<u8>>, diff: Option<&'static str>) -> Case {
    Case {
        name: name.to_owned(),
        input: input.into(),
        diff,
    }
}

fn request_cases() -> Vec<Case> {
    let same = None;
    let mut c = vec![
        case("get", "GET / HTTP/1.1\r\nhost: x\r\n\r\n", same),
        case(
            "get with headers and query",
            "GET /v1/models?x=1&y HTTP/1.1\r\nHost: gw\r\nAccept: */*\r\nX-A: 1\r\nx-a: 2\r\n\r\n",
            same,
        ),
        case("http/1.0", "GET / HTTP/1.0\r\n\r\n", same),
        case(
            "http/1.0 keep-alive",
            "GET / HTTP/1.0\r\nconnection: keep-alive\r\nkeep-alive: timeout=5\r\n\r\n",
            same,
        ),
        case("no host", "GET / HTTP/1.1\r\n\r\n", same),
        case(
            "two hosts",
            "GET / HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n",
            same,
        ),
        case(
            "post with length",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello",
            same,
        ),
        case(
            "length 0",
            "POST / HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        case(
            "equal lengths on two lines",
            "POST / HTTP/1.1\r\ncontent-length: 3\r\ncontent-length: 3\r\n\r\nabc",
            same,
        ),
        case(
            "different lengths",
            "POST / HTTP/1.1\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
            same,
        ),
        case(
            "length list of equal values",
            "POST / HTTP/1.1\r\ncontent-length: 3, 3\r\n\r\nabc",
            same,
        ),
        case(
            "length list of different values",
            "POST / HTTP/1.1\r\ncontent-length: 3, 4\r\n\r\nabcd",
            same,
        ),
        case(
            "length +",
            "POST / HTTP/1.1\r\ncontent-length: +3\r\n\r\nabc",
            same,
        ),
        case(
            "length -",
            "POST / HTTP/1.1\r\ncontent-length: -3\r\n\r\nabc",
            same,
        ),
        case(
            "length hex",
            "POST / HTTP/1.1\r\ncontent-length: 0x3\r\n\r\nabc",
            same,
        ),
        case(
            "length 1e1",
            "POST / HTTP/1.1\r\ncontent-length: 1e1\r\n\r\nabc",
            same,
        ),
        case(
            "length inner space",
            "POST / HTTP/1.1\r\ncontent-length: 1 2\r\n\r\nabc",
            same,
        ),
        case(
            "length empty",
            "POST / HTTP/1.1\r\ncontent-length:\r\n\r\n",
            same,
        ),
        case(
            "length with surrounding spaces",
            "POST / HTTP/1.1\r\ncontent-length:   3  \r\n\r\nabc",
            same,
        ),
        case(
            "length leading zeros",
            "POST / HTTP/1.1\r\ncontent-length: 003\r\n\r\nabc",
            same,
        ),
        case(
            "length of 20 digits",
            "POST / HTTP/1.1\r\ncontent-length: 00000000000000000003\r\n\r\nabc",
            Some("cl-digits"),
        ),
        case(
            "length overflow",
            "POST / HTTP/1.1\r\ncontent-length: 99999999999999999999\r\n\r\n",
            same,
        ),
        case(
            "length longer than the data",
            "POST / HTTP/1.1\r\ncontent-length: 10\r\n\r\nabc",
            same,
        ),
        case(
            "length shorter than the data",
            "POST / HTTP/1.1\r\ncontent-length: 2\r\n\r\nabc",
            same,
        ),
        case(
            "cl then te",
            "POST / HTTP/1.1\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            Some("cl-te"),
        ),
        case(
            "te then cl",
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            Some("cl-te"),
        ),
        case(
            "cl + te smuggling a request",
            "POST / HTTP/1.1\r\ncontent-length: 30\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n",
            Some("cl-te"),
        ),
        case(
            "cl + bad te",
            "POST / HTTP/1.1\r\ncontent-length: 3\r\ntransfer-encoding: gzip\r\n\r\nabc",
            same,
        ),
        case(
            "te chunked",
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            same,
        ),
        case(
            "te Chunked in capitals",
            "POST / HTTP/1.1\r\nTransfer-Encoding: CHUNKED\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            same,
        ),
        case(
            "te gzip, chunked",
            "POST / HTTP/1.1\r\ntransfer-encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            Some("te-codings"),
        ),
        case(
            "te chunked, gzip",
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked, gzip\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            same,
        ),
        case(
            "te identity",
            "POST / HTTP/1.1\r\ntransfer-encoding: identity\r\n\r\nabc",
            same,
        ),
        case(
            "te xchunked",
            "POST / HTTP/1.1\r\ntransfer-encoding: xchunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            same,
        ),
        case(
            "te chunked then empty coding",
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked,\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            same,
        ),
        case(
            "te chunked on two lines",
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            Some("te-repeated"),
        ),
        case(
            "te gzip then chunked on two lines",
            "POST / HTTP/1.1\r\ntransfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            Some("te-repeated"),
        ),
        case(
            "te in http/1.0",
            "POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            same,
        ),
        case("obs-fold", "GET / HTTP/1.1\r\nx-a: 1\r\n 2\r\n\r\n", same),
        case(
            "obs-fold with a tab",
            "GET / HTTP/1.1\r\nx-a: 1\r\n\t2\r\n\r\n",
            same,
        ),
        case(
            "obs-fold of content-length",
            "POST / HTTP/1.1\r\ncontent-length:\r\n 3\r\n\r\nabc",
            same,
        ),
        case(
            "bare LF line ends",
            "GET / HTTP/1.1\nhost: x\nx-a: 1\n\n",
            same,
        ),
        case(
            "mixed line ends",
            "GET / HTTP/1.1\r\nhost: x\nx-a: 1\r\n\n",
            same,
        ),
        case(
            "bare CR after the request line",
            "GET / HTTP/1.1\rhost: x\r\n\r\n",
            same,
        ),
        case(
            "bare CR in a value",
            "GET / HTTP/1.1\r\nx-a: 1\r2\r\n\r\n",
            same,
        ),
        case(
            "bare CR ending a value",
            "GET / HTTP/1.1\r\nx-a: 1\r\r\n\r\n",
            same,
        ),
        case(
            "CR CR LF ending the head",
            "GET / HTTP/1.1\r\nx-a: 1\r\n\r\r\n",
            same,
        ),
        case(
            "space before the colon",
            "GET / HTTP/1.1\r\nx-a : 1\r\n\r\n",
            same,
        ),
        case(
            "tab before the colon",
            "GET / HTTP/1.1\r\nx-a\t: 1\r\n\r\n",
            same,
        ),
        case(
            "space before the colon of content-length",
            "POST / HTTP/1.1\r\ncontent-length : 3\r\n\r\nabc",
            same,
        ),
        case(
            "space in a header name",
            "GET / HTTP/1.1\r\nx a: 1\r\n\r\n",
            same,
        ),
        case("empty header name", "GET / HTTP/1.1\r\n: 1\r\n\r\n", same),
        case("no colon", "GET / HTTP/1.1\r\nx-a\r\n\r\n", same),
        case(
            "header name with (",
            "GET / HTTP/1.1\r\nx(a: 1\r\n\r\n",
            same,
        ),
        case(
            "header name with @",
            "GET / HTTP/1.1\r\nx@a: 1\r\n\r\n",
            same,
        ),
        case(
            "header name with NUL",
            b"GET / HTTP/1.1\r\nx\0a: 1\r\n\r\n".to_vec(),
            same,
        ),
        case(
            "header name non-ASCII",
            b"GET / HTTP/1.1\r\nx\xc3\xa9: 1\r\n\r\n".to_vec(),
            same,
        ),
        case(
            "header name with all token symbols",
            "GET / HTTP/1.1\r\n!#$%&'*+-.^_`|~09az: 1\r\n\r\n",
            same,
        ),
        case(
            "value with NUL",
            b"GET / HTTP/1.1\r\nx-a: 1\x002\r\n\r\n".to_vec(),
            same,
        ),
        case(
            "value with DEL",
            b"GET / HTTP/1.1\r\nx-a: 1\x7f2\r\n\r\n".to_vec(),
            same,
        ),
        case(
            "value with \\x01",
            b"GET / HTTP/1.1\r\nx-a: 1\x012\r\n\r\n".to_vec(),
            same,
        ),
        case(
            "value with obs-text",
            b"GET / HTTP/1.1\r\nx-a: 1\x80\xff2\r\n\r\n".to_vec(),
            same,
        ),
        case(
            "value with a tab",
            "GET / HTTP/1.1\r\nx-a: 1\t2\r\n\r\n",
            same,
        ),
        case("empty value", "GET / HTTP/1.1\r\nx-a:\r\n\r\n", same),
        case(
            "value of spaces",
            "GET / HTTP/1.1\r\nx-a:    \r\n\r\n",
            same,
        ),
        case(
            "value with trailing spaces",
            "GET / HTTP/1.1\r\nx-a: 1  \r\n\r\n",
            same,
        ),
        case("lowercase method", "get / HTTP/1.1\r\n\r\n", same),
        case("extension method", "PURGE / HTTP/1.1\r\n\r\n", same),
        case("method with (", "GE(T / HTTP/1.1\r\n\r\n", same),
        case(
            "method with NUL",
            b"GE\0T / HTTP/1.1\r\n\r\n".to_vec(),
            same,
        ),
        case("empty method", " / HTTP/1.1\r\n\r\n", same),
        case(
            "two spaces after the method",
            "GET  / HTTP/1.1\r\n\r\n",
            same,
        ),
        case("tab separators", "GET\t/\tHTTP/1.1\r\n\r\n", same),
        case("space in the target", "GET /a b HTTP/1.1\r\n\r\n", same),
        case(
            "non-ASCII target",
            b"GET /\xc3\xa9 HTTP/1.1\r\n\r\n".to_vec(),
            same,
        ),
        case(
            "control byte in the target",
            b"GET /\x01 HTTP/1.1\r\n\r\n".to_vec(),
            same,
        ),
        case("no version", "GET /\r\n\r\n", same),
        case("no target", "GET HTTP/1.1\r\n\r\n", same),
        case("HTTP/1.2", "GET / HTTP/1.2\r\n\r\n", same),
        case("HTTP/2.0", "GET / HTTP/2.0\r\n\r\n", same),
        case("http/1.1 in lowercase", "GET / http/1.1\r\n\r\n", same),
        case(
            "HTTP/1.1 with a trailing space",
            "GET / HTTP/1.1 \r\n\r\n",
            same,
        ),
        case("HTTP/2 preface", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", same),
        case(
            "TLS record",
            b"\x16\x03\x01\x00\x05hello\r\n\r\n".to_vec(),
            same,
        ),
        case(
            "absolute-form",
            "GET http://example.com/v1/models?x=1 HTTP/1.1\r\nhost: example.com\r\n\r\n",
            same,
        ),
        case(
            "absolute-form with port",
            "GET http://h:8080/p HTTP/1.1\r\n\r\n",
            same,
        ),
        case(
            "absolute-form, https",
            "GET https://h/p HTTP/1.1\r\n\r\n",
            same,
        ),
        case(
            "absolute-form, bad port",
            "GET http://h:99999/ HTTP/1.1\r\n\r\n",
            same,
        ),
        case(
            "absolute-form, no authority",
            "GET http:// HTTP/1.1\r\n\r\n",
            same,
        ),
        case("asterisk-form", "OPTIONS * HTTP/1.1\r\n\r\n", same),
        case(
            "authority-form",
            "CONNECT example.com:443 HTTP/1.1\r\n\r\n",
            same,
        ),
        case("target without a slash", "GET v1 HTTP/1.1\r\n\r\n", same),
        case(
            "empty line before the request",
            "\r\nGET / HTTP/1.1\r\n\r\n",
            same,
        ),
        case(
            "expect 100-continue",
            "POST / HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 3\r\n\r\nabc",
            same,
        ),
        case(
            "unknown expectation",
            "POST / HTTP/1.1\r\nexpect: 200-ok\r\ncontent-length: 3\r\n\r\nabc",
            Some("expect"),
        ),
        case(
            "hop-by-hop headers",
            "GET / HTTP/1.1\r\nconnection: x-hop\r\nx-hop: 1\r\nte: trailers\r\nproxy-authorization: p\r\nx-b: 2\r\n\r\n",
            same,
        ),
        case("incomplete head", "GET / HTTP/1.1\r\nhost: x\r\n", same),
        case("only a request line", "GET / HTTP/1.1\r\n", same),
        case("nothing but CRLF", "\r\n\r\n", same),
        case(
            "pipelined second request",
            "GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n",
            same,
        ),
    ];
    let many = |n: usize| -> String {
        let lines: String = (0..n).map(|i| format!("x-{i}: v\r\n")).collect();
        format!("GET / HTTP/1.1\r\n{lines}\r\n")
    };
    c.push(case("95 header lines", many(95), same));
    c.push(case("96 header lines", many(96), same));
    c.push(case("97 header lines", many(97), Some("max-headers")));
    c.push(case("100 header lines", many(100), Some("max-headers")));
    c.push(case("101 header lines", many(101), same));
    c.push(case(
        "8 KiB header value",
        format!("GET / HTTP/1.1\r\nx-a: {}\r\n\r\n", "v".repeat(8192)),
        same,
    ));
    c.push(case(
        "8 KiB target",
        format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(8192)),
        same,
    ));
    c.push(case(
        "70 KiB header value",
        format!("GET / HTTP/1.1\r\nx-a: {}\r\n\r\n", "v".repeat(70 * 1024)),
        Some("head-size"),
    ));
    c.push(case(
        "70 KiB header name",
        format!("GET / HTTP/1.1\r\n{}: 1\r\n\r\n", "n".repeat(70 * 1024)),
        same,
    ));
    for (name, body, diff) in chunked_bodies() {
        let mut input =
            b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
        input.extend_from_slice(&body);
        c.push(case(&format!("request body: {name}"), input, diff));
    }
    c
}

/// Chunked bodies, for requests and responses alike.
fn chunked_bodies() -> Vec<(String, Vec<u8>, Option<&'static str>)> {
    let same = None;
    let ext = Some("chunk-ext-grammar");
    let mut b: Vec<(&str, Vec<u8>, Option<&'static str>)> = vec![
        ("one chunk", b"5\r\nhello\r\n0\r\n\r\n".to_vec(), same),
        ("empty", b"0\r\n\r\n".to_vec(), same),
        (
            "three chunks",
            b"1\r\na\r\n2\r\nbc\r\n3\r\ndef\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "leading zeros",
            b"0005\r\nhello\r\n000\r\n\r\n".to_vec(),
            same,
        ),
        (
            "hex in both cases",
            b"A\r\n0123456789\r\na\r\n0123456789\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "size Ff",
            [
                b"Ff\r\n".to_vec(),
                vec![b'x'; 255],
                b"\r\n0\r\n\r\n".to_vec(),
            ]
            .concat(),
            same,
        ),
        (
            "size overflow",
            b"10000000000000000\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "size f0000000000000003",
            b"f0000000000000003\r\nabc\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        ("size -1", b"-1\r\nx\r\n0\r\n\r\n".to_vec(), same),
        ("size 0x1", b"0x1\r\nx\r\n0\r\n\r\n".to_vec(), same),
        ("size +1", b"+1\r\nx\r\n0\r\n\r\n".to_vec(), same),
        (
            "space before the size",
            b" 1\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        ("no size", b"\r\nx\r\n0\r\n\r\n".to_vec(), same),
        (
            "size then space then digit",
            b"1 1\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "size then space then letter",
            b"1 A\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "spaces after the size",
            b"1   \r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "tab after the size",
            b"1\t\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "bare LF after the size",
            b"1\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "CR CR after the size",
            b"1\r\rx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        ("bare LF after data", b"1\r\nx\n0\r\n\r\n".to_vec(), same),
        ("bare CR after data", b"1\r\nx\r0\r\n\r\n".to_vec(), same),
        ("no CRLF after data", b"1\r\nxy0\r\n\r\n".to_vec(), same),
        ("data shorter than the size", b"5\r\nhel".to_vec(), same),
        ("no last chunk", b"1\r\nx\r\n".to_vec(), same),
        ("no final CRLF", b"1\r\nx\r\n0\r\n".to_vec(), same),
        ("final bare LF", b"1\r\nx\r\n0\r\n\n".to_vec(), same),
        ("final CR only", b"1\r\nx\r\n0\r\n\r".to_vec(), same),
        (
            "last chunk with bare LF",
            b"1\r\nx\r\n0\n\r\n".to_vec(),
            same,
        ),
        (
            "bytes after the body",
            b"1\r\nx\r\n0\r\n\r\nGET / HTTP/1.1\r\n\r\n".to_vec(),
            same,
        ),
        ("ext name", b"1;a\r\nx\r\n0\r\n\r\n".to_vec(), same),
        ("ext token value", b"1;a=b\r\nx\r\n0\r\n\r\n".to_vec(), same),
        (
            "ext quoted value",
            b"1;a=\"b c;d\"\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "ext escaped quote",
            b"1;a=\"b\\\"c\"\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "ext empty quoted",
            b"1;a=\"\"\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "ext several",
            b"1;a;b=c;d=\"e\"\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "ext with BWS",
            b"1 ; a = b ;\tc\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "ext on the last chunk",
            b"1\r\nx\r\n0;done\r\n\r\n".to_vec(),
            same,
        ),
        (
            "ext with bare LF",
            b"1;a\nb\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        (
            "ext with bare CR",
            b"1;a\rb\r\nx\r\n0\r\n\r\n".to_vec(),
            same,
        ),
        ("ext NUL", b"1;\0\r\nx\r\n0\r\n\r\n".to_vec(), ext),
        (
            "ext name with NUL",
            b"1;a\0\r\nx\r\n0\r\n\r\n".to_vec(),
            ext,
        ),
        ("ext only ;", b"1;\r\nx\r\n0\r\n\r\n".to_vec(), ext),
        ("ext ;;", b"1;;\r\nx\r\n0\r\n\r\n".to_vec(), ext),
        ("ext ; then spaces", b"1;  \r\nx\r\n0\r\n\r\n".to_vec(), ext),
        (
            "ext name with a space",
            b"1;a b\r\nx\r\n0\r\n\r\n".to_vec(),
            ext,
        ),
        ("ext empty value", b"1;a=\r\nx\r\n0\r\n\r\n".to_vec(), ext),
        ("ext empty name", b"1;=b\r\nx\r\n0\r\n\r\n".to_vec(), ext),
        (
            "ext value with a space",
            b"1;a=b c\r\nx\r\n0\r\n\r\n".to_vec(),
            ext,
        ),
        (
            "ext unterminated quote",
            b"1;a=\"b\r\nx\r\n0\r\n\r\n".to_vec(),
            ext,
        ),
        (
            "ext text after a quote",
            b"1;a=\"b\"c\r\nx\r\n0\r\n\r\n".to_vec(),
            ext,
        ),
        (
            "ext control byte in a quote",
            b"1;a=\"\x01\"\r\nx\r\n0\r\n\r\n".to_vec(),
            ext,
        ),
        ("ext @ in a name", b"1;a@b\r\nx\r\n0\r\n\r\n".to_vec(), ext),
        ("ext DEL", b"1;a\x7f\r\nx\r\n0\r\n\r\n".to_vec(), ext),
        ("ext without ;", b"1 a\r\nx\r\n0\r\n\r\n".to_vec(), same),
        ("trailer", b"0\r\nx-t: 1\r\n\r\n".to_vec(), same),
        (
            "two trailers",
            b"1\r\nx\r\n0\r\nx-t: 1\r\nx-u: a b\r\n\r\n".to_vec(),
            same,
        ),
        (
            "trailer with an empty value",
            b"0\r\nx-t:\r\n\r\n".to_vec(),
            same,
        ),
        (
            "trailer with obs-text",
            b"0\r\nx-t: \x80\r\n\r\n".to_vec(),
            same,
        ),
        (
            "trailer without a colon",
            b"0\r\nx-t\r\n\r\n".to_vec(),
            same,
        ),
        (
            "trailer space before the colon",
            b"0\r\nx-t : 1\r\n\r\n".to_vec(),
            same,
        ),
        (
            "trailer obs-fold",
            b"0\r\nx-t: 1\r\n 2\r\n\r\n".to_vec(),
            same,
        ),
        ("trailer NUL", b"0\r\nx-t: 1\x002\r\n\r\n".to_vec(), same),
        ("trailer lone CR", b"0\r\nx-t: 1\rx\r\n\r\n".to_vec(), same),
        ("trailer CR CR LF", b"0\r\nx-t: 1\r\r\n\r\n".to_vec(), same),
        (
            "trailers split by a bare LF",
            b"0\r\nx-t: 1\nx-u: 2\r\n\r\n".to_vec(),
            same,
        ),
        (
            "trailer ending in a bare LF",
            b"0\r\nx-t: 1\n\r\n\r\n".to_vec(),
            Some("trailer-bare-lf"),
        ),
        ("trailer never ended", b"0\r\nx-t: 1\r\n".to_vec(), same),
        ("trailer name with @", b"0\r\nx@t: 1\r\n\r\n".to_vec(), same),
    ];
    let line_of = |n: usize| {
        [
            b"1;".to_vec(),
            vec![b'a'; n],
            b"\r\nx\r\n0\r\n\r\n".to_vec(),
        ]
        .concat()
    };
    b.push(("4 KiB chunk-size line", line_of(4092), same));
    b.push((
        "5 KiB chunk-size line",
        line_of(5 * 1024),
        Some("chunk-line-length"),
    ));
    b.push(("17 KiB chunk-size line", line_of(17 * 1024), same));
    let zeros = [vec![b'0'; 5000], b"1\r\nx\r\n0\r\n\r\n".to_vec()].concat();
    b.push(("5000 leading zeros", zeros, Some("chunk-line-length")));
    let spread = [
        format!("1;{}\r\nx\r\n", "e".repeat(2000))
            .repeat(9)
            .into_bytes(),
        b"0\r\n\r\n".to_vec(),
    ]
    .concat();
    b.push(("18 KiB of extensions over 9 chunks", spread, same));
    let trailers = |n: usize| {
        let lines: String = (0..n).map(|i| format!("t{i}: v\r\n")).collect();
        format!("0\r\n{lines}\r\n").into_bytes()
    };
    b.push(("96 trailer lines", trailers(96), same));
    b.push(("97 trailer lines", trailers(97), Some("trailer-count")));
    b.push(("101 trailer lines", trailers(101), same));
    b.into_iter()
        .map(|(n, body, d)| (n.to_owned(), body, d))
        .collect()
}

fn response_cases() -> Vec<(Case, bool)> {
    let same = None;
    let r = |name: &str, input: &str, diff| (case(name, input, diff), false);
    let mut c = vec![
        r(
            "200 with length",
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: 1\r\n\r\nhello",
            same,
        ),
        r(
            "no reason phrase",
            "HTTP/1.1 200 \r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "no space after the code",
            "HTTP/1.1 200\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "reason with spaces",
            "HTTP/1.1 404 Not Found Here\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "http/1.0 until close",
            "HTTP/1.0 200 OK\r\nserver: e\r\n\r\nall of it",
            same,
        ),
        r(
            "http/1.1 until close",
            "HTTP/1.1 200 OK\r\n\r\nall of it",
            same,
        ),
        r(
            "204 with a length",
            "HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n",
            same,
        ),
        r("304", "HTTP/1.1 304 Not Modified\r\netag: x\r\n\r\n", same),
        r(
            "status 999",
            "HTTP/1.1 999 X\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "status 099",
            "HTTP/1.1 099 X\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "status 2000",
            "HTTP/1.1 2000 X\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "status of letters",
            "HTTP/1.1 abc X\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r("HTTP/2", "HTTP/2 200 OK\r\ncontent-length: 0\r\n\r\n", same),
        r(
            "HTTP/1.2",
            "HTTP/1.2 200 OK\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "bare LF line ends",
            "HTTP/1.1 200 OK\ncontent-length: 2\n\nok",
            same,
        ),
        r(
            "cl + te",
            "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            Some("cl-te"),
        ),
        r(
            "te chunked",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            same,
        ),
        r(
            "te gzip",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nzipped",
            same,
        ),
        r(
            "te gzip, chunked",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            same,
        ),
        r(
            "te chunked, gzip",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            same,
        ),
        r(
            "te in http/1.0",
            "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            same,
        ),
        r(
            "length list",
            "HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\n\r\nabc",
            same,
        ),
        r(
            "length list differing",
            "HTTP/1.1 200 OK\r\ncontent-length: 3, 4\r\n\r\nabcd",
            same,
        ),
        r(
            "lengths differing on two lines",
            "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
            same,
        ),
        r(
            "length +",
            "HTTP/1.1 200 OK\r\ncontent-length: +3\r\n\r\nabc",
            same,
        ),
        r(
            "length hex",
            "HTTP/1.1 200 OK\r\ncontent-length: 0x3\r\n\r\nabc",
            same,
        ),
        r(
            "length empty",
            "HTTP/1.1 200 OK\r\ncontent-length:\r\n\r\nabc",
            same,
        ),
        r(
            "length with spaces",
            "HTTP/1.1 200 OK\r\ncontent-length:  3 \r\n\r\nabc",
            same,
        ),
        r(
            "length shorter than the data",
            "HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabcdef",
            same,
        ),
        r(
            "length longer than the data",
            "HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nabc",
            same,
        ),
        r(
            "obs-fold",
            "HTTP/1.1 200 OK\r\nx-a: 1\r\n 2\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "space before the colon",
            "HTTP/1.1 200 OK\r\nx-a : 1\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "NUL in a value",
            "HTTP/1.1 200 OK\r\nx-a: 1\x002\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "bare CR in a value",
            "HTTP/1.1 200 OK\r\nx-a: 1\r2\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "header name with (",
            "HTTP/1.1 200 OK\r\nx(a: 1\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
        r(
            "incomplete head",
            "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n",
            same,
        ),
        r(
            "hop-by-hop headers",
            "HTTP/1.1 200 OK\r\nconnection: x-hop\r\nx-hop: 1\r\nkeep-alive: timeout=5\r\nproxy-authenticate: B\r\ncontent-length: 0\r\n\r\n",
            same,
        ),
    ];
    c.push((
        case(
            "HEAD answered with a length",
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
            same,
        ),
        true,
    ));
    c.push((
        case(
            "HEAD answered chunked",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            same,
        ),
        true,
    ));
    let many = |n: usize| -> String {
        let lines: String = (0..n).map(|i| format!("x-{i}: v\r\n")).collect();
        format!("HTTP/1.1 200 OK\r\n{lines}content-length: 0\r\n\r\n")
    };
    c.push((case("96 header lines", many(95), same), false));
    c.push((
        case("97 header lines", many(96), Some("max-headers")),
        false,
    ));
    c.push((case("101 header lines", many(100), same), false));
    for (name, body, diff) in chunked_bodies() {
        let mut input = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
        input.extend_from_slice(&body);
        c.push((case(&format!("response body: {name}"), input, diff), false));
    }
    c
}

/// Both accept with the same meaning, or both refuse (for whatever reason).
fn agree(a: &Verdict, b: &Verdict) -> bool {
    match (a, b) {
        (Verdict::Accept(x), Verdict::Accept(y)) => x == y,
        (Verdict::Refuse(_), Verdict::Refuse(_)) => true,
        _ => false,
    }
}

/// Checks one case; returns a line describing a mismatch.
fn judge(case: &Case, native: &Verdict, hyper: &Verdict) -> Option<String> {
    let short = |v: &Verdict| {
        let text = format!("{v:?}");
        text.chars().take(300).collect::<String>()
    };
    let show = || {
        format!(
            "{}: {:?}\n    native: {}\n    hyper:  {}",
            case.name,
            String::from_utf8_lossy(&case.input[..case.input.len().min(160)]),
            short(native),
            short(hyper)
        )
    };
    match case.diff {
        None if agree(native, hyper) => None,
        None => Some(format!("differ: {}", show())),
        Some(key) => {
            assert!(
                DIFFERENCES.iter().any(|d| d.0 == key),
                "{key} is not in the table"
            );
            (native.accepted() || !hyper.accepted())
                .then(|| format!("listed as `{key}` but not a difference: {}", show()))
        }
    }
}

fn check_table_is_used(keys: &[Option<&'static str>]) {
    for (key, ..) in DIFFERENCES {
        assert!(
            keys.contains(&Some(key)),
            "no case shows the difference `{key}`"
        );
    }
}

#[tokio::test]
async fn request_heads_and_bodies_agree_with_a_hyper_server() {
    let addr = hyper_server().await;
    let cases = request_cases();
    assert!(cases.len() >= 150, "{}", cases.len());
    let mut mismatches = Vec::new();
    let (mut accepted, mut refused) = (0, 0);
    for case in &cases {
        let native = native_request(&case.input);
        let hyper = hyper_request(addr, &case.input).await;
        if native.accepted() {
            accepted += 1;
        } else {
            refused += 1;
        }
        mismatches.extend(judge(case, &native, &hyper));
    }
    assert!(accepted > 40 && refused > 40, "{accepted} {refused}");
    println!(
        "{} request cases: {accepted} accepted, {refused} refused",
        cases.len()
    );
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

#[tokio::test]
async fn response_heads_and_bodies_agree_with_a_hyper_client() {
    let cases = response_cases();
    assert!(cases.len() >= 100, "{}", cases.len());
    let mut mismatches = Vec::new();
    for (case, head_request) in &cases {
        let native = native_response(&case.input, *head_request);
        let hyper = hyper_response(&case.input, *head_request).await;
        mismatches.extend(judge(case, &native, &hyper));
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    println!("{} response cases", cases.len());
}

#[test]
fn every_listed_difference_is_shown_by_a_case() {
    let mut keys: Vec<_> = request_cases().iter().map(|c| c.diff).collect();
    keys.extend(response_cases().iter().map(|(c, _)| c.diff));
    check_table_is_used(&keys);
}

/// Why `framing::H1Guard` exists: hyper 1 alone accepts a request with both `Content-Length`
/// and `Transfer-Encoding`, in either order. It frames the body by `Transfer-Encoding`, hides
/// `Content-Length` from the service and closes the connection after the answer, so a request
/// smuggled behind the body is never answered, but the service cannot refuse the conflict.
#[tokio::test]
async fn hyper_alone_frames_cl_te_by_transfer_encoding_and_closes() {
    let addr = hyper_server().await;
    for head in [
        "content-length: 30\r\ntransfer-encoding: chunked",
        "transfer-encoding: chunked\r\ncontent-length: 30",
        "content-length: 30\r\ntransfer-encoding: gzip, chunked",
    ] {
        let input = format!(
            "POST / HTTP/1.1\r\nhost: x\r\n{head}\r\n\r\n3\r\nabc\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n"
        );
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(input.as_bytes()).await.unwrap();
        // No FIN from this side: the end of the stream is hyper closing.
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        let (status, echo) = first_response(&raw).unwrap();
        assert_eq!(status, 200, "{head}");
        assert!(
            echo.ends_with(b"\n\nabc"),
            "{head}: framed by Transfer-Encoding"
        );
        let text = String::from_utf8_lossy(&raw);
        assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "{head}: one answer");
        assert!(text.contains("connection: close"), "{head}: {text}");
        assert!(!native_request(input.as_bytes()).accepted());
    }
}
