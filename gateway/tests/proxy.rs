//! The upstream side: balancing, ejection, retries, streaming, cancellation, HTTP/2 and drain.
//! The worker path through a real worker proxy is in `faden/tests/worker_path.rs`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use gateway::{EjectionConfig, GatewayConfig};
use http::Request;
use http_body_util::{BodyExt, Full};
use mock_engine::{
    MockEngine, MockEngineConfig, MockEngineHandle, REQUEST_SEQ_HEADER, StreamKind, expected_stream,
};
use tokio::time::Instant;

async fn engine(config: MockEngineConfig) -> MockEngineHandle {
    MockEngine::start(config).await.unwrap()
}

fn timed(tokens: usize, ttft_ms: u64, itl_ms: u64) -> MockEngineConfig {
    MockEngineConfig {
        tokens,
        time_to_first_token: Duration::from_millis(ttft_ms),
        inter_token_delay: Duration::from_millis(itl_ms),
        ..Default::default()
    }
}

#[tokio::test]
async fn spreads_across_two_instances() {
    let a = engine(MockEngineConfig::default()).await;
    let b = engine(MockEngineConfig::default()).await;
    let h = Harness::start(
        GatewayConfig::default(),
        &[Inst::direct(1, a.port()), Inst::direct(2, b.port())],
    )
    .await;
    let n = 200;
    for _ in 0..n {
        let resp = send(h.addr, h.chat(false)).await;
        assert_eq!(resp.status(), 200);
        let _ = body_bytes(resp).await;
    }
    let (ra, rb) = (a.stats.requests(), b.stats.requests());
    assert_eq!(ra + rb, n);
    assert!(ra >= 60 && rb >= 60, "uneven spread {ra}:{rb}");

    // Adding a third instance keeps working and it gets traffic too.
    let c = engine(MockEngineConfig::default()).await;
    h.publish(
        &[
            Inst::direct(1, a.port()),
            Inst::direct(2, b.port()),
            Inst::direct(3, c.port()),
        ],
        std::slice::from_ref(&h.cred),
    );
    for _ in 0..60 {
        let _ = body_bytes(send(h.addr, h.chat(false)).await).await;
    }
    assert!(
        c.stats.requests() >= 5,
        "new instance got {}",
        c.stats.requests()
    );
    h.stop().await;
}

#[tokio::test]
async fn load_aware_under_concurrency() {
    // One slow stream pinned on each instance at first; P2C then prefers the less loaded one.
    let a = engine(timed(40, 0, 25)).await;
    let b = engine(timed(40, 0, 25)).await;
    let h = Harness::start(
        GatewayConfig::default(),
        &[Inst::direct(1, a.port()), Inst::direct(2, b.port())],
    )
    .await;
    let mut streams = Vec::new();
    for _ in 0..8 {
        let resp = send(h.addr, h.chat(true)).await;
        streams.push(resp);
    }
    let (ra, rb) = (a.stats.requests(), b.stats.requests());
    assert_eq!(
        (ra, rb),
        (4, 4),
        "P2C with 2 instances alternates by outstanding count"
    );
    drop(streams);
    h.stop().await;
}

#[tokio::test]
async fn ejects_failing_instance_and_recovers() {
    let bad = engine(MockEngineConfig::default()).await;
    let good = engine(MockEngineConfig::default()).await;
    bad.set_fail_status(Some(500));
    let config = GatewayConfig {
        ejection: EjectionConfig {
            consecutive_failures: 3,
            base_ejection: Duration::from_millis(400),
            max_ejection: Duration::from_secs(5),
        },
        ..Default::default()
    };
    let h = Harness::start(
        config,
        &[Inst::direct(1, bad.port()), Inst::direct(2, good.port())],
    )
    .await;
    // Until 3 failures land on `bad` it gets some traffic; 5xx answers are passed through.
    let mut failures = 0;
    for _ in 0..100 {
        let resp = send(h.addr, h.chat(false)).await;
        if resp.status() == 500 {
            failures += 1;
        }
        let _ = body_bytes(resp).await;
        if failures == 3 {
            break;
        }
    }
    assert_eq!(failures, 3);
    let before = bad.stats.requests();
    for _ in 0..30 {
        assert_eq!(send(h.addr, h.chat(false)).await.status(), 200);
    }
    assert_eq!(bad.stats.requests(), before, "ejected instance got traffic");

    // It recovers, the ejection ends, and live traffic finds it healthy again.
    bad.set_fail_status(None);
    let gateway = h.addr;
    testkit::wait_until_async(T, "the ejection to end", || {
        let req = h.chat(false);
        let bad = &bad;
        async move {
            assert_eq!(send(gateway, req).await.status(), 200);
            bad.stats.requests() > before
        }
    })
    .await;
    for _ in 0..40 {
        assert_eq!(send(h.addr, h.chat(false)).await.status(), 200);
    }
    assert!(
        bad.stats.requests() > before + 5,
        "recovered instance got no traffic"
    );
    h.stop().await;
}

#[tokio::test]
async fn retries_connect_refused_on_another_instance() {
    let good = engine(MockEngineConfig::default()).await;
    let dead = dead_port().await;
    let h = Harness::start(
        GatewayConfig::default(),
        &[Inst::direct(1, dead), Inst::direct(2, good.port())],
    )
    .await;
    for _ in 0..20 {
        let resp = send(h.addr, h.chat(false)).await;
        assert_eq!(resp.status(), 200);
        let _ = body_bytes(resp).await;
    }
    assert_eq!(good.stats.requests(), 20);
    let metrics = h.gateway.metrics_text();
    assert!(
        !metrics.contains("faden_gateway_retries_total 0"),
        "{metrics}"
    );

    // Only a dead instance: 502 after the retry budget.
    h.publish(&[Inst::direct(1, dead)], std::slice::from_ref(&h.cred));
    assert_error(send(h.addr, h.chat(false)).await, 502, "upstream_connect").await;
    h.stop().await;
}

#[tokio::test]
async fn no_retry_once_upstream_started() {
    // Both instances answer 500: the client gets the first answer, the second is never tried.
    let a = engine(timed(5, 0, 20)).await;
    let b = engine(timed(5, 0, 20)).await;
    a.set_fail_status(Some(500));
    b.set_fail_status(Some(500));
    let h = Harness::start(
        GatewayConfig::default(),
        &[Inst::direct(1, a.port()), Inst::direct(2, b.port())],
    )
    .await;
    let resp = send(h.addr, h.chat(false)).await;
    assert_eq!(resp.status(), 500);
    assert_eq!(a.stats.requests() + b.stats.requests(), 1);

    // Both die mid-stream: one attempt only, the client sees the failure.
    a.set_fail_status(None);
    b.set_fail_status(None);
    a.set_abort_after_tokens(Some(1));
    b.set_abort_after_tokens(Some(1));
    let resp = send(h.addr, h.chat(true)).await;
    assert_eq!(resp.status(), 200);
    let _ = resp.into_body().collect().await;
    assert_eq!(a.stats.requests() + b.stats.requests(), 2);
    h.stop().await;
}

/// Reads every frame with its arrival time.
async fn frames(resp: http::Response<hyper::body::Incoming>) -> (Vec<(Instant, Bytes)>, bool) {
    let mut body = resp.into_body();
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout(T, body.frame()).await.unwrap() {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    out.push((Instant::now(), d));
                }
            }
            Some(Err(_)) => return (out, false),
            None => return (out, true),
        }
    }
}

#[tokio::test]
async fn sse_passes_through_byte_exact_and_per_chunk() {
    let tokens = 6;
    let itl = 80;
    let e = engine(timed(tokens, 50, itl)).await;
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[],"stream":true,"stream_options":{{"include_usage":true}}}}"#
    );
    let resp = send(h.addr, h.post("/v1/chat/completions", body.clone())).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-accel-buffering"], "no");
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let seq: u64 = resp.headers()[REQUEST_SEQ_HEADER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let (got, clean) = frames(resp).await;
    assert!(clean);
    let all: Vec<u8> = got.iter().flat_map(|(_, b)| b.to_vec()).collect();
    let want = expected_stream(
        StreamKind::Chat,
        MODEL,
        1_700_000_000,
        seq,
        tokens,
        body.len(),
        true,
    )
    .concat();
    assert_eq!(
        String::from_utf8(all).unwrap(),
        String::from_utf8(want).unwrap()
    );

    // Token events arrive spaced by the inter-token delay, not bunched at the end.
    let token_times: Vec<Instant> = got
        .iter()
        .filter(|(_, b)| memchr::memmem::find(b, b"\"tok").is_some())
        .map(|(t, _)| *t)
        .collect();
    assert!(
        token_times.len() >= tokens,
        "{} token frames",
        token_times.len()
    );
    let gaps: Vec<u128> = token_times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    let spaced = gaps.iter().filter(|g| **g >= (itl as u128) / 2).count();
    assert!(
        spaced >= tokens - 2,
        "chunks bunched together: gaps {gaps:?}"
    );
    let span = (token_times[tokens - 1] - token_times[0]).as_millis();
    assert!(
        span >= (itl as u128) * (tokens as u128 - 1) * 8 / 10,
        "span {span} ms"
    );
    h.stop().await;
}

#[tokio::test]
async fn mid_stream_failure_is_visible() {
    let e = engine(timed(10, 0, 20)).await;
    e.set_abort_after_tokens(Some(3));
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;
    let resp = send(h.addr, h.chat(true)).await;
    assert_eq!(resp.status(), 200);
    let (got, clean) = frames(resp).await;
    assert!(!clean, "the response must end abnormally");
    let text: String = got
        .iter()
        .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
        .collect();
    assert!(!text.contains("[DONE]"), "{text}");
    assert_eq!(text.matches("tok").count(), 3);
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let v: serde_json::Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "upstream_protocol");
    assert!(
        h.gateway
            .metrics_text()
            .contains("faden_gateway_upstream_errors_total{kind=\"upstream_protocol\"} 1")
    );

    // Non-SSE answers just end abnormally.
    h.stop().await;
}

#[tokio::test]
async fn idle_timeout_ends_a_stalled_stream() {
    let e = engine(timed(3, 0, 600)).await;
    let mut config = GatewayConfig::default();
    config.timeouts.idle = Duration::from_millis(200);
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;
    let (got, clean) = frames(send(h.addr, h.chat(true)).await).await;
    assert!(!clean);
    let text: String = got
        .iter()
        .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
        .collect();
    assert!(text.contains("upstream_idle_timeout"), "{text}");
    tokio::time::timeout(T, e.stats.wait_disconnects(1))
        .await
        .unwrap();

    // First-byte timeout on a slow non-streamed answer: 504 and the engine sees the cancel.
    let mut config = GatewayConfig::default();
    config.timeouts.first_byte = Duration::from_millis(200);
    let slow = engine(timed(3, 2000, 0)).await;
    let h2 = Harness::start(config, &[Inst::direct(1, slow.port())]).await;
    assert_error(
        send(h2.addr, h2.chat(false)).await,
        504,
        "upstream_first_byte_timeout",
    )
    .await;
    tokio::time::timeout(T, slow.stats.wait_disconnects(1))
        .await
        .unwrap();
    h.stop().await;
    h2.stop().await;
}

#[tokio::test]
async fn client_disconnect_cancels_upstream() {
    let e = engine(timed(50, 400, 50)).await;
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;

    // Before the first token: headers came, no token yet.
    let resp = send(h.addr, h.chat(true)).await;
    assert_eq!(resp.status(), 200);
    drop(resp);
    tokio::time::timeout(T, e.stats.wait_disconnects(1))
        .await
        .unwrap();

    // After the first token.
    let resp = send(h.addr, h.chat(true)).await;
    let mut body = resp.into_body();
    let first = tokio::time::timeout(T, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(first.data_ref().unwrap().starts_with(b"data: "));
    drop(body);
    tokio::time::timeout(T, e.stats.wait_disconnects(2))
        .await
        .unwrap();

    // Non-streamed, before any response byte: the client gives up while the engine works.
    let addr = h.addr;
    let req = h.chat(false);
    let pending = tokio::spawn(async move { send(addr, req).await });
    e.stats.wait_requests(3).await;
    pending.abort();
    tokio::time::timeout(T, e.stats.wait_disconnects(3))
        .await
        .unwrap();
    assert_eq!(e.stats.completed(), 0);
    // Every client that left is counted, the one gone before any answer too.
    testkit::wait::wait_until(T, "three client disconnects", || {
        h.gateway
            .metrics_text()
            .contains("faden_gateway_client_disconnects_total 3")
    })
    .await;
    h.stop().await;
}

#[tokio::test]
async fn http2_prior_knowledge() {
    let e = engine(timed(3, 0, 10)).await;
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;
    let resp = send_h2(h.addr, h.chat(true)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let body = body_bytes(resp).await;
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    let resp = send_h2(h.addr, h.post("/v1/completions", "{")).await;
    assert_error(resp, 400, "invalid_json").await;
    // Upstream stays HTTP/1.1.
    assert_eq!(
        e.stats.last_request().unwrap().version,
        http::Version::HTTP_11
    );
    h.stop().await;
}

#[tokio::test]
async fn drain_lets_a_live_stream_finish() {
    let e = engine(timed(10, 0, 60)).await;
    let mut config = GatewayConfig::default();
    config.listener.drain_timeout = Duration::from_secs(5);
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;
    let resp = send(h.addr, h.chat(true)).await;
    let mut body = resp.into_body();
    let _first = tokio::time::timeout(T, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    h.shutdown.cancel();
    testkit::wait_until(T, "the draining gateway to report not ready", || {
        !h.gateway.is_ready()
    })
    .await;
    // New connections are refused once draining started.
    let addr = h.addr;
    testkit::wait_until_async(T, "new connections to be refused", || async move {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await;

    let rest = tokio::time::timeout(T, body.collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    assert!(rest.ends_with(b"data: [DONE]\n\n"), "stream cut by drain");
    let mut h = h;
    tokio::time::timeout(T, h.task.take().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(e.stats.disconnects(), 0);
}

#[tokio::test]
async fn drain_timeout_cuts_what_is_left() {
    // A stream of 50 s: the serve task ending within `T` means the drain cut it.
    let e = engine(timed(1000, 0, 50)).await;
    let mut config = GatewayConfig::default();
    config.listener.drain_timeout = Duration::from_millis(300);
    let mut h = Harness::start(config, &[Inst::direct(1, e.port())]).await;
    let resp = send(h.addr, h.chat(true)).await;
    h.shutdown.cancel();
    tokio::time::timeout(T, h.task.take().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(resp.into_body().collect().await.is_err());
    tokio::time::timeout(T, e.stats.wait_disconnects(1))
        .await
        .unwrap();
}

#[tokio::test]
async fn connection_limit_holds_further_clients_back() {
    let e = engine(MockEngineConfig::default()).await;
    let mut config = GatewayConfig::default();
    config.listener.max_connections = 1;
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;
    // The first connection stays open (keep-alive).
    let stream = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let (mut first, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    let first_conn = tokio::spawn(conn);
    assert_eq!(
        first.send_request(h.chat(false)).await.unwrap().status(),
        200
    );
    // A second client is not served while the first holds the only slot...
    let addr = h.addr;
    let req = h.chat(false);
    let mut second = tokio::spawn(async move { send(addr, req).await });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut second)
            .await
            .is_err()
    );
    // ...and is as soon as it is released.
    drop(first);
    first_conn.abort();
    let resp = tokio::time::timeout(T, second).await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    h.stop().await;
}

/// A stand-in tunnel transport: sends through the ordinary pool to a fixed local address, the
/// way a real one would dial the worker's tunnel instead.
#[derive(Debug)]
struct LoopbackTunnel {
    pool: gateway::upstream::HttpUpstream,
    target: std::net::SocketAddr,
    seen_instance: arc_swap::ArcSwapOption<String>,
}

impl gateway::Upstream for LoopbackTunnel {
    fn send(
        &self,
        endpoint: &control_client::routing::Endpoint,
        mut request: gateway::UpstreamRequest,
        deadline: tokio::time::Instant,
    ) -> gateway::upstream::UpstreamFuture {
        let (_, instance, authorization) = request.route.into_parts();
        self.seen_instance
            .store(instance.map(|v| std::sync::Arc::new(v.to_str().unwrap().to_owned())));
        // To the engine, with the worker credential but without the instance header.
        if let Some(authorization) = authorization {
            request
                .headers
                .insert(http::header::AUTHORIZATION, authorization);
        }
        request.route = gateway::Route::Direct {
            authority: self.target.to_string().parse().unwrap(),
        };
        self.pool.send(endpoint, request, deadline)
    }
}

#[tokio::test]
async fn tunnel_path_plugs_in_through_the_upstream_trait() {
    let e = engine(timed(3, 0, 5)).await;
    let tunnel = std::sync::Arc::new(LoopbackTunnel {
        pool: gateway::upstream::HttpUpstream::new(&GatewayConfig::default()),
        target: e.addr,
        seen_instance: Default::default(),
    });
    let key = control_client::tokens::generate("fdn");
    let cred = credential(1, &key, control_client::model::Scope::Inference, None);
    let inst = Inst {
        id: 4,
        port: 1,
        mode: control_client::model::ProxyMode::Tunnel,
        worker_port: 1,
    };
    let (_tx, rx) = tokio::sync::watch::channel(std::sync::Arc::new(snapshot(
        &[inst],
        std::slice::from_ref(&cred),
    )));
    let gw = gateway::Gateway::builder(
        GatewayConfig {
            worker_credential: Some("w".into()),
            ..Default::default()
        },
        rx,
    )
    .tunnel(tunnel.clone())
    .build()
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let (g, s) = (gw.clone(), stop.clone());
    let task = tokio::spawn(async move { g.serve(listener, s).await });
    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("authorization", format!("Bearer {}", key.value))
        .body(Full::new(Bytes::from(format!(
            r#"{{"model":"{MODEL}","stream":true}}"#
        ))))
        .unwrap();
    let body = body_bytes(send(addr, req).await).await;
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    assert_eq!(
        tunnel
            .seen_instance
            .load_full()
            .as_deref()
            .map(String::as_str),
        Some("model-1-4.static")
    );
    assert_eq!(
        e.stats.last_request().unwrap().headers["authorization"],
        "Bearer w"
    );
    stop.cancel();
    tokio::time::timeout(T, task).await.unwrap().unwrap();
}

#[tokio::test]
async fn total_timeout_ends_a_long_stream() {
    // A stream of 20 s, cut by the total timeout long before it would end.
    let e = engine(timed(400, 0, 50)).await;
    let mut config = GatewayConfig::default();
    config.timeouts.total = Duration::from_millis(400);
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;
    let started = Instant::now();
    let (got, clean) = frames(send(h.addr, h.chat(true)).await).await;
    assert!(!clean);
    assert!(started.elapsed() < T);
    let text: String = got
        .iter()
        .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
        .collect();
    assert!(text.contains("upstream_total_timeout"), "{text}");
    assert!(!text.contains("[DONE]"));
    tokio::time::timeout(T, e.stats.wait_disconnects(1))
        .await
        .unwrap();
    h.stop().await;
}

/// A JSON body sent without a content type goes upstream saying it is JSON (some engines refuse
/// it otherwise); a content type the client chose is kept.
#[tokio::test]
async fn a_json_body_without_a_content_type_is_sent_as_json() {
    let e = engine(timed(1, 0, 0)).await;
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;
    let body = format!(r#"{{"model":"{MODEL}","messages":[]}}"#);
    let mut req = h.post("/v1/chat/completions", body.clone());
    req.headers_mut().remove("content-type");
    assert_eq!(send(h.addr, req).await.status(), 200);
    assert_eq!(
        e.stats.last_request().unwrap().headers["content-type"],
        "application/json"
    );
    let mut req = h.post("/v1/chat/completions", body);
    req.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/json; charset=utf-8"),
    );
    assert_eq!(send(h.addr, req).await.status(), 200);
    assert_eq!(
        e.stats.last_request().unwrap().headers["content-type"],
        "application/json; charset=utf-8"
    );
    h.stop().await;
}
