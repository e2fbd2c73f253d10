//! A real worker proxy in front of a mock engine, served on the streams of a tunnel as
//! `faden worker` serves it in tunnel mode. Used beside the tunnel's harness
//! (`tunnel/tests/common`, included as `common`), by `worker/tests` and `faden/tests`.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::service::service_fn;
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle};
use tunnel::http::{HttpHandler, ServeConfig};
use worker::proxy::{LocalInstances, WorkerProxy, WorkerProxyConfig};

use tokio::time::Instant;

use crate::common::{INSTANCE, T, WORKER_CRED};

/// A worker proxy in front of a mock engine hosting [`INSTANCE`], served over the tunnel as the
/// worker would: no listening socket of its own.
pub async fn worker_proxy(
    engine: MockEngineConfig,
) -> (MockEngineHandle, impl tunnel::http::StreamHandler) {
    let (engine, proxy) = engine_and_proxy(engine).await;
    (engine, serve_on_streams(proxy))
}

/// A mock engine, and a worker proxy (credential [`WORKER_CRED`]) hosting it as [`INSTANCE`].
pub async fn engine_and_proxy(engine: MockEngineConfig) -> (MockEngineHandle, WorkerProxy) {
    let engine = MockEngine::start(engine).await.unwrap();
    let instances = LocalInstances::new();
    instances.insert(INSTANCE, engine.port());
    let proxy = WorkerProxy::new(
        WorkerProxyConfig {
            credentials: vec![WORKER_CRED.to_owned()],
            ..Default::default()
        },
        instances,
    );
    (engine, proxy)
}

/// `proxy` served on every tunnel stream, as `faden worker` does in tunnel mode.
pub fn serve_on_streams(proxy: WorkerProxy) -> impl tunnel::http::StreamHandler {
    let peer: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let service = service_fn(move |req| {
        let proxy = proxy.clone();
        async move { Ok::<_, std::convert::Infallible>(proxy.handle(req, peer).await) }
    });
    HttpHandler::new(service, ServeConfig::default())
}

/// A mock engine's settings: `tokens` tokens per answer, `itl_ms` apart.
pub fn timed(tokens: usize, itl_ms: u64) -> MockEngineConfig {
    MockEngineConfig {
        tokens,
        inter_token_delay: Duration::from_millis(itl_ms),
        ..Default::default()
    }
}

/// Reads body frames with their arrival times.
pub async fn frames<B>(mut body: B) -> Vec<(Instant, Bytes)>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    let mut out = Vec::new();
    while let Some(frame) = tokio::time::timeout(T, body.frame()).await.unwrap() {
        if let Ok(data) = frame.unwrap().into_data() {
            out.push((Instant::now(), data));
        }
    }
    out
}
