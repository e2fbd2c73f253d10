//! The proxy port's instance relay: `CONNECT model-<m>-<i>.static:0` reaches the instance on its
//! worker over the worker's tunnel, bytes exactly (half-close included), refuses what is not a
//! relay to a hosted instance, and cancels the engine's work when the client leaves. The
//! worker side is a real worker proxy; the gateway's use of the relay is in
//! `faden/tests/tunnel_relay.rs`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

// The tunnel crate's harness (server, workers, proxy port), and a worker proxy behind it.
mod behind_tunnel;
#[path = "../../tunnel/tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::time::Duration;

use behind_tunnel::*;
use common::*;
use mock_engine::MockEngineConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn connect(target: &str, auth: &str) -> String {
    format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n")
}

/// A connection to the proxy port relayed to [`INSTANCE`] (`CONNECT` answered 200).
async fn relayed(proxy: SocketAddr) -> TcpStream {
    let mut c = TcpStream::connect(proxy).await.unwrap();
    let target = format!("model-{MODEL_ID}-{INSTANCE}.static:0");
    let key = format!("Proxy-Authorization: Bearer {KEY}\r\n");
    c.write_all(connect(&target, &key).as_bytes())
        .await
        .unwrap();
    let head = read_answer(&mut c).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    c
}

/// A fake engine for one connection: reads until the client's FIN, reports what it read, then
/// writes `answer` in three pieces 50 ms apart and closes.
async fn scripted_engine(answer: &'static [u8]) -> (u16, tokio::sync::oneshot::Receiver<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        let _ = tx.send(got);
        let third = answer.len() / 3;
        for piece in [
            &answer[..third],
            &answer[third..2 * third],
            &answer[2 * third..],
        ] {
            s.write_all(piece).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        s.shutdown().await.unwrap();
    });
    (port, rx)
}

#[tokio::test]
async fn relays_bytes_exactly_with_half_close() {
    const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: {\"a\":1}\n\n\x00\xff binary too\r\ndata: [DONE]\n\n";
    let (_engine, proxy) = engine_and_proxy(MockEngineConfig::default()).await;
    let (port, seen) = scripted_engine(ANSWER).await;
    proxy.instances().insert(INSTANCE, port);
    let s = ProxySetup::start(serve_on_streams(proxy)).await;

    let mut c = relayed(s.proxy).await;
    // Our FIN reaches the engine (it answers only after it), its FIN reaches us as EOF.
    let sent = b"GET /anything HTTP/1.1\r\n\r\n\x00\x01\x02";
    c.write_all(sent).await.unwrap();
    c.shutdown().await.unwrap();
    let mut back = Vec::new();
    tokio::time::timeout(T, c.read_to_end(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, ANSWER);
    assert_eq!(tokio::time::timeout(T, seen).await.unwrap().unwrap(), sent);
    s.stop().await;
}

#[tokio::test]
async fn refuses_bad_instance_relays() {
    let (engine, handler) = worker_proxy(MockEngineConfig::default()).await;
    let s = ProxySetup::start(handler).await;
    let key = format!("Proxy-Authorization: Bearer {KEY}\r\n");
    let (status, text) = raw(s.proxy, &connect("model-1-7.static:0", "")).await;
    assert_eq!(status, 407, "{text}");
    let (status, text) = raw(
        s.proxy,
        &connect(
            "model-1-7.static:0",
            "Proxy-Authorization: Bearer guess\r\n",
        ),
    )
    .await;
    assert_eq!(status, 407, "{text}");
    // Its worker has no tunnel.
    let (status, text) = raw(s.proxy, &connect("model-1-8.static:0", &key)).await;
    assert_eq!(status, 502, "{text}");
    assert!(text.contains("tunnel_unavailable"));
    // Unknown to the proxy port.
    let (status, _) = raw(s.proxy, &connect("model-1-9.static:0", &key)).await;
    assert_eq!(status, 404);
    // Known, but its worker does not host it: the worker's marked 404 comes back.
    let (status, text) = raw(s.proxy, &connect("model-1-10.static:0", &key)).await;
    assert_eq!(status, 404, "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("x-faden-no-such-instance: 1")
    );
    // Any other port is an ordinary CONNECT target, and not a connected worker.
    let (status, _) = raw(s.proxy, &connect("model-1-7.static:80", &key)).await;
    assert_eq!(status, 403);
    assert_eq!(engine.stats.connections(), 0);
    s.stop().await;
}

#[tokio::test]
async fn a_client_leaving_a_relayed_stream_cancels_the_engine_work() {
    let (engine, handler) = worker_proxy(timed(200, 50)).await;
    let s = ProxySetup::start(handler).await;
    let mut c = relayed(s.proxy).await;
    let body = r#"{"model":"mock-model","prompt":"hi","stream":true}"#;
    c.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !got.windows(6).any(|w| w == b"data: ") {
        let n = tokio::time::timeout(T, c.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    // Gone mid-stream: the stream would take 10 s more.
    drop(c);
    tokio::time::timeout(T, engine.stats.wait_disconnects(1))
        .await
        .expect("the engine did not see the disconnect");
    s.stop().await;
}
