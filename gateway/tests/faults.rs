//! Fault suite (issue #6), gateway side: an upstream engine killed mid-stream, and a client that
//! stops reading. Each test asserts what the client sees and where traffic goes afterwards.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Harness, Inst, T, body_bytes, send};
use control_client::routing::RoutingSnapshot;
use gateway::{EjectionConfig, Gateway, GatewayConfig};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use mock_engine::{MockEngine, MockEngineConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

/// The engine's model name as it echoes it in every chunk (each engine gets its own, so a
/// test can tell which instance served a stream).
fn served_by(text: &str) -> Option<char> {
    let at = text.find("\"model\":\"engine-")? + "\"model\":\"engine-".len();
    text[at..].chars().next()
}

/// Reads a body to its end or its first error: the text received and whether it ended cleanly.
async fn drain_body(body: &mut Incoming, text: &mut String) -> bool {
    loop {
        match tokio::time::timeout(T, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    text.push_str(&String::from_utf8_lossy(&data));
                }
            }
            Ok(Some(Err(_))) => return false,
            Ok(None) => return true,
            Err(_) => panic!("stream neither ended nor failed within {T:?}: {text}"),
        }
    }
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_killed_mid_stream_fails_its_streams_and_is_ejected() {
    let engine = |name: &str| MockEngineConfig {
        model: format!("engine-{name}"),
        tokens: 40,
        inter_token_delay: Duration::from_millis(50),
        ..Default::default()
    };
    let a = MockEngine::start(engine("a")).await.unwrap();
    let b = MockEngine::start(engine("b")).await.unwrap();
    let c = MockEngine::start(engine("c")).await.unwrap();
    let failures = 3;
    let config = GatewayConfig {
        ejection: EjectionConfig {
            consecutive_failures: failures,
            // Longer than the test: an ejected instance stays out until the end.
            base_ejection: Duration::from_secs(60),
            max_ejection: Duration::from_secs(60),
        },
        ..Default::default()
    };
    let h = Harness::start(
        config,
        &[
            Inst::direct(1, a.port()),
            Inst::direct(2, b.port()),
            Inst::direct(3, c.port()),
        ],
    )
    .await;

    // Live streams on every instance (P2C on outstanding requests spreads them), at least one
    // on the engine about to die.
    let mut streams = Vec::new();
    while streams.len() < 6 || !streams.iter().any(|(e, _, _): &(char, _, _)| *e == 'a') {
        assert!(streams.len() < 30, "no stream ever landed on engine a");
        let resp = send(h.addr, h.chat(true)).await;
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut text = String::new();
        while served_by(&text).is_none() {
            let frame = tokio::time::timeout(T, body.frame())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            text.push_str(&String::from_utf8_lossy(&frame.into_data().unwrap()));
        }
        streams.push((served_by(&text).unwrap(), body, text));
    }

    // Engine a dies: its listener and every connection close at once, as with kill -9.
    let killed = Instant::now();
    a.stop().await;
    let mut draining = tokio::task::JoinSet::new();
    for (engine, mut body, mut text) in streams {
        draining.spawn(async move {
            let clean = drain_body(&mut body, &mut text).await;
            (engine, clean, text, killed.elapsed())
        });
    }
    let mut on_a = 0;
    let mut error_seen_after = Duration::ZERO;
    while let Some(r) = draining.join_next().await {
        let (engine, clean, text, at) = r.unwrap();
        if engine == 'a' {
            on_a += 1;
            error_seen_after = error_seen_after.max(at);
            assert!(
                !clean,
                "a stream cut by its engine must end abnormally: {text}"
            );
            assert!(
                !text.contains("[DONE]"),
                "clean [DONE] after a crash: {text}"
            );
            assert!(
                text.contains(r#""code":"upstream_protocol""#),
                "no SSE error event: {text}"
            );
        } else {
            assert!(clean, "stream on engine {engine} failed: {text}");
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        }
    }
    eprintln!(
        "engine killed: {on_a} stream(s) on it saw the error event within {error_seen_after:?}"
    );

    // New traffic: every request succeeds (a refused connection is retried on another
    // instance), the dead instance is tried only until it is ejected, then never again.
    let mut served = [0usize; 3];
    let short =
        r#"{"model":"mock-model","messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
    for _ in 0..60 {
        let resp = send(h.addr, h.post("/v1/chat/completions", short)).await;
        assert_eq!(resp.status(), 200);
        let text = String::from_utf8(body_bytes(resp).await.to_vec()).unwrap();
        match served_by(&text) {
            Some('b') => served[1] += 1,
            Some('c') => served[2] += 1,
            other => panic!("served by {other:?}: {text}"),
        }
    }
    let metrics = send(
        h.addr,
        http::Request::get(format!("http://{}/metrics", h.addr))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap(),
    )
    .await;
    let metrics = String::from_utf8(body_bytes(metrics).await.to_vec()).unwrap();
    let retries = metric(&metrics, "faden_gateway_retries_total");
    let refused = metric(
        &metrics,
        "faden_gateway_upstream_errors_total{kind=\"upstream_connect\"}",
    );
    let broken = metric(
        &metrics,
        "faden_gateway_upstream_errors_total{kind=\"upstream_protocol\"}",
    );
    eprintln!(
        "after the kill: spread b={} c={}, {retries} retries",
        served[1], served[2]
    );
    assert_eq!(
        retries,
        f64::from(failures),
        "the dead instance must be tried exactly until it is ejected"
    );
    assert_eq!(refused, f64::from(failures));
    assert!(broken >= f64::from(on_a), "{broken} < {on_a}");
    assert!(
        served[1] >= 15 && served[2] >= 15,
        "traffic not spread over the survivors: {served:?}"
    );
    h.stop().await;
}

/// Raw HTTP/1.1: a streamed chat request on its own connection, whose answer nobody reads.
async fn unread_stream(h: &Harness) -> tokio::net::TcpStream {
    let body =
        r#"{"model":"mock-model","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
    let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    s.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            h.bearer(),
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_does_not_slow_the_others() {
    // 2,000 events of 8 KiB: 16 MiB per stream, far beyond what socket buffers absorb.
    let tokens = 2000;
    let engine = MockEngine::start(MockEngineConfig {
        tokens,
        bytes_per_token: 8192,
        ..Default::default()
    })
    .await
    .unwrap();
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, engine.port())]).await;

    let requests_before = engine.stats.requests();
    let mut slow = unread_stream(&h).await;
    // Once the engine has the slow request, it fills every buffer between itself and the
    // client faster than the fast streams below can start.
    tokio::time::timeout(T, engine.stats.wait_requests(requests_before + 1))
        .await
        .expect("the slow stream never reached the engine");

    let started = Instant::now();
    let mut fast = tokio::task::JoinSet::new();
    for _ in 0..3 {
        let (addr, req) = (h.addr, h.chat(true));
        fast.spawn(async move {
            let resp = send(addr, req).await;
            assert_eq!(resp.status(), 200);
            let bytes = tokio::time::timeout(Duration::from_secs(20), resp.into_body().collect())
                .await
                .expect("a fast stream stalled behind the slow client")
                .unwrap()
                .to_bytes();
            assert!(bytes.ends_with(b"data: [DONE]\n\n"));
            bytes.len()
        });
    }
    while let Some(r) = fast.join_next().await {
        assert!(r.unwrap() > 2000 * 8192);
    }
    let took = started.elapsed();
    eprintln!("3 fast streams of 16 MiB done in {took:?} beside a client that reads nothing");
    // The slow stream was held back, not finished: only the fast ones completed at the engine.
    assert_eq!(
        engine.stats.completed(),
        3,
        "the slow stream was not stalled"
    );

    // Its client reads again: the whole stream arrives, ending with [DONE].
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = slow.read(&mut buf).await.unwrap();
            assert!(n > 0, "the slow stream was cut");
            got.extend_from_slice(&buf[..n]);
            // Chunked encoding: [DONE] then the last chunk.
            if got.ends_with(b"0\r\n\r\n") {
                break;
            }
        }
    })
    .await
    .expect("the slow stream did not resume");
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.starts_with("HTTP/1.1 200"),
        "{}",
        &text[..200.min(text.len())]
    );
    assert!(text.contains("data: [DONE]"));
    assert_eq!(engine.stats.completed(), 4);
    h.stop().await;
}

#[tokio::test]
async fn metrics_report_the_snapshot_age() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let (_tx, rx) = tokio::sync::watch::channel(Arc::new(RoutingSnapshot::default()));
    // Milliseconds; u64::MAX stands for "never synced".
    let age = Arc::new(AtomicU64::new(2500));
    let probe_age = age.clone();
    let gw = Gateway::builder(
        GatewayConfig {
            max_snapshot_staleness: Some(Duration::from_secs(2)),
            ..Default::default()
        },
        rx,
    )
    .staleness_probe(Arc::new(move || match probe_age.load(Ordering::Relaxed) {
        u64::MAX => Duration::MAX,
        ms => Duration::from_millis(ms),
    }))
    .build()
    .unwrap();
    assert!(
        gw.metrics_text()
            .contains("\nfaden_gateway_snapshot_age_seconds 2.500\n")
    );
    assert!(!gw.is_ready());
    age.store(100, Ordering::Relaxed);
    assert!(gw.is_ready());
    age.store(u64::MAX, Ordering::Relaxed);
    assert!(!gw.is_ready());
    assert!(
        gw.metrics_text()
            .contains("faden_gateway_snapshot_age_seconds +Inf")
    );
}

/// The response deadlines live in the body, which hyper only polls when the client socket
/// takes bytes: a client that stops reading (and keeps its connection open) is cut by the
/// listener's write-stall timeout instead, which frees the engine's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_after_the_write_stall_timeout() {
    let engine = MockEngine::start(MockEngineConfig {
        tokens: 2000,
        bytes_per_token: 8192,
        ..Default::default()
    })
    .await
    .unwrap();
    let config = GatewayConfig {
        listener: gateway::config::ListenerConfig {
            write_stall_timeout: Some(Duration::from_secs(1)),
            ..Default::default()
        },
        ..Default::default()
    };
    let h = Harness::start(config, &[Inst::direct(1, engine.port())]).await;
    let _slow = unread_stream(&h).await;
    // The generation must not be held long after the client stopped reading.
    let stalled = std::time::Instant::now();
    tokio::time::timeout(T, engine.stats.wait_disconnects(1))
        .await
        .expect("the upstream of a stalled client outlived the write-stall timeout");
    eprintln!(
        "stalled client cut, upstream cancelled after {:?}",
        stalled.elapsed()
    );
    h.stop().await;
}
