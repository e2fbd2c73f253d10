#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]
//! The gateway's side of the instance relay: `CONNECT model-<m>-<i>.static:0` to the worker
//! proxy over the tunnel streams of the gateway's transport, and the load generator through a
//! proxy port. The relay on the proxy port alone is in `worker/tests/instance_relay.rs`, on the
//! worker port in `worker/tests/proxy.rs`.

// The tunnel crate's own harness (server, workers, worker proxies), shared rather than copied.
#[path = "../../worker/tests/behind_tunnel/mod.rs"]
mod behind_tunnel;
#[path = "../../tunnel/tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use behind_tunnel::*;
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
use tokio::net::TcpListener;
use tokio::time::Instant;
use tunnel::http::{HttpHandler, ServeConfig};
use worker::proxy::WorkerProxy;

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
    tokio::time::timeout(T, engine.stats.wait_disconnects(1))
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
    let got = frames(resp.into_body()).await;
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
    tokio::time::timeout(T, engine.stats.wait_disconnects(1))
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
async fn a_worker_that_refuses_the_relay_is_answered_as_it_said() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let (engine, proxy) = engine_and_proxy(timed(3, 1)).await;
    let refusals = Arc::new(AtomicUsize::new(0));
    // A worker proxy answering 405 to the relay's CONNECT: no other way is tried (every faden
    // worker relays), and its answer is the request's.
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
    for stream in [false, true] {
        let resp = upstream
            .send(&ep, gateway_request(&ep, stream), due())
            .await
            .unwrap();
        assert_eq!(resp.status(), 405);
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(refusals.load(Ordering::SeqCst), 2);
    assert_eq!(engine.stats.requests(), 0);
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
