//! The `/connect` handshake: who is refused and how, limits on pending handshakes, and one
//! tunnel per worker.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use futures_util::StreamExt as _;
use http::HeaderValue;
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::{self, client::IntoClientRequest as _};
use tunnel::{TunnelServerConfig, WorkerIdentity};

fn id(worker_id: i64) -> WorkerIdentity {
    WorkerIdentity {
        worker_id,
        cluster_id: 1,
    }
}

/// A refusal: status, JSON error code, headers.
#[derive(Debug)]
struct Refusal {
    status: u16,
    code: String,
    headers: http::HeaderMap,
}

async fn dial(
    addr: SocketAddr,
    token: Option<&str>,
    protocol: Option<&str>,
) -> Result<WebSocketStream<TcpStream>, Refusal> {
    dial_from(testkit::raw::source(1), addr, token, protocol).await
}

/// [`dial`] from a chosen loopback source address.
async fn dial_from(
    source: std::net::IpAddr,
    addr: SocketAddr,
    token: Option<&str>,
    protocol: Option<&str>,
) -> Result<WebSocketStream<TcpStream>, Refusal> {
    let mut req = format!("ws://{addr}/connect")
        .into_client_request()
        .unwrap();
    if let Some(t) = token {
        req.headers_mut().insert(
            "authorization",
            HeaderValue::from_str(&format!("Bearer {t}")).unwrap(),
        );
    }
    if let Some(p) = protocol {
        req.headers_mut()
            .insert("sec-websocket-protocol", HeaderValue::from_str(p).unwrap());
    }
    let tcp = testkit::raw::connect_from(source, addr).await;
    match tokio::time::timeout(T, tokio_tungstenite::client_async(req, tcp))
        .await
        .unwrap()
    {
        Ok((ws, resp)) => {
            assert_eq!(resp.headers()["sec-websocket-protocol"], "faden-tunnel.v1");
            Ok(ws)
        }
        Err(tungstenite::Error::Http(resp)) => {
            let body = resp.body().clone().unwrap_or_default();
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert!(v["error"]["message"].is_string(), "{v}");
            Err(Refusal {
                status: resp.status().as_u16(),
                code: v["error"]["code"].as_str().unwrap().to_owned(),
                headers: resp.headers().clone(),
            })
        }
        Err(e) => panic!("unexpected handshake error: {e}"),
    }
}

#[tokio::test]
async fn refuses_bad_tokens_and_protocols() {
    let tokens = tokens_with(&[("good", 1)]);
    tokens
        .lock()
        .insert("expired".into(), TokenState::Expired(id(2)));
    tokens
        .lock()
        .insert("revoked".into(), TokenState::Revoked(id(3)));
    let srv = ServerHarness::start(tokens, Default::default()).await;
    let p = Some("faden-tunnel.v1");

    for token in [Some("unknown"), Some("expired"), Some("revoked"), None] {
        let r = dial(srv.addr, token, p).await.unwrap_err();
        assert_eq!(r.status, 401, "{token:?}");
        assert_eq!(r.code, "invalid_worker_token");
    }
    // A good token with another dialect, or none, is refused with the versions spoken.
    for protocol in [Some("faden-tunnel.v2"), Some("gpustack"), None] {
        let r = dial(srv.addr, Some("good"), protocol).await.unwrap_err();
        assert_eq!(r.status, 400, "{protocol:?}");
        assert_eq!(r.code, "unsupported_tunnel_protocol");
        assert_eq!(r.headers["x-faden-tunnel-protocols"], "faden-tunnel.v1");
    }
    // Several offered, ours among them: accepted.
    let ws = dial(
        srv.addr,
        Some("good"),
        Some("faden-tunnel.v2, faden-tunnel.v1"),
    )
    .await
    .unwrap();
    drop(ws);

    // Not a WebSocket upgrade at all: 426.
    let tcp = TcpStream::connect(srv.addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let resp = sender
        .send_request(
            http::Request::get("/connect")
                .header("authorization", "Bearer good")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 426);

    // The worker client reports the refusal.
    let mut config = Worker::client_config(&srv.url(), "revoked");
    config.refused_backoff = Duration::from_secs(30);
    let mut worker = Worker::start(config, test_handler);
    tokio::time::timeout(
        T,
        worker.status.wait_for(|s| {
            s.last_error
                .as_deref()
                .is_some_and(|e| e.contains("401") && e.contains("revoked"))
        }),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(!worker.status.borrow().connected);
    worker.stop().await;
    srv.stop().await;
}

#[tokio::test]
async fn a_new_tunnel_replaces_the_old_one() {
    let mut srv = ServerHarness::start(tokens_with(&[("good", 1)]), Default::default()).await;
    let p = Some("faden-tunnel.v1");
    let mut first = dial(srv.addr, Some("good"), p).await.unwrap();
    let (w, up1) = srv.next_event().await;
    assert_eq!(w, 1);
    let up1 = up1.unwrap();
    // The old one is not noticed dead (nobody reads it); a new one comes anyway.
    let second = dial(srv.addr, Some("good"), p).await.unwrap();
    let (w, up2) = srv.next_event().await;
    assert_eq!(w, 1);
    let up2 = up2.unwrap();
    assert!(up2.session > up1.session);
    // The first is closed by the server.
    tokio::time::timeout(T, async {
        while let Some(msg) = first.next().await {
            if msg.is_err() {
                break;
            }
        }
    })
    .await
    .expect("the replaced tunnel was not closed");
    // Once the old tunnel's task has ended, the new tunnel is still the registered one.
    testkit::wait_until(T, "the replaced tunnel's task ended", || {
        srv.server.running_tasks() == 1
    })
    .await;
    let connected = srv.server.connected();
    assert_eq!(connected.len(), 1);
    assert_eq!(connected[0].session, up2.session);
    // And the worker goes down once, when the new one ends: no "down" came from the old one
    // (the server delivers every change before `stop` returns).
    drop(second);
    assert_eq!(srv.next_event().await, (1, None));
    let mut events = std::mem::replace(&mut srv.events, tokio::sync::mpsc::unbounded_channel().1);
    srv.stop().await;
    assert!(events.try_recv().is_err(), "a second down change");
}

#[tokio::test]
async fn bounds_handshake_time_and_pending_handshakes() {
    let tokens = tokens_with(&[]);
    tokens.lock().insert(
        "slow".into(),
        TokenState::Slow(id(1), Duration::from_millis(600)),
    );
    tokens.lock().insert(
        "very-slow".into(),
        TokenState::Slow(id(2), Duration::from_secs(30)),
    );
    let config = TunnelServerConfig {
        handshake_timeout: Duration::from_millis(400),
        max_pending_handshakes: 3,
        max_pending_per_ip: 2,
        ..Default::default()
    };
    let srv = ServerHarness::start(tokens, config).await;
    let p = Some("faden-tunnel.v1");

    // An authentication slower than the handshake deadline: refused, not hung.
    let started = tokio::time::Instant::now();
    let r = dial(srv.addr, Some("very-slow"), p).await.unwrap_err();
    assert_eq!(r.status, 503);
    assert_eq!(r.code, "handshake_timeout");
    // Well before the 30 s check would end.
    assert!(started.elapsed() < T);

    // Two pending handshakes from this IP: the third is refused at once. Each holds its slot
    // from before its token check begins.
    let checks = srv.auth_calls();
    let a = tokio::spawn(dial(srv.addr, Some("very-slow"), p));
    let b = tokio::spawn(dial(srv.addr, Some("very-slow"), p));
    srv.wait_auth_calls(checks + 2).await;
    let r = dial(srv.addr, Some("slow"), p).await.unwrap_err();
    assert_eq!(r.status, 429);
    assert_eq!(r.code, "too_many_handshakes");
    for t in [a, b] {
        let r = t.await.unwrap().unwrap_err();
        assert_eq!(r.status, 503);
    }
    // The slots were released with those refusals: the next one is judged on time again
    // (600 ms > 400 ms), not refused by count.
    let r = dial(srv.addr, Some("slow"), p).await.unwrap_err();
    assert_eq!(r.code, "handshake_timeout");
    srv.stop().await;
}

#[tokio::test]
async fn failed_tokens_are_rate_limited_per_source() {
    let config = TunnelServerConfig {
        auth: net::admission::AuthLimits {
            max_failures: 3,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut srv = ServerHarness::start(tokens_with(&[("good", 1)]), config).await;
    let p = Some("faden-tunnel.v1");
    let bad = testkit::raw::source(3);
    for _ in 0..3 {
        let r = dial_from(bad, srv.addr, Some("guess"), p)
            .await
            .unwrap_err();
        assert_eq!(r.status, 401);
    }
    // Past the limit: a wrong token is told to back off, the right one still connects.
    let r = dial_from(bad, srv.addr, Some("guess"), p)
        .await
        .unwrap_err();
    assert_eq!(r.status, 429);
    assert_eq!(r.code, "too_many_auth_failures");
    let retry: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry));
    let ws_bad_source = dial_from(bad, srv.addr, Some("good"), p).await.unwrap();
    assert_eq!(srv.next_event().await.0, 1);
    drop(ws_bad_source);
    // A worker from another address connects.
    let ws = dial_from(testkit::raw::source(4), srv.addr, Some("good"), p)
        .await
        .unwrap();
    assert_eq!(srv.next_event().await.0, 1);
    drop(ws);
    srv.stop().await;
}

#[tokio::test]
async fn malformed_frames_after_the_handshake_drop_only_that_tunnel() {
    use futures_util::SinkExt as _;
    use tokio::io::AsyncWriteExt as _;
    use tokio_tungstenite::tungstenite::Message;

    let mut srv = ServerHarness::start(
        tokens_with(&[("junk", 2), ("good", 1)]),
        TunnelServerConfig {
            liveness: fast_liveness(),
            ..Default::default()
        },
    )
    .await;
    // A real worker with a tunnel up the whole time.
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "good"), test_handler);
    worker.connected(1).await;
    assert_eq!(srv.next_event().await.0, 1);
    let p = Some("faden-tunnel.v1");

    // Raw WebSocket frames the server must refuse: an unmasked client frame, a reserved
    // opcode, a frame claiming an absurd length.
    let raw_junk: [&[u8]; 3] = [
        &[0x82, 0x03, 1, 2, 3],
        &[0x83, 0x80, 0, 0, 0, 0],
        &[
            0x82, 0xff, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0,
        ],
    ];
    for junk in raw_junk {
        let mut ws = dial(srv.addr, Some("junk"), p).await.unwrap();
        let (w, up) = srv.next_event().await;
        assert!(w == 2 && up.is_some());
        ws.get_mut().write_all(junk).await.unwrap();
        let (w, up) = srv.next_event().await;
        assert_eq!((w, up), (2, None), "{junk:?}: the tunnel was not dropped");
    }
    // Valid WebSocket, invalid yamux: a bad version byte, a frame of an unknown type, a text
    // message.
    let ws_junk = [
        Message::Binary(vec![0xff; 12].into()),
        Message::Binary(vec![0, 9, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0].into()),
        Message::Text("hello".into()),
    ];
    for junk in ws_junk {
        let mut ws = dial(srv.addr, Some("junk"), p).await.unwrap();
        assert_eq!(srv.next_event().await.0, 2);
        let shown = format!("{junk:?}");
        ws.send(junk).await.unwrap();
        let (w, up) = srv.next_event().await;
        assert_eq!((w, up), (2, None), "{shown}: the tunnel was not dropped");
    }
    // The good worker's tunnel is untouched and carries a stream.
    assert!(srv.server.is_connected(1));
    let mut stream = srv.server.open_stream(1).await.unwrap();
    {
        use tokio::io::AsyncReadExt as _;
        stream.write_all(b"eping").await.unwrap();
        stream.shutdown().await.unwrap();
        let mut back = Vec::new();
        tokio::time::timeout(T, stream.read_to_end(&mut back))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(back, b"ping");
    }
    worker.stop().await;
    srv.stop().await;
}

/// GPUStack's handshake: no subprotocol, `x-client-id` and `x-cidrs`; a GPUStack tunnel up
/// beside a faden one, the worker's ranges checked, and a bad message after the handshake
/// closing that tunnel only.
#[tokio::test]
async fn gpustack_workers_connect_in_their_own_dialect() {
    use futures_util::SinkExt as _;
    let mut srv = ServerHarness::start(
        tokens_with(&[("good", 1), ("other", 2)]),
        Default::default(),
    )
    .await;
    let gpustack = |cidrs: &'static str| {
        let mut req = format!("ws://{}/connect", srv.addr)
            .into_client_request()
            .unwrap();
        let h = req.headers_mut();
        h.insert("authorization", HeaderValue::from_static("Bearer good"));
        h.insert(
            "x-client-id",
            HeaderValue::from_static("0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f0"),
        );
        h.insert("x-cidrs", HeaderValue::from_static(cidrs));
        h.insert("x-unix-sockets", HeaderValue::from_static(""));
        req
    };
    for bad in ["", "not-a-range", "10.0.0.0/33"] {
        let tcp = TcpStream::connect(srv.addr).await.unwrap();
        match tokio_tungstenite::client_async(gpustack(bad), tcp).await {
            Err(tungstenite::Error::Http(resp)) => assert_eq!(resp.status(), 400, "{bad:?}"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    let tcp = TcpStream::connect(srv.addr).await.unwrap();
    let (mut ws, resp) = tokio_tungstenite::client_async(gpustack("127.0.0.2/32"), tcp)
        .await
        .unwrap();
    assert!(resp.headers().get("sec-websocket-protocol").is_none());
    assert_eq!(srv.next_event().await.0, 1);
    assert_eq!(srv.server.dialect(1), Some(tunnel::Dialect::GpuStack));
    // Only its own ranges are asked for.
    let outside = srv
        .server
        .open_session(1, "10.0.0.1".parse().unwrap(), 80)
        .await;
    assert!(matches!(outside, Err(tunnel::TunnelError::OutOfRange(_))));
    // A faden tunnel of another worker beside it.
    let _faden = dial(srv.addr, Some("other"), Some("faden-tunnel.v1"))
        .await
        .unwrap();
    assert_eq!(srv.next_event().await.0, 2);
    // A message that is not GPUStack's: that tunnel goes down, the other stays.
    ws.send(tungstenite::Message::Binary(bytes::Bytes::from_static(
        b"\x07junk",
    )))
    .await
    .unwrap();
    assert_eq!(srv.next_event().await, (1, None));
    assert_eq!(srv.server.dialect(2), Some(tunnel::Dialect::Faden));
    assert!(srv.server.is_connected(2));
    srv.stop().await;
}

/// A server whose token checks are not ready yet (`faden server` before its store is open)
/// answers 503 `starting`, which a worker retries soon, never 401, which it would take for a
/// refused token and retry only after 15–30 s.
#[tokio::test]
async fn a_starting_server_answers_503_until_it_is_ready() {
    let server =
        tunnel::TunnelServer::builder(TunnelServerConfig::default(), |t: String| async move {
            (t == "good").then(|| id(1))
        })
        .starting()
        .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = connect_router(&server);
    tokio::spawn(async move {
        axum::serve(
            listener,
            router.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    let p = Some("faden-tunnel.v1");
    let r = dial(addr, Some("good"), p).await.unwrap_err();
    assert_eq!((r.status, r.code.as_str()), (503, "starting"));
    server.set_ready();
    drop(dial(addr, Some("good"), p).await.unwrap());
}
