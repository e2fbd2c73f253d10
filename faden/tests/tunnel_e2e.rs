//! End to end: a worker proxy served through the tunnel, reached with `open_stream` + HTTP/1.1
//! and through the gateway's `Upstream`; streaming, restart, stalls, many streams, slow readers.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

// The tunnel crate's own harness (server, workers, worker proxies), shared rather than copied.
#[path = "../../worker/tests/behind_tunnel/mod.rs"]
mod behind_tunnel;
#[path = "../../tunnel/tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use behind_tunnel::*;
use bytes::Bytes;
use common::*;
use control_client::model::{ProxyMode, Scope};
use control_client::routing::{CredentialEntry, Endpoint, ModelRoute, RoutingSnapshot};
use gateway::TunnelUpstream;
use gateway::Upstream as _;
use gateway::UpstreamRequest;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full};
use mock_engine::MockEngineConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tunnel::TunnelServerConfig;
use tunnel::http::StreamHandler as _;

fn chat_body(stream: bool) -> Bytes {
    Bytes::from(format!(
        r#"{{"model":"mock-model","messages":[{{"role":"user","content":"hi"}}],"stream":{stream}}}"#
    ))
}

fn chat(stream: bool) -> Request<Full<Bytes>> {
    Request::post("/v1/chat/completions")
        .header(
            "x-gpustack-model-instance",
            format!("model-{MODEL_ID}-{INSTANCE}.static"),
        )
        .header("authorization", format!("Bearer {WORKER_CRED}"))
        .header("content-type", "application/json")
        .body(Full::new(chat_body(stream)))
        .unwrap()
}

/// [`chat`] as the gateway hands it to its tunnel transport: the route it plans for
/// [`tunnel_endpoint`] (proxy address, instance header, worker credential), the client's
/// headers already sanitised.
fn gateway_chat(stream: bool) -> UpstreamRequest {
    let credential = HeaderValue::try_from(format!("Bearer {WORKER_CRED}")).unwrap();
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    UpstreamRequest {
        method: Method::POST,
        path_and_query: PathAndQuery::from_static("/v1/chat/completions"),
        headers,
        body: chat_body(stream),
        route: gateway::upstream::route(&tunnel_endpoint(), Some(&credential), true).unwrap(),
    }
}

fn tunnel_endpoint() -> Endpoint {
    Endpoint {
        instance_id: INSTANCE,
        model_id: MODEL_ID,
        worker_id: WORKER,
        worker_name: "w1".into(),
        cluster_id: 1,
        address: WORKER_HOST.into(),
        instance_port: 40000,
        worker_port: WORKER_PORT,
        proxy_mode: ProxyMode::Tunnel,
        proxy_address: Some("http://127.0.0.1:30079".into()),
    }
}

#[tokio::test]
async fn serves_http_and_sse_through_the_tunnel() {
    let mut srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let (engine, handler) = worker_proxy(timed(6, 80)).await;
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), handler);
    worker.connected(1).await;
    let (w, up) = srv.next_event().await;
    assert_eq!(w, WORKER);
    assert_eq!(up.as_ref().map(|u| u.cluster_id), Some(1));
    assert!(up.unwrap().peer.is_some());
    assert_eq!(
        srv.server.address(WORKER),
        Some(tunnel::WorkerAddress::new(WORKER_HOST, WORKER_PORT))
    );

    // A plain answer over open_stream + HTTP/1.1.
    let stream = srv.server.open_stream(WORKER).await.unwrap();
    let resp = tunnel::http::send_request(stream, chat(false))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    // The worker proxy forwarded it to the engine, without the routing header.
    let seen = engine.stats.last_request().unwrap();
    assert!(!seen.headers.contains_key("x-gpustack-model-instance"));

    // SSE arrives chunk by chunk, not all at the end.
    let stream = srv.server.open_stream(WORKER).await.unwrap();
    let started = Instant::now();
    let resp = tunnel::http::send_request(stream, chat(true))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let got = frames(resp.into_body()).await;
    assert!(got.len() >= 4, "{} frames", got.len());
    let first = got.first().unwrap().0 - started;
    let last = got.last().unwrap().0 - started;
    assert!(
        last - first >= Duration::from_millis(300),
        "chunks bunched: first {first:?}, last {last:?}"
    );
    let text: Vec<u8> = got.iter().flat_map(|(_, b)| b.to_vec()).collect();
    assert!(text.ends_with(b"data: [DONE]\n\n"));

    // Through the gateway's Upstream trait (what the gateway calls for tunnel endpoints).
    let upstream = TunnelUpstream::new(srv.server.clone());
    let resp = upstream
        .send(&tunnel_endpoint(), gateway_chat(true), due())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let got = frames(resp.into_body()).await;
    assert!(got.len() >= 4);
    assert!(got.last().unwrap().1.ends_with(b"data: [DONE]\n\n"));
    let seen = engine.stats.last_request().unwrap();
    assert!(seen.body.starts_with(b"{\"model\""));

    // A worker without a tunnel: a retryable connect error.
    let mut other = tunnel_endpoint();
    other.worker_id = 99;
    let err = upstream
        .send(&other, gateway_chat(false), due())
        .await
        .unwrap_err();
    assert_eq!(err.kind, gateway::ErrorKind::UpstreamConnect);

    worker.stop().await;
    assert_eq!(srv.next_event().await, (WORKER, None));
    assert!(!srv.server.is_connected(WORKER));
    srv.stop().await;
}

#[tokio::test]
async fn full_gateway_reaches_a_tunnel_worker() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let (engine, handler) = worker_proxy(timed(4, 30)).await;
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), handler);
    worker.connected(1).await;

    let key = control_client::tokens::generate("fdn");
    let mut snapshot = RoutingSnapshot::default();
    snapshot.models.insert(
        "mock-model".into(),
        Arc::new(ModelRoute {
            model_id: MODEL_ID,
            name: "mock-model".into(),
            policy: None,
            endpoints: vec![tunnel_endpoint()],
        }),
    );
    snapshot.credentials.insert(
        key.access_id.clone(),
        CredentialEntry {
            id: 1,
            digest: key.digest,
            scope: Scope::Inference,
            expires_at: None,
        },
    );
    let (_tx, rx) = tokio::sync::watch::channel(Arc::new(snapshot));
    let gw = gateway::Gateway::builder(
        gateway::GatewayConfig {
            worker_credential: Some(WORKER_CRED.into()),
            ..Default::default()
        },
        rx,
    )
    .tunnel(Arc::new(TunnelUpstream::new(srv.server.clone())))
    .build()
    .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let (g, s) = (gw.clone(), stop.clone());
    let task = tokio::spawn(async move { g.serve(listener, s).await });

    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("authorization", format!("Bearer {}", key.value))
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .header("tracestate", "vendor=v1")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"mock-model","messages":[],"stream":true}"#,
        )))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let got = frames(resp.into_body()).await;
    assert!(got.len() >= 3);
    assert!(got.last().unwrap().1.ends_with(b"data: [DONE]\n\n"));
    // The gateway's worker credential reached the worker proxy (which strips it).
    assert_eq!(engine.stats.requests(), 1);
    // The client's trace crossed the tunnel, with the gateway's span as the engine's parent.
    let seen = engine.stats.last_request().unwrap();
    let parent = seen.headers["traceparent"].to_str().unwrap();
    assert!(
        parent.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-") && parent.ends_with("-01"),
        "{parent}"
    );
    assert!(!parent.contains("00f067aa0ba902b7"), "{parent}");
    assert_eq!(seen.headers["tracestate"], "vendor=v1");

    stop.cancel();
    tokio::time::timeout(T, task).await.unwrap().unwrap();
    worker.stop().await;
    srv.stop().await;
}

#[tokio::test]
async fn reconnects_quickly_after_a_server_restart() {
    let tokens = tokens_with(&[("tok-1", WORKER)]);
    let srv = ServerHarness::start(tokens.clone(), Default::default()).await;
    let addr = srv.addr;
    let (_engine, handler) = worker_proxy(MockEngineConfig::default()).await;
    let mut config = Worker::client_config(&srv.url(), "tok-1");
    // The defaults, as a worker would run: 100 ms .. 2 s.
    config.backoff_min = Duration::from_millis(100);
    config.backoff_max = Duration::from_secs(2);
    let mut worker = Worker::start(config, handler);
    worker.connected(1).await;

    srv.stop().await;
    tokio::time::timeout(T, worker.status.wait_for(|s| !s.connected))
        .await
        .unwrap()
        .unwrap();
    // Down until the worker's backoff has grown over a few failed dials (each one a status
    // update), then back on the same port.
    for _ in 0..3 {
        tokio::time::timeout(T, worker.status.changed())
            .await
            .expect("no reconnect attempt in time")
            .unwrap();
        assert!(!worker.status.borrow().connected);
    }
    let listener = TcpListener::bind(addr).await.unwrap();
    let srv = ServerHarness::start_on(listener, tokens, Default::default()).await;
    let back = Instant::now();
    worker.connected(2).await;
    let took = back.elapsed();
    // Back on a dial of the capped backoff (2 s), not after the minutes an uncapped one would
    // grow to; only a hang guard bounds it here, a loaded machine stretches each dial.
    eprintln!("tunnel back {took:?} after the server returned");
    assert!(took < T, "took {took:?}");
    let stream = srv.server.open_stream(WORKER).await.unwrap();
    let resp = tunnel::http::send_request(stream, chat(false))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    worker.stop().await;
    srv.stop().await;
}

#[tokio::test]
async fn a_silently_stalled_connection_is_replaced() {
    let config = TunnelServerConfig {
        liveness: fast_liveness(),
        ..Default::default()
    };
    let mut srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), config).await;
    let relay = Relay::start(srv.addr).await;
    let mut client = Worker::client_config(&format!("http://{}", relay.addr), "tok-1");
    client.liveness = fast_liveness();
    let mut worker = Worker::start(client, test_handler);
    worker.connected(1).await;
    let first = srv.next_event().await.1.unwrap().session;

    relay.stall_existing();
    let stalled = Instant::now();
    // Both ends notice within the dead-peer timeout (plus a ping interval), and the worker
    // dials again: a new session replaces the stalled one.
    worker.connected(2).await;
    let took = stalled.elapsed();
    eprintln!("stall detected and tunnel replaced after {took:?}");
    assert!(took >= Duration::from_millis(500), "too early: {took:?}");
    // Without the liveness checks a stalled connection is never replaced.
    assert!(took < T, "too late: {took:?}");
    let mut saw_new = false;
    for _ in 0..3 {
        match srv.next_event().await {
            (WORKER, Some(up)) if up.session > first => {
                saw_new = true;
                break;
            }
            _ => {}
        }
    }
    assert!(saw_new);
    // The new tunnel works.
    let mut s = srv.server.open_stream(WORKER).await.unwrap();
    s.write_all(b"ehello").await.unwrap();
    s.shutdown().await.unwrap();
    let mut back = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, b"hello");
    worker.stop().await;
    srv.stop().await;
}

#[tokio::test]
async fn a_thousand_concurrent_streams_complete() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), test_handler);
    worker.connected(1).await;
    let n = 1000;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    // Open them all before any completes: every stream is open at the same time.
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    for i in 0..n {
        let server = srv.server.clone();
        let barrier = barrier.clone();
        tasks.spawn(async move {
            let mut s = server.open_stream(WORKER).await.unwrap();
            let payload = format!("e{i:08}").repeat(100);
            s.write_all(payload.as_bytes()).await.unwrap();
            barrier.wait().await;
            s.shutdown().await.unwrap();
            let mut back = Vec::new();
            s.read_to_end(&mut back).await.unwrap();
            assert_eq!(back, &payload.as_bytes()[1..]);
        });
    }
    let mut done = 0;
    while let Some(r) = tokio::time::timeout(Duration::from_secs(60), tasks.join_next())
        .await
        .unwrap()
    {
        r.unwrap();
        done += 1;
    }
    assert_eq!(done, n);
    eprintln!("{n} concurrent streams in {:?}", started.elapsed());
    worker.stop().await;
    srv.stop().await;
}

async fn request_bytes(server: &tunnel::TunnelServer, n: u64) -> tunnel::TunnelStream {
    let mut s = server.open_stream(WORKER).await.unwrap();
    s.write_all(b"s").await.unwrap();
    s.write_all(&n.to_be_bytes()).await.unwrap();
    s
}

#[tokio::test]
async fn a_slow_reader_does_not_stall_other_streams() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), test_handler);
    worker.connected(1).await;
    let size = 16u64 << 20;
    // The slow stream's reader reads nothing for now, past a first byte: its sender is
    // running and soon fills the stream's window.
    let mut slow = request_bytes(&srv.server, size).await;
    let mut first = [0u8; 1];
    tokio::time::timeout(T, slow.read_exact(&mut first))
        .await
        .unwrap()
        .unwrap();
    // The fast one completes while the slow one is blocked.
    let mut fast = request_bytes(&srv.server, size).await;
    let started = Instant::now();
    let mut total = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let n = fast.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    })
    .await
    .expect("the fast stream stalled behind the slow one");
    assert_eq!(total, size);
    eprintln!(
        "fast stream: 16 MiB in {:?} while the slow one was blocked",
        started.elapsed()
    );
    // Only the slow stream's window was held back; it still completes when read.
    let mut slow_total = first.len() as u64;
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let n = slow.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            slow_total += n as u64;
        }
    })
    .await
    .unwrap();
    assert_eq!(slow_total, size);
    worker.stop().await;
    srv.stop().await;
}

#[tokio::test]
async fn one_stream_throughput_against_direct_tcp() {
    let size: u64 = 64 << 20;
    // Direct TCP on loopback, same reader loop.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sender = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let chunk = vec![0x5au8; 64 * 1024];
        let mut left = size;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            s.write_all(&chunk[..n]).await.unwrap();
            left -= n as u64;
        }
    });
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let started = Instant::now();
    let mut sink = Vec::new();
    c.read_to_end(&mut sink).await.unwrap();
    let direct = started.elapsed();
    sender.await.unwrap();
    assert_eq!(sink.len() as u64, size);
    drop(sink);

    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), test_handler);
    worker.connected(1).await;
    let mut s = request_bytes(&srv.server, size).await;
    let started = Instant::now();
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        let n = s.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    let tunnel = started.elapsed();
    assert_eq!(total, size);
    let mib = |d: Duration| (size as f64 / (1 << 20) as f64) / d.as_secs_f64();
    eprintln!(
        "one stream: tunnel {:.0} MiB/s, direct TCP {:.0} MiB/s, ratio {:.2} ({} build)",
        mib(tunnel),
        mib(direct),
        direct.as_secs_f64() / tunnel.as_secs_f64(),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    worker.stop().await;
    srv.stop().await;
}

#[tokio::test]
async fn dropping_the_answer_cancels_the_work_on_the_worker() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let (engine, handler) = worker_proxy(timed(200, 50)).await;
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), handler);
    worker.connected(1).await;
    let upstream = TunnelUpstream::new(srv.server.clone());
    let resp = upstream
        .send(&tunnel_endpoint(), gateway_chat(true), due())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    for _ in 0..2 {
        tokio::time::timeout(T, body.frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    // The client goes away mid-stream: the engine sees its request dropped well before the
    // 10 s the stream would take.
    drop(body);
    tokio::time::timeout(T, engine.stats.wait_disconnects(1))
        .await
        .expect("the engine did not see the disconnect");
    worker.stop().await;
    srv.stop().await;
}

/// One non-streamed request through `upstream`, answered 200 and read to the end.
async fn request_ok(upstream: &TunnelUpstream) {
    let resp = upstream
        .send(&tunnel_endpoint(), gateway_chat(false), due())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.unwrap();
}

#[tokio::test]
async fn the_gateway_reuses_stream_connections() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let (engine, handler) = worker_proxy(timed(3, 1)).await;
    // Counts the streams the server opens to this worker.
    let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = {
        let opened = opened.clone();
        let handler = Arc::new(handler);
        move |stream: tunnel::TunnelStream| {
            opened.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let handler = handler.clone();
            async move { handler.handle(stream).await }
        }
    };
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), counted);
    worker.connected(1).await;
    let upstream = TunnelUpstream::new(srv.server.clone());
    for stream in [false, true, false, true, false] {
        let resp = upstream
            .send(&tunnel_endpoint(), gateway_chat(stream), due())
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert!(!body.is_empty());
    }
    assert_eq!(engine.stats.requests(), 5);
    assert_eq!(
        opened.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "five sequential requests should share one stream connection"
    );

    // Two at once need two connections; both go back to the pool.
    let (a, b) = tokio::join!(
        upstream.send(&tunnel_endpoint(), gateway_chat(true), due()),
        upstream.send(&tunnel_endpoint(), gateway_chat(true), due())
    );
    for resp in [a.unwrap(), b.unwrap()] {
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(opened.load(std::sync::atomic::Ordering::SeqCst), 2);

    // An answer dropped early closes its connection (cancelling the work on the worker); the
    // next request still succeeds, on another connection.
    let resp = upstream
        .send(&tunnel_endpoint(), gateway_chat(true), due())
        .await
        .unwrap();
    drop(resp);
    request_ok(&upstream).await;

    // After a reconnect the old connections are gone with the old tunnel: requests open new
    // streams on the new one.
    srv.server.disconnect(WORKER);
    worker.connected(2).await;
    request_ok(&upstream).await;
    worker.stop().await;
    srv.stop().await;
}

#[tokio::test]
async fn reconnect_loops_do_not_leak_tasks() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), test_handler);
    worker.connected(1).await;
    // Leave a stream open on the first session: its task must end with the session too.
    let mut open = srv.server.open_stream(WORKER).await.unwrap();
    open.write_all(b"ex").await.unwrap();
    // The echo proves the stream's handler runs on the worker: the baseline counts its task.
    let mut buf = [0u8; 1];
    tokio::time::timeout(T, open.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf, b"x");
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    for round in 2..=11 {
        assert!(srv.server.disconnect(WORKER));
        worker.connected(round).await;
        let server = &srv.server;
        testkit::wait_until(T, "the server to register the new session", || {
            !server.connected().is_empty()
        })
        .await;
    }
    // The stream of the first session died with it.
    assert!(matches!(open.read(&mut buf).await, Ok(0) | Err(_)));
    // The old sessions' tasks wind down after their tunnels closed: a leak never gets there.
    testkit::wait_until(T, "the alive tasks back to the baseline", || {
        metrics.num_alive_tasks() <= before
    })
    .await;
    eprintln!(
        "alive tasks: {before} before, {} after 10 reconnects",
        metrics.num_alive_tasks()
    );
    worker.stop().await;
    srv.stop().await;
}
