//! Change → visible latency: from a management write (an instance turning `running`, acknowledged
//! by the API) until a sync client's published snapshot shows it, through the real watch stream
//! over loopback.

// Benchmark setup: failing loudly is right.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use control::api::ApiConfig;
use control::server::{ListenerLimits, Server, ServerConfig};
use control::sync::{self, SyncConfig};
use criterion::{Criterion, criterion_group, criterion_main};
use serde_json::json;
use testkit::Client;
use tokio_util::sync::CancellationToken;

fn bench(c: &mut Criterion) {
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("no runtime: {e}");
            return;
        }
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let shutdown = CancellationToken::new();
    let (admin, worker, model_id, inst_id, sync) = rt.block_on(async {
        let config = ServerConfig {
            data_dir: dir.path().to_owned(),
            database_url: None,
            proxy_address: None,
            api_addr: "127.0.0.1:0".parse().expect("addr"),
            admin_key: None,
            api: ApiConfig::default(),
            history: 10_000,
            shutdown_grace: Duration::from_secs(1),
            limits: ListenerLimits::default(),
            tls: None,
        };
        let server = Server::start(config, shutdown.clone())
            .await
            .expect("server");
        let admin =
            Client::new(format!("http://{}", server.api_addr)).with_token(&server.admin_key);
        let cluster = admin
            .post("/v2/clusters", &json!({"name": "c"}))
            .await
            .json();
        let reg = admin.with_token(cluster["registration_token"].as_str().expect("token"));
        let w = reg
            .post(
                "/v2/workers",
                &json!({"name": "w", "ip": "127.0.0.1", "proxy_mode": "direct"}),
            )
            .await
            .json();
        let worker = admin.with_token(w["token"].as_str().expect("token"));
        worker.post("/v2/worker-heartbeat", &json!({})).await;
        let model = admin.post("/v2/models", &json!({"name": "m"})).await.json();
        let model_id = model["id"].as_i64().expect("id");
        let inst = worker
            .post(
                "/v2/model-instances",
                &json!({"model_id": model_id, "port": 40000, "state": "starting"}),
            )
            .await
            .json();
        let key = admin
            .post(
                "/v2/api-keys",
                &json!({"name": "dp", "scope": "data_plane"}),
            )
            .await
            .json();
        let sync = sync::spawn(
            SyncConfig::new(
                format!("http://{}", server.api_addr),
                key["value"].as_str().expect("key"),
            ),
            shutdown.clone(),
        )
        .expect("sync");
        sync.wait_synced().await;
        std::mem::forget(server);
        (
            admin,
            worker,
            model_id,
            inst["id"].as_i64().expect("id"),
            sync,
        )
    });
    let _ = admin;
    let path = format!("/v2/model-instances/{inst_id}");
    let mut running = false;
    c.bench_function("change_to_snapshot_visible", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    running = !running;
                    let state = if running { "running" } else { "starting" };
                    let mut rx = sync.snapshots();
                    let start = Instant::now();
                    worker
                        .put(
                            &path,
                            &json!({"model_id": model_id, "port": 40000, "state": state}),
                        )
                        .await;
                    loop {
                        let visible = rx.borrow_and_update().routable("m").is_some();
                        if visible == running {
                            break;
                        }
                        if rx.changed().await.is_err() {
                            return total;
                        }
                    }
                    total += start.elapsed();
                }
                total
            })
        })
    });
    shutdown.cancel();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(10));
    targets = bench
}
criterion_main!(benches);
