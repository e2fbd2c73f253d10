//! W3C trace context from the client through the gateway to the engine, on the direct and the
//! worker path (the tunnel path: `tunnel_e2e.rs`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use common::*;
use gateway::GatewayConfig;
use http::Request;
use http_body_util::Full;
use mock_engine::{MockEngine, MockEngineConfig};
use worker::proxy::{LocalInstances, WorkerProxy, WorkerProxyConfig};

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// `req` with `traceparent` (and `tracestate`) headers.
fn with_trace(
    mut req: Request<Full<bytes::Bytes>>,
    parent: &str,
    state: Option<&str>,
) -> Request<Full<bytes::Bytes>> {
    req.headers_mut()
        .insert("traceparent", parent.parse().unwrap());
    if let Some(state) = state {
        req.headers_mut()
            .insert("tracestate", state.parse().unwrap());
    }
    req
}

/// The `traceparent` the engine last saw, split: version, trace id, parent span id, flags.
fn seen_parent(engine: &mock_engine::MockEngineHandle) -> (Vec<String>, Option<String>) {
    let seen = engine.stats.last_request().unwrap();
    let all: Vec<_> = seen.headers.get_all("traceparent").iter().collect();
    assert_eq!(all.len(), 1, "{:?}", seen.headers);
    let parts = all[0]
        .to_str()
        .unwrap()
        .split('-')
        .map(str::to_owned)
        .collect::<Vec<_>>();
    assert_eq!(parts.len(), 4, "{parts:?}");
    assert_eq!(parts[0], "00");
    assert_eq!(parts[1].len(), 32);
    assert_eq!(parts[2].len(), 16);
    let state = seen
        .headers
        .get("tracestate")
        .map(|v| v.to_str().unwrap().to_owned());
    (parts, state)
}

/// The three cases on one gateway: the client's trace kept (with a new parent span and the
/// client's state and flags), a new sampled trace without one, and a new trace for a
/// malformed one.
async fn check_propagation(h: &Harness, engine: &mock_engine::MockEngineHandle) {
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    for stream in [true, false] {
        let req = with_trace(h.chat(stream), &parent, Some("vendor=v1,faden=x"));
        let resp = send(h.addr, req).await;
        assert_eq!(resp.status(), 200);
        body_bytes(resp).await;
        let (parts, state) = seen_parent(engine);
        assert_eq!(parts[1], CLIENT_TRACE);
        assert_ne!(
            parts[2], CLIENT_SPAN,
            "the gateway's span is the engine's parent"
        );
        assert_eq!(parts[3], "01");
        assert_eq!(state.as_deref(), Some("vendor=v1,faden=x"));
    }

    // Not sampled by the client: passed on as such.
    let req = with_trace(
        h.chat(true),
        &format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"),
        None,
    );
    body_bytes(send(h.addr, req).await).await;
    let (parts, state) = seen_parent(engine);
    assert_eq!((parts[1].as_str(), parts[3].as_str()), (CLIENT_TRACE, "00"));
    assert_eq!(state, None);

    // None: a new trace, sampled, a new one per request.
    body_bytes(send(h.addr, h.chat(true)).await).await;
    let (first, _) = seen_parent(engine);
    body_bytes(send(h.addr, h.chat(true)).await).await;
    let (second, _) = seen_parent(engine);
    assert_eq!(first[3], "01");
    assert_ne!(first[1], second[1]);
    assert_ne!(first[1], "0".repeat(32));

    // Malformed (upper case): a new trace, the client's state dropped with it.
    let req = with_trace(
        h.chat(true),
        &format!("00-{}-{CLIENT_SPAN}-01", CLIENT_TRACE.to_uppercase()),
        Some("vendor=v1"),
    );
    body_bytes(send(h.addr, req).await).await;
    let (parts, state) = seen_parent(engine);
    assert_ne!(parts[1], CLIENT_TRACE);
    assert_ne!(parts[1].to_uppercase(), CLIENT_TRACE.to_uppercase());
    assert_eq!(state, None);
}

#[tokio::test]
async fn trace_context_reaches_the_engine_direct() {
    let engine = MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap();
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, engine.port())]).await;
    check_propagation(&h, &engine).await;
    h.stop().await;
}

#[tokio::test]
async fn trace_context_crosses_the_worker_proxy() {
    let engine = MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap();
    let instances = LocalInstances::new();
    instances.insert(1, engine.port());
    let proxy = WorkerProxy::new(
        WorkerProxyConfig {
            credentials: vec!["worker-secret".to_owned()],
            ..Default::default()
        },
        instances,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let worker_port = listener.local_addr().unwrap().port();
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    let proxy_task = tokio::spawn(async move { proxy.serve(listener, s).await });
    let config = GatewayConfig {
        worker_credential: Some("worker-secret".into()),
        ..Default::default()
    };
    let h = Harness::start(config, &[Inst::worker(1, engine.port(), worker_port)]).await;
    check_propagation(&h, &engine).await;
    h.stop().await;
    stop.cancel();
    proxy_task.await.unwrap();
}
