//! The gateway's worker path through a real worker proxy, in one process: the credential and
//! instance header on the way, the proxy's marked 404 retried on another instance, one kept-alive
//! connection from the proxy to the engine, a client that leaves cancelling the engine's work
//! through both hops, and a gateway without the worker credential saying why it cannot use the
//! path. The worker proxy on its own is tested in `worker/tests/proxy.rs`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

// The gateway crate's harness (a gateway on 127.0.0.1:0 fed snapshots by the test).
#[path = "../../gateway/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::*;
use gateway::GatewayConfig;
use http_body_util::BodyExt;
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle};
use worker::proxy::{LocalInstances, WorkerProxy, WorkerProxyConfig};

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

struct WorkerSetup {
    addr: std::net::SocketAddr,
    instances: LocalInstances,
    stop: tokio_util::sync::CancellationToken,
}

async fn worker_proxy(credential: &str) -> WorkerSetup {
    let instances = LocalInstances::new();
    let proxy = WorkerProxy::new(
        WorkerProxyConfig {
            credentials: vec![credential.to_owned()],
            ..Default::default()
        },
        instances.clone(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move { proxy.serve(listener, s).await });
    WorkerSetup {
        addr,
        instances,
        stop,
    }
}

#[tokio::test]
async fn worker_path_through_the_worker_proxy() {
    let e = engine(timed(4, 0, 5)).await;
    let w = worker_proxy("worker-secret").await;
    w.instances.insert(1, e.port());
    let config = GatewayConfig {
        worker_credential: Some("worker-secret".into()),
        ..Default::default()
    };
    // Instance 2 is routed to the worker but not registered there: the proxy's 404 is retried.
    let h = Harness::start(
        config,
        &[
            Inst::worker(1, e.port(), w.addr.port()),
            Inst::worker(2, 1, w.addr.port()),
        ],
    )
    .await;
    for i in 0..10 {
        let stream = i % 2 == 0;
        let resp = send(h.addr, h.chat(stream)).await;
        assert_eq!(resp.status(), 200);
        let body = body_bytes(resp).await;
        if stream {
            assert!(body.ends_with(b"data: [DONE]\n\n"));
        } else {
            assert!(body.starts_with(b"{"));
        }
    }
    assert_eq!(e.stats.requests(), 10);
    // Sequential requests, streamed (chunked) and not (Content-Length): the worker proxy
    // keeps its one connection to the engine.
    assert_eq!(
        e.stats.connections(),
        1,
        "the worker proxy did not reuse its connection"
    );
    let seen = e.stats.last_request().unwrap();
    assert!(!seen.headers.contains_key("authorization"));
    assert!(!seen.headers.contains_key("x-gpustack-model-instance"));
    assert_eq!(seen.uri, "/v1/chat/completions");

    // The worker proxy on its own (credentials, instances, methods): worker/tests/proxy.rs.

    // A client that goes away cancels the engine's work through both hops.
    let slow = engine(timed(50, 300, 50)).await;
    w.instances.insert(1, slow.port());
    let resp = send(h.addr, h.chat(true)).await;
    let mut body = resp.into_body();
    let _first = tokio::time::timeout(T, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    drop(body);
    tokio::time::timeout(T, slow.stats.wait_disconnects(1))
        .await
        .unwrap();

    // A gateway without the worker credential cannot use the worker path, and says why.
    let h2 = Harness::start(
        GatewayConfig::default(),
        &[Inst::worker(1, e.port(), w.addr.port())],
    )
    .await;
    assert_error(
        send(h2.addr, h2.chat(false)).await,
        502,
        "no_worker_credential",
    )
    .await;
    h.stop().await;
    h2.stop().await;
    w.stop.cancel();
}
