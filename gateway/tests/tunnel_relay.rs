#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]
//! The instance relay: `CONNECT model-<m>-<i>.static:0` to the worker proxy, over tunnel streams
//! (the gateway's transport, the proxy port) and on the worker port; never an open relay.

// The tunnel crate's own harness (server, workers, worker proxies), shared rather than copied.
#[path = "../../tunnel/tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use control_client::model::ProxyMode;
use control_client::routing::Endpoint;
use faden_loadtest::{ConnectProxy, LoadModel, RunConfig, Workload, WorkloadKind};
use gateway::TunnelUpstream;
use gateway::Upstream as _;
use gateway::UpstreamRequest;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use mock_engine::{MockEngineConfig, REQUEST_SEQ_HEADER, StreamKind, expected_stream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tunnel::http::{HttpHandler, ServeConfig};
use worker::proxy::WorkerProxy;

fn timed(tokens: usize, itl_ms: u64) -> MockEngineConfig {
    MockEngineConfig {
        tokens,
        inter_token_delay: Duration::from_millis(itl_ms),
        ..Default::default()
    }
}

fn endpoint(instance: i64, port: u16) -> Endpoint {
    Endpoint {
        instance_id: instance,
        model_id: MODEL_ID,
        worker_id: WORKER,
        worker_name: "w1".into(),
        cluster_id: 1,
        address: WORKER_HOST.into(),
        instance_port: port,
        worker_port: WORKER_PORT,
        proxy_mode: ProxyMode::Tunnel,
        proxy_address: Some("http://127.0.0.1:30079".into()),
    }
}

fn chat_body(stream: bool) -> String {
    if stream {
        r#"{"model":"mock-model","messages":[],"stream":true,"stream_options":{"include_usage":true}}"#
            .to_owned()
    } else {
        r#"{"model":"mock-model","messages":[{"role":"user","content":"hi"}]}"#.to_owned()
    }
}

/// A request as the gateway hands it to its tunnel transport for `ep`: the route it plans
/// (proxy address, instance header, worker credential), the client's headers already
/// sanitised.
fn gateway_request(ep: &Endpoint, stream: bool) -> UpstreamRequest {
    let credential = HeaderValue::try_from(format!("Bearer {WORKER_CRED}")).unwrap();
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("x-request-id", HeaderValue::from_static("r-1"));
    UpstreamRequest {
        method: Method::POST,
        path_and_query: PathAndQuery::from_static("/v1/chat/completions"),
        headers,
        body: Bytes::from(chat_body(stream)),
        route: gateway::upstream::route(ep, Some(&credential), true).unwrap(),
    }
}

type ProxyResponse =
    Response<http_body_util::combinators::UnsyncBoxBody<Bytes, gateway::error::BoxError>>;

fn status_only(status: StatusCode) -> ProxyResponse {
    let mut resp = Response::new(
        Full::new(Bytes::from_static(b"{}"))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp
}

/// The worker proxy on tunnel streams, but answering 405 to whatever `refused` says and counting
/// those refusals and the streams opened.
fn filtered(
    proxy: WorkerProxy,
    refused: fn(&Method) -> bool,
    refusals: Arc<AtomicUsize>,
    streams: Arc<AtomicUsize>,
) -> impl tunnel::http::StreamHandler {
    let peer: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let service = service_fn(move |req: Request<Incoming>| {
        let proxy = proxy.clone();
        let refusals = refusals.clone();
        async move {
            if refused(req.method()) {
                refusals.fetch_add(1, Ordering::SeqCst);
                return Ok::<_, std::convert::Infallible>(status_only(
                    StatusCode::METHOD_NOT_ALLOWED,
                ));
            }
            Ok(proxy.handle(req, peer).await)
        }
    });
    let handler = Arc::new(HttpHandler::new(service, ServeConfig::default()));
    move |stream: tunnel::TunnelStream| {
        streams.fetch_add(1, Ordering::SeqCst);
        let handler = handler.clone();
        async move { tunnel::http::StreamHandler::handle(&*handler, stream).await }
    }
}

async fn frames<B>(resp: Response<B>) -> Vec<(Instant, Bytes)>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    let mut body = resp.into_body();
    let mut out = Vec::new();
    while let Some(frame) = tokio::time::timeout(T, body.frame()).await.unwrap() {
        if let Ok(data) = frame.unwrap().into_data() {
            out.push((Instant::now(), data));
        }
    }
    out
}

#[tokio::test]
async fn a_late_answer_through_the_tunnel_ends_at_the_first_byte_deadline() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let slow = MockEngineConfig {
        time_to_first_token: Duration::from_secs(5),
        ..timed(3, 0)
    };
    let (engine, proxy) = engine_and_proxy(slow).await;
    let none = Arc::new(AtomicUsize::new(0));
    let handler = filtered(proxy, |_| false, none.clone(), none);
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), handler);
    worker.connected(1).await;
    let upstream = TunnelUpstream::new(srv.server.clone());
    let ep = endpoint(INSTANCE, engine.port());
    let started = Instant::now();
    let sent = upstream.send(
        &ep,
        gateway_request(&ep, false),
        started + Duration::from_millis(300),
    );
    let err = tokio::time::timeout(T, sent)
        .await
        .expect("the deadline was not kept")
        .unwrap_err();
    assert_eq!(err.kind, gateway::ErrorKind::UpstreamFirstByteTimeout);
    // The relayed connection is closed, which cancels the request at the engine.
    tokio::time::timeout(Duration::from_secs(3), engine.stats.wait_disconnects(1))
        .await
        .expect("the engine did not see the disconnect");
    worker.stop().await;
}

#[tokio::test]
async fn the_gateway_relays_to_the_instance_and_reuses_the_stream() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let (engine, proxy) = engine_and_proxy(timed(6, 40)).await;
    let streams = Arc::new(AtomicUsize::new(0));
    let refusals = Arc::new(AtomicUsize::new(0));
    // A worker that forwards nothing per request: only the relay can reach the engine.
    let handler = filtered(
        proxy,
        |m| m != Method::CONNECT,
        refusals.clone(),
        streams.clone(),
    );
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), handler);
    worker.connected(1).await;
    let upstream = TunnelUpstream::new(srv.server.clone());
    let ep = endpoint(INSTANCE, engine.port());

    let resp = upstream
        .send(&ep, gateway_request(&ep, false), due())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    // What the engine saw is what the worker proxy sends per request: no routing header, no
    // credential, Host of the instance; other headers as the gateway sent them.
    let seen = engine.stats.last_request().unwrap();
    assert!(!seen.headers.contains_key("x-gpustack-model-instance"));
    assert!(!seen.headers.contains_key("authorization"));
    assert_eq!(
        seen.headers["host"],
        format!("127.0.0.1:{}", engine.port()).as_str()
    );
    assert_eq!(seen.headers["x-request-id"], "r-1");
    assert_eq!(seen.uri, "/v1/chat/completions");

    // SSE: byte-exact, chunk by chunk.
    let resp = upstream
        .send(&ep, gateway_request(&ep, true), due())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let seq: u64 = resp.headers()[REQUEST_SEQ_HEADER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let got = frames(resp).await;
    let all: Vec<u8> = got.iter().flat_map(|(_, b)| b.to_vec()).collect();
    let want = expected_stream(
        StreamKind::Chat,
        "mock-model",
        1_700_000_000,
        seq,
        6,
        chat_body(true).len(),
        true,
    )
    .concat();
    assert_eq!(
        String::from_utf8(all).unwrap(),
        String::from_utf8(want).unwrap()
    );
    assert!(got.len() >= 6, "{} frames", got.len());
    assert!(got.last().unwrap().0 - got[0].0 >= Duration::from_millis(150));

    // Keep-alive: one stream, one engine connection for all of them.
    for stream in [false, true, false, true, false] {
        let resp = upstream
            .send(&ep, gateway_request(&ep, stream), due())
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(engine.stats.requests(), 7);
    assert_eq!(streams.load(Ordering::SeqCst), 1);
    assert_eq!(engine.stats.connections(), 1);
    assert_eq!(refusals.load(Ordering::SeqCst), 0);

    // Dropping an answer mid-stream closes the relayed connection: the engine sees it.
    let resp = upstream
        .send(&ep, gateway_request(&ep, true), due())
        .await
        .unwrap();
    let mut body = resp.into_body();
    tokio::time::timeout(T, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    drop(body);
    tokio::time::timeout(Duration::from_secs(3), engine.stats.wait_disconnects(1))
        .await
        .expect("the engine did not see the disconnect");
    // The next request takes a new stream.
    let resp = upstream
        .send(&ep, gateway_request(&ep, false), due())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.unwrap();
    assert_eq!(streams.load(Ordering::SeqCst), 2);
    worker.stop().await;
    srv.stop().await;
}

#[tokio::test]
async fn an_older_worker_gets_per_request_proxying() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let (engine, proxy) = engine_and_proxy(timed(3, 1)).await;
    let refusals = Arc::new(AtomicUsize::new(0));
    // As a worker from before the relay: 405 to CONNECT.
    let handler = filtered(
        proxy,
        |m| m == Method::CONNECT,
        refusals.clone(),
        Arc::default(),
    );
    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), handler);
    worker.connected(1).await;
    let upstream = TunnelUpstream::new(srv.server.clone());
    let ep = endpoint(INSTANCE, engine.port());
    for stream in [false, true, false] {
        let resp = upstream
            .send(&ep, gateway_request(&ep, stream), due())
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(engine.stats.requests(), 3);
    // Asked once, then remembered.
    assert_eq!(refusals.load(Ordering::SeqCst), 1);
    let seen = engine.stats.last_request().unwrap();
    assert!(!seen.headers.contains_key("x-gpustack-model-instance"));
    assert!(!seen.headers.contains_key("authorization"));
    worker.stop().await;
    srv.stop().await;
}

#[tokio::test]
async fn unknown_and_unreachable_instances_answer_as_before() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let (engine, proxy) = engine_and_proxy(MockEngineConfig::default()).await;
    // A port nothing listens on.
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    drop(dead);
    proxy.instances().insert(11, dead_port);
    let mut worker = Worker::start(
        Worker::client_config(&srv.url(), "tok-1"),
        serve_on_streams(proxy),
    );
    worker.connected(1).await;
    let upstream = TunnelUpstream::new(srv.server.clone());

    // Not registered on the worker: the marked 404, so the gateway may try another instance.
    let unknown = endpoint(99, 40000);
    let resp = upstream
        .send(&unknown, gateway_request(&unknown, false), due())
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    assert_eq!(resp.headers()["x-faden-no-such-instance"], "1");
    // Registered, not accepting connections: 502 upstream_connect, as the proxy answered.
    let unreachable = endpoint(11, dead_port);
    let resp = upstream
        .send(&unreachable, gateway_request(&unreachable, false), due())
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "upstream_connect");
    assert_eq!(engine.stats.requests(), 0);
    // The registered one still works.
    let registered = endpoint(INSTANCE, engine.port());
    let resp = upstream
        .send(&registered, gateway_request(&registered, false), due())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    worker.stop().await;
    srv.stop().await;
}

fn connect(target: &str, auth: &str) -> String {
    format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n")
}

fn completion(extra: &str) -> String {
    let body = r#"{"model":"mock-model","prompt":"hi"}"#;
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: engine\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test]
async fn the_worker_port_relays_only_to_registered_instances() {
    let (engine, proxy) = engine_and_proxy(MockEngineConfig::default()).await;
    let canary = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let canary_port = canary.local_addr().unwrap().port();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let task = {
        let (proxy, stop) = (proxy.clone(), stop.clone());
        tokio::spawn(async move { proxy.serve(listener, stop).await })
    };
    let auth = format!("Authorization: Bearer {WORKER_CRED}\r\n");
    let good = format!("model-{MODEL_ID}-{INSTANCE}.static:0");

    // The same credential check as every other request.
    for wrong in ["", "Authorization: Bearer nope\r\n"] {
        let (status, text) = raw(addr, &connect(&good, wrong)).await;
        assert_eq!(status, 401, "{wrong:?}: {text}");
    }
    // Anything but a relay target: refused as CONNECT always was.
    for target in [
        format!("127.0.0.1:{canary_port}"),
        format!("localhost:{canary_port}"),
        format!("[::1]:{canary_port}"),
        "10.0.0.5:10150".to_owned(),
        "192.168.1.10:80".to_owned(),
        "169.254.169.254:80".to_owned(),
        format!("model-{MODEL_ID}-{INSTANCE}.static:{canary_port}"),
        format!("model-{MODEL_ID}-{INSTANCE}.static:80"),
        format!("model-{MODEL_ID}-{INSTANCE}.static"),
        format!("Model-{MODEL_ID}-{INSTANCE}.static:0"),
    ] {
        let (status, text) = raw(addr, &connect(&target, &auth)).await;
        assert_eq!(status, 405, "{target}: {text}");
    }
    // Absolute-form stays refused.
    let (status, _) = raw(
        addr,
        &format!("GET http://127.0.0.1:{canary_port}/ HTTP/1.1\r\nHost: x\r\n{auth}X-GPUStack-Model-Instance: model-1-7.static\r\n\r\n"),
    )
    .await;
    assert_eq!(status, 400);
    // A well-formed name of an instance this worker does not host: the marked 404.
    let (status, text) = raw(addr, &connect("model-1-99.static:0", &auth)).await;
    assert_eq!(status, 404, "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("x-faden-no-such-instance: 1")
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(100), canary.accept())
            .await
            .is_err(),
        "something dialled the canary"
    );
    assert_eq!(engine.stats.connections(), 0);

    // The relay: 200, then HTTP/1.1 to the engine, kept alive.
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(connect(&good, "X-API-Key: worker-cred\r\n").as_bytes())
        .await
        .unwrap();
    let head = read_answer(&mut c).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    for _ in 0..2 {
        c.write_all(completion("").as_bytes()).await.unwrap();
        let answer = read_answer(&mut c).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("text_completion"), "{answer}");
    }
    assert_eq!(engine.stats.requests(), 2);
    assert_eq!(engine.stats.connections(), 1);
    drop(c);
    stop.cancel();
    tokio::time::timeout(T, task).await.unwrap().unwrap();
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
async fn the_proxy_port_relays_bytes_exactly_with_half_close() {
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
async fn the_proxy_port_refuses_bad_instance_relays() {
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
    tokio::time::timeout(Duration::from_secs(3), engine.stats.wait_disconnects(1))
        .await
        .expect("the engine did not see the disconnect");
    s.stop().await;
}

#[tokio::test]
async fn the_loadtest_goes_through_a_connect_proxy() {
    let (engine, handler) = worker_proxy(timed(4, 1)).await;
    let s = ProxySetup::start(handler).await;
    let mut config = RunConfig::new(
        format!("http://127.0.0.1:{}/v1", engine.port()),
        "mock-model",
    );
    config.load = LoadModel::Closed { concurrency: 2 };
    config.requests = Some(20);
    config.workloads = vec![Workload {
        kind: WorkloadKind::Chat,
        stream: true,
        max_tokens: 4,
        ..Default::default()
    }];
    config.connect_proxy = Some(ConnectProxy {
        addr: s.proxy.to_string(),
        target: Some(format!("model-{MODEL_ID}-{INSTANCE}.static:0")),
        auth: Some(KEY.to_owned()),
    });
    let report = faden_loadtest::run(config.clone()).await.unwrap();
    assert_eq!(report.ok, 20, "{report:?}");
    assert_eq!(report.error_total, 0);
    assert_eq!(engine.stats.requests(), 20);
    // Two load connections, each one relayed connection to the engine, kept alive.
    assert_eq!(engine.stats.connections(), 2);

    // A refused CONNECT is a connect error; nothing reaches the engine.
    config.requests = None;
    config.duration = Some(Duration::from_millis(300));
    config.connect_proxy.as_mut().unwrap().auth = Some("guess".to_owned());
    let report = faden_loadtest::run(config).await.unwrap();
    assert_eq!(report.ok, 0);
    assert!(report.errors.connect > 0, "{report:?}");
    assert_eq!(engine.stats.requests(), 20);
    s.stop().await;
}
