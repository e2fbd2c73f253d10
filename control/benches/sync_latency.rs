//! Change → visible latency: from a management write (an instance turning `running`, acknowledged
//! by the API) until a sync client's published snapshot shows it, through the real watch stream
//! over loopback. Three set-ups: one server on SQLite; one on PostgreSQL; and the write made
//! through server A while the sync client watches server C on the same PostgreSQL database (the
//! change reaches C through its tailer). PostgreSQL is a private cluster started for the run.

// Benchmark setup: failing loudly is right.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use control_client::sync::{self, SyncConfig, SyncHandle};
use criterion::{Criterion, criterion_group, criterion_main};
use serde_json::json;
use testkit::Client;
use tokio_util::sync::CancellationToken;

/// A worker with one instance of model `m`, written through `write`, and a sync client of
/// `watch` that sees it.
struct Rig {
    worker: Client,
    model_id: i64,
    path: String,
    sync: SyncHandle,
}

async fn rig(
    write: SocketAddr,
    watch: SocketAddr,
    admin_key: &str,
    shutdown: &CancellationToken,
) -> Rig {
    let admin = Client::new(format!("http://{write}")).with_token(admin_key);
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
            format!("http://{watch}"),
            key["value"].as_str().expect("key"),
        ),
        shutdown.clone(),
    )
    .expect("sync");
    sync.wait_synced().await;
    Rig {
        worker,
        model_id,
        path: format!("/v2/model-instances/{}", inst["id"].as_i64().expect("id")),
        sync,
    }
}

/// Flips the instance between `running` and `starting` and times each flip until the sync
/// client's snapshot agrees.
fn measure(c: &mut Criterion, rt: &tokio::runtime::Runtime, name: &str, rig: &Rig) {
    let mut running = false;
    c.bench_function(name, |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    running = !running;
                    let state = if running { "running" } else { "starting" };
                    let mut rx = rig.sync.snapshots();
                    let start = Instant::now();
                    rig.worker
                        .put(
                            &rig.path,
                            &json!({"model_id": rig.model_id, "port": 40000, "state": state}),
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
}

fn bench(c: &mut Criterion) {
    let Some(bench) = common::Bench::new() else {
        return;
    };
    let (rt, pg, shutdown) = (&bench.rt, &bench.pg, &bench.shutdown);
    let start = |sub: &'static str, url: Option<String>| bench.server(sub, url);
    let rigs = rt.block_on(async {
        let sqlite = start("sqlite", None).await;
        let a = start("a", Some(pg.url())).await;
        let on_sqlite = rig(
            sqlite.api_addr,
            sqlite.api_addr,
            &sqlite.admin_key,
            shutdown,
        )
        .await;
        let on_postgres = rig(a.api_addr, a.api_addr, &a.admin_key, shutdown).await;
        // The same rows again would clash: the cross-server rig gets its own database.
        let other = pg.create_database("other").expect("database");
        let a2 = start("a2", Some(other.clone())).await;
        let c2 = start("c2", Some(other)).await;
        let across = rig(a2.api_addr, c2.api_addr, &a2.admin_key, shutdown).await;
        // The servers run until the process ends.
        std::mem::forget((sqlite, a, a2, c2));
        [on_sqlite, on_postgres, across]
    });
    measure(c, rt, "change_to_snapshot_visible/sqlite", &rigs[0]);
    measure(c, rt, "change_to_snapshot_visible/postgres", &rigs[1]);
    measure(
        c,
        rt,
        "change_to_snapshot_visible/postgres_other_server",
        &rigs[2],
    );
    shutdown.cancel();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(10));
    targets = bench
}
criterion_main!(benches);
