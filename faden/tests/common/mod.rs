//! What the process-level suites share: the `faden` binary, a provisioned cluster, mock
//! engines, `faden worker` processes and chat requests over fresh connections.

#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle};
use serde_json::json;
use testkit::Client;
use testkit::process::{Running, start};
use tokio::net::TcpStream;
use tokio::time::Instant;

pub const T: Duration = Duration::from_secs(10);

pub fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_faden"))
}

/// A cluster, model `demo` and an inference key; returns (registration token, key).
pub async fn provision(admin: &Client) -> (String, String) {
    let cluster = admin
        .post("/v2/clusters", &json!({"name": "c"}))
        .await
        .expect(200)
        .json();
    admin
        .post("/v2/models", &json!({"name": "demo"}))
        .await
        .expect(200);
    let key = admin
        .post("/v2/api-keys", &json!({"name": "user"}))
        .await
        .expect(200)
        .json();
    (
        cluster["registration_token"].as_str().unwrap().to_owned(),
        key["value"].as_str().unwrap().to_owned(),
    )
}

pub async fn engine(tokens: usize, itl_ms: u64, bytes_per_token: usize) -> MockEngineHandle {
    MockEngine::start(MockEngineConfig {
        model: "demo".into(),
        tokens,
        inter_token_delay: Duration::from_millis(itl_ms),
        bytes_per_token,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// The arguments of a `faden worker` serving `engine_port` as model `demo`.
pub fn worker_args(
    server_url: &str,
    token: &str,
    mode: &str,
    engine_port: u16,
    dir: &Path,
) -> Vec<String> {
    [
        "worker",
        "--server-url",
        server_url,
        "--token",
        token,
        "--proxy-mode",
        mode,
        "--worker-ip",
        "127.0.0.1",
        "--worker-port",
        "0",
        "--disable-worker-metrics",
        "--instance",
        &format!("demo={engine_port}"),
        "--data-dir",
        dir.to_str().unwrap(),
        "--probe-interval",
        "200ms",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

pub async fn start_worker(args: &[String]) -> (Running, String) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    start(bin(), &args, &[], "faden worker ready", "worker_id").await
}

pub async fn stop(running: &mut Running) {
    let _ = running.child.start_kill();
    let _ = running.child.wait().await;
}

/// A chat request to `addr` on a fresh HTTP/1.1 connection; the answer with its body still
/// streaming.
pub async fn chat(
    addr: SocketAddr,
    key: &str,
    stream: bool,
    max_tokens: Option<usize>,
) -> Option<http::Response<Incoming>> {
    let mut body = json!({"model": "demo", "stream": stream,
        "messages": [{"role": "user", "content": "hi"}]});
    if let Some(n) = max_tokens {
        body["max_tokens"] = json!(n);
    }
    chat_body(addr, key, body).await
}

/// A chat request with `body` to `addr` on a fresh HTTP/1.1 connection; the answer with its
/// body still streaming.
pub async fn chat_body(
    addr: SocketAddr,
    key: &str,
    body: serde_json::Value,
) -> Option<http::Response<Incoming>> {
    let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    tokio::time::timeout(T, async {
        let tcp = TcpStream::connect(addr).await.ok()?;
        tcp.set_nodelay(true).ok()?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
                .await
                .ok()?;
        tokio::spawn(conn);
        sender.send_request(req).await.ok()
    })
    .await
    .ok()
    .flatten()
}

/// Whether a short request through `addr` with `key` succeeds now.
pub async fn serves(addr: SocketAddr, key: &str) -> bool {
    let Some(resp) = chat(addr, key, true, Some(2)).await else {
        return false;
    };
    if resp.status() != 200 {
        return false;
    }
    let mut body = resp.into_body();
    let mut text = String::new();
    drain_body(&mut body, &mut text).await && text.ends_with("data: [DONE]\n\n")
}

/// Polls until a short request succeeds; the time it took, or `None` after `limit`.
pub async fn wait_serving(addr: SocketAddr, key: &str, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if serves(addr, key).await {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Reads a body to its end or its first error: whether it ended cleanly.
pub async fn drain_body(body: &mut Incoming, text: &mut String) -> bool {
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

/// A standalone `faden gateway` synced from `server_url` (one or a comma-separated list) with a
/// new data-plane key made through `admin`, with `envs` set.
pub async fn standalone_gateway(
    admin: &Client,
    server_url: &str,
    envs: &[(&str, &str)],
) -> (Running, SocketAddr) {
    let dp = admin
        .post(
            "/v2/api-keys",
            &json!({"name": "standalone", "scope": "data_plane"}),
        )
        .await
        .expect(200)
        .json();
    let (running, gw) = start(
        bin(),
        &[
            "gateway",
            "--server-url",
            server_url,
            "--token",
            dp["value"].as_str().unwrap(),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ],
        envs,
        "faden gateway ready",
        "gateway",
    )
    .await;
    (running, gw.parse().unwrap())
}
