//! The gateway's native HTTP/1.1 server (`net::h1`): keep-alive, pipelining,
//! `Expect: 100-continue`, HTTP/1.0, `HEAD`, chunked request bodies, byte-at-a-time heads,
//! head deadlines between requests, and HTTP/2 prior knowledge still reaching hyper.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use gateway::GatewayConfig;
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

async fn setup() -> (MockEngineHandle, Harness) {
    let e = MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap();
    let config = GatewayConfig {
        listener: gateway::ListenerConfig {
            header_read_timeout: Duration::from_millis(800),
            ..Default::default()
        },
        ..Default::default()
    };
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;
    (e, h)
}

fn chat_request(h: &Harness, extra: &str) -> String {
    let body = format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{body}",
        h.bearer(),
        body.len()
    )
}

/// Reads one response (head, and a `content-length` or chunked body) from `s`.
async fn read_response(s: &mut TcpStream, pending: &mut Vec<u8>) -> (u16, String, Vec<u8>) {
    tokio::time::timeout(T, async {
        loop {
            if let Some(end) = find(pending, b"\r\n\r\n") {
                let head = String::from_utf8(pending[..end + 4].to_vec()).unwrap();
                let status: u16 = head[9..12].parse().unwrap();
                let lower = head.to_ascii_lowercase();
                let mut rest = pending[end + 4..].to_vec();
                let body = if let Some(n) = header_value(&lower, "content-length") {
                    let n: usize = n.parse().unwrap();
                    while rest.len() < n {
                        fill(s, &mut rest).await;
                    }
                    let body = rest[..n].to_vec();
                    rest.drain(..n);
                    body
                } else if header_value(&lower, "transfer-encoding") == Some("chunked") {
                    let mut body = Vec::new();
                    loop {
                        while find(&rest, b"\r\n").is_none() {
                            fill(s, &mut rest).await;
                        }
                        let line_end = find(&rest, b"\r\n").unwrap();
                        let size = usize::from_str_radix(
                            std::str::from_utf8(&rest[..line_end]).unwrap(),
                            16,
                        )
                        .unwrap();
                        while rest.len() < line_end + 2 + size + 2 {
                            fill(s, &mut rest).await;
                        }
                        body.extend_from_slice(&rest[line_end + 2..line_end + 2 + size]);
                        rest.drain(..line_end + 2 + size + 2);
                        if size == 0 {
                            break;
                        }
                    }
                    body
                } else {
                    Vec::new()
                };
                *pending = rest;
                return (status, head, body);
            }
            fill(s, pending).await;
        }
    })
    .await
    .expect("a response in time")
}

async fn fill(s: &mut TcpStream, buf: &mut Vec<u8>) {
    let mut chunk = [0u8; 4096];
    let n = s.read(&mut chunk).await.unwrap();
    assert!(
        n > 0,
        "connection closed early: {}",
        String::from_utf8_lossy(buf)
    );
    buf.extend_from_slice(&chunk[..n]);
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn header_value<'a>(lower_head: &'a str, name: &str) -> Option<&'a str> {
    lower_head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == name).then(|| v.trim())
    })
}

/// Whether the server closed `s` within `within`.
/// Whether the server closes `s` within [`T`] (its default head deadline is 30 s).
async fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    matches!(
        tokio::time::timeout(T, s.read(&mut b)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// Whether `s` is still open at `deadline`. Past the deadline already (a slow run), it says yes
/// without looking: a deadline set before the request was sent then proves nothing, but never
/// fails.
async fn open_until(s: &mut TcpStream, deadline: Instant) -> bool {
    if Instant::now() >= deadline {
        return true;
    }
    let mut b = [0u8; 64];
    !matches!(
        tokio::time::timeout_at(deadline, s.read(&mut b)).await,
        Ok(Ok(0) | Err(_))
    )
}

#[tokio::test]
async fn keep_alive_and_pipelined_requests_are_answered_in_order() {
    let (e, h) = setup().await;
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let mut pending = Vec::new();
    // Three requests in one write: a chat completion, a models listing, a chat completion.
    let models = format!(
        "GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\n\r\n",
        h.bearer()
    );
    let all = format!("{}{models}{}", chat_request(&h, ""), chat_request(&h, ""));
    s.write_all(all.as_bytes()).await.unwrap();
    let (a, head_a, body_a) = read_response(&mut s, &mut pending).await;
    let (b, _, body_b) = read_response(&mut s, &mut pending).await;
    let (c, _, body_c) = read_response(&mut s, &mut pending).await;
    assert_eq!((a, b, c), (200, 200, 200), "{head_a}");
    assert!(
        head_a.to_ascii_lowercase().contains("\r\ndate: "),
        "{head_a}"
    );
    let a: serde_json::Value = serde_json::from_slice(&body_a).unwrap();
    let b: serde_json::Value = serde_json::from_slice(&body_b).unwrap();
    let c: serde_json::Value = serde_json::from_slice(&body_c).unwrap();
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(b["object"], "list");
    assert_eq!(c["object"], "chat.completion");
    // The connection is still usable afterwards.
    s.write_all(chat_request(&h, "").as_bytes()).await.unwrap();
    assert_eq!(read_response(&mut s, &mut pending).await.0, 200);
    assert_eq!(e.stats.requests(), 3);
    h.stop().await;
}

#[tokio::test]
async fn expect_continue_gets_100_before_the_body_is_sent() {
    let (_e, h) = setup().await;
    let body = format!(r#"{{"model":"{MODEL}","messages":[]}}"#);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n",
        h.bearer(),
        body.len()
    );
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    while find(&got, b"\r\n\r\n").is_none() {
        fill(&mut s, &mut got).await;
    }
    assert!(
        got.starts_with(b"HTTP/1.1 100 Continue\r\n\r\n"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    got.drain(..25);
    s.write_all(body.as_bytes()).await.unwrap();
    let (status, _, _) = read_response(&mut s, &mut got).await;
    assert_eq!(status, 200);

    // Refused before the body is read (bad key): the answer comes without 100 Continue, and
    // the connection ends (the unread body cannot be framed away).
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer nope\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let out = raw(h.addr, head.as_bytes()).await;
    assert!(out.starts_with("HTTP/1.1 401"), "{out}");
    h.stop().await;
}

#[tokio::test]
async fn chunked_request_bodies_and_byte_at_a_time_heads() {
    let (e, h) = setup().await;
    let body = format!(r#"{{"model":"{MODEL}","messages":[]}}"#);
    let (first, second) = body.split_at(10);
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ntransfer-encoding: chunked\r\n\r\n{:x};ext=1\r\n{first}\r\n{:x}\r\n{second}\r\n0\r\ntrailer: t\r\n\r\n",
        h.bearer(),
        first.len(),
        second.len()
    );
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    for byte in req.as_bytes() {
        s.write_all(&[*byte]).await.unwrap();
    }
    let mut pending = Vec::new();
    let (status, head, body) = read_response(&mut s, &mut pending).await;
    assert_eq!(status, 200, "{head}");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(e.stats.requests(), 1);

    // A malformed chunked body: 400, connection closed, nothing forwarded.
    let bad = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{body}\r\n0\r\n\r\n",
        h.bearer(),
        body = String::from_utf8_lossy(&body)
    );
    let out = raw(h.addr, bad.as_bytes()).await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    assert_eq!(e.stats.requests(), 1);
    h.stop().await;
}

#[tokio::test]
async fn http10_head_and_connection_close() {
    let (_e, h) = setup().await;
    let auth = h.bearer();
    // HTTP/1.0 without keep-alive: answered, then closed.
    let out = raw(
        h.addr,
        format!("GET /v1/models HTTP/1.0\r\nauthorization: {auth}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(
        out.to_ascii_lowercase().contains("connection: close"),
        "{out}"
    );

    // HTTP/1.0 with keep-alive and a known length: kept open (the idle limit is 800 ms from
    // the answer, which comes after `sent`).
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let sent = Instant::now();
    s.write_all(
        format!(
            "GET /v1/models HTTP/1.0\r\nconnection: keep-alive\r\nauthorization: {auth}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut pending = Vec::new();
    let (status, head, _) = read_response(&mut s, &mut pending).await;
    assert_eq!(status, 200);
    assert!(
        head.to_ascii_lowercase().contains("connection: keep-alive"),
        "{head}"
    );
    assert!(open_until(&mut s, sent + Duration::from_millis(200)).await);

    // HEAD: the head only, then the connection carries on.
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    s.write_all(b"HEAD /healthz HTTP/1.1\r\nhost: x\r\n\r\nGET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut all = Vec::new();
    let _ = tokio::time::timeout(T, s.read_to_end(&mut all)).await;
    let all = String::from_utf8(all).unwrap();
    assert_eq!(all.matches("HTTP/1.1 200").count(), 2, "{all}");
    let second = all.rfind("HTTP/1.1 200").unwrap();
    let first_head_end = all.find("\r\n\r\n").unwrap() + 4;
    assert_eq!(first_head_end, second, "HEAD answer has no body: {all}");
    h.stop().await;
}

#[tokio::test]
async fn idle_keep_alive_connections_close_at_the_header_timeout() {
    let (_e, h) = setup().await;
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let sent = Instant::now();
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut pending = Vec::new();
    assert_eq!(read_response(&mut s, &mut pending).await.0, 200);
    // Still open well before the 800 ms limit, closed after it.
    assert!(open_until(&mut s, sent + Duration::from_millis(300)).await);
    assert!(closed(&mut s).await);

    // The limit runs from the last answer: a request 500 ms in keeps the connection open
    // past 800 ms from the first (the connection's timer, set for the first wait, moves).
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let mut pending = Vec::new();
    let first = Instant::now();
    for pause in [0, 500] {
        tokio::time::sleep(Duration::from_millis(pause)).await;
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(read_response(&mut s, &mut pending).await.0, 200);
    }
    assert!(open_until(&mut s, first + Duration::from_millis(1000)).await);
    assert!(closed(&mut s).await);

    // A head that starts but never ends is closed too.
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    assert!(closed(&mut s).await);
    h.stop().await;
}

#[tokio::test]
async fn http2_prior_knowledge_still_served() {
    let (_e, h) = setup().await;
    let resp = send_h2(h.addr, h.chat(false)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
    h.stop().await;
}
