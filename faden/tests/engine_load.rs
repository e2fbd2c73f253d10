//! The engines' load from end to end with the real binaries: a `faden worker` reads a mock
//! engine's vLLM-named metrics and streams them to a `faden server`, whose table (and a
//! standalone gateway's copy) follows the engine's queue; an engine without metrics is served
//! and left alone; a killed worker's readings go stale and leave the table.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use control_client::engine_load::EngineLoads;
use control_client::sync::SyncConfig;
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle, PerfModel};
use serde_json::{Value, json};
use testkit::Client;
use testkit::process::start_faden_server;
use testkit::wait::{wait_until, wait_until_async};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use common::{bin, provision, standalone_gateway, start_worker, stop};

const LIMIT: Duration = Duration::from_secs(10);

/// An engine that serves chats and has no `/metrics` (404), counting the reads of it.
async fn plain_engine() -> (u16, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let metrics_reads = Arc::new(AtomicU64::new(0));
    let counted = metrics_reads.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: http::Request<_>| {
                    let (status, body) = match req.uri().path() {
                        "/metrics" => {
                            counted.fetch_add(1, Ordering::Relaxed);
                            (404, String::new())
                        }
                        "/v1/models" | "/health" => (200, r#"{"data":[]}"#.to_owned()),
                        _ => (
                            200,
                            json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": "plain"}}]})
                                .to_string(),
                        ),
                    };
                    async move {
                        http::Response::builder()
                            .status(status)
                            .header("content-type", "application/json")
                            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    (port, metrics_reads)
}

fn send_chats(engine: &MockEngineHandle, n: usize) {
    for _ in 0..n {
        let client = Client::new(format!("http://{}", engine.addr));
        tokio::spawn(async move {
            let body = json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}]});
            let _ = client.try_post("/v1/chat/completions", &body).await;
        });
    }
}

/// The server's reading of `instance`, if it has a fresh one.
async fn served_reading(reader: &Client, instance: i64) -> Option<Value> {
    let table = reader.get("/v2/worker-load").await.json();
    table["readings"]
        .as_array()?
        .iter()
        .find(|r| r["id"] == instance)
        .cloned()
}

#[tokio::test]
async fn engine_load_travels_from_the_engine_to_every_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_faden_server(bin(), &dir.path().join("server"), [0; 3], &[], &[]).await;
    let admin = &server.admin;
    let (registration, key) = provision(admin).await;
    admin
        .post("/v2/models", &json!({"name": "plain"}))
        .await
        .expect(200);
    let engine = MockEngine::start(MockEngineConfig {
        model: "demo".into(),
        tokens: 2,
        perf: Some(PerfModel {
            kv_blocks: 256,
            max_running: 2,
            ..PerfModel::default()
        }),
        ..MockEngineConfig::default()
    })
    .await
    .unwrap();
    let (plain, plain_reads) = plain_engine().await;
    let worker_dir = dir.path().join("worker");
    let args: Vec<String> = [
        "worker",
        "--server-url",
        &server.api_url(),
        "--token",
        &registration,
        "--proxy-mode",
        "direct",
        "--worker-ip",
        "127.0.0.1",
        "--worker-port",
        "0",
        "--disable-worker-metrics",
        "--instance",
        &format!("demo={}", engine.port()),
        "--instance",
        &format!("plain={plain}"),
        "--data-dir",
        worker_dir.to_str().unwrap(),
        "--probe-interval",
        "200ms",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let (mut worker, _) = start_worker(&args).await;

    // A reader of the table, and a standalone gateway's copy of it (what `faden gateway` runs).
    let dp = admin
        .post(
            "/v2/api-keys",
            &json!({"name": "reader", "scope": "data_plane"}),
        )
        .await
        .expect(200)
        .json();
    let reader = admin.with_token(dp["value"].as_str().unwrap());
    let followed = EngineLoads::new();
    let cancel = CancellationToken::new();
    control_client::engine_load::follow::follow(
        &SyncConfig::new(server.api_url(), dp["value"].as_str().unwrap()),
        followed.clone(),
        cancel.clone(),
    )
    .unwrap();
    let (mut gateway, gateway_addr) = standalone_gateway(admin, &server.api_url(), &[]).await;

    wait_until_async(LIMIT, "both instances reported", || async {
        admin.get("/v2/model-instances?page=-1").await.json()["items"]
            .as_array()
            .is_some_and(|items| items.len() == 2)
    })
    .await;
    let instances = admin.get("/v2/model-instances?page=-1").await.json();
    let id_of = |model: &str| {
        instances["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["model_name"] == model)
            .unwrap()["id"]
            .as_i64()
            .unwrap()
    };
    let (demo, plain_id) = (id_of("demo"), id_of("plain"));
    wait_until_async(LIMIT, "the server's first reading", || async {
        served_reading(&reader, demo).await.is_some()
    })
    .await;
    let first = served_reading(&reader, demo).await.unwrap();
    assert_eq!(first["block_size"], 16);
    assert_eq!(first["num_blocks"], 256);

    // The engine stalls and its queue grows: the server's table follows, then the copies.
    engine.stall();
    send_chats(&engine, 6);
    engine.wait_model_stats(|s| s.waiting == 6).await;
    let queued = Instant::now();
    wait_until_async(LIMIT, "the server sees the queue", || async {
        served_reading(&reader, demo)
            .await
            .is_some_and(|r| r["waiting"] == 6)
    })
    .await;
    let at_server = queued.elapsed();
    wait_until(LIMIT, "the followed table sees the queue", || {
        followed
            .get(demo, Instant::now())
            .is_some_and(|r| r.load.waiting == 6)
    })
    .await;
    let at_follower = queued.elapsed();
    // Figures, not bounds: the machine is shared (the reading interval is 100 ms).
    eprintln!(
        "a queue of 6 showed at the server after {at_server:?}, at a follower after {at_follower:?}"
    );
    let gateway_client = Client::new(format!("http://{gateway_addr}"));
    let gauge = format!("faden_engine_requests_waiting{{instance=\"{demo}\"}} 6");
    wait_until_async(LIMIT, "the standalone gateway's gauge", || async {
        gateway_client
            .get("/metrics")
            .await
            .text()
            .lines()
            .any(|l| l == gauge)
    })
    .await;
    let server_gateway = Client::new(format!("http://{}", server.gateway));
    wait_until_async(LIMIT, "the server's gateway's gauge", || async {
        server_gateway
            .get("/metrics")
            .await
            .text()
            .lines()
            .any(|l| l == gauge)
    })
    .await;
    engine.resume();

    // The engine without metrics is served, has no reading and is read only now and then:
    // the other engine's reads are the clock (30 are about 3 s).
    let user = Client::new(format!("http://{}", server.gateway)).with_token(&key);
    let chat = json!({"model": "plain", "messages": [{"role": "user", "content": "hi"}]});
    wait_until_async(LIMIT, "the plain engine served", || async {
        user.try_post("/v1/chat/completions", &chat)
            .await
            .is_some_and(|r| r.status == 200)
    })
    .await;
    let clock = engine.stats.scrapes();
    wait_until(LIMIT, "30 more reads of the engine with metrics", || {
        engine.stats.scrapes() >= clock + 30
    })
    .await;
    let reads = plain_reads.load(Ordering::Relaxed);
    assert!(
        (1..=u64::from(worker::engine_load::SLOW_AFTER) + 1).contains(&reads),
        "the page that is not there was read {reads} times"
    );
    assert!(served_reading(&reader, plain_id).await.is_none());

    // The worker dies: its readings go stale and leave the tables.
    let killed = Instant::now();
    stop(&mut worker).await;
    wait_until_async(LIMIT, "the reading gone from the server", || async {
        served_reading(&reader, demo).await.is_none()
    })
    .await;
    let at_server = killed.elapsed();
    wait_until(LIMIT, "the reading gone from the follower", || {
        followed.get(demo, Instant::now()).is_none()
    })
    .await;
    eprintln!("a killed worker's reading left the server's table {at_server:?} after the kill");
    let gone = killed.elapsed();
    eprintln!("and a follower's copy {gone:?} after it");
    assert!(gone >= Duration::from_secs(1), "gone only once stale");
    cancel.cancel();
    stop(&mut gateway).await;
}
