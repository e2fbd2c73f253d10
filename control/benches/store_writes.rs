//! Write throughput through the management API: instance updates (each one transaction with
//! its watch event), by 1 and by 16 concurrent writers, on SQLite, on PostgreSQL through one
//! server, and on PostgreSQL with the writers split over two servers (one database: writes are
//! serialised cluster-wide, see `control::store`). PostgreSQL is a private cluster started for
//! the run, with fsync off: this measures faden, not the disk.

// Benchmark setup: failing loudly is right.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use control::server::Server;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use serde_json::{Value, json};
use testkit::Client;

const WRITERS: usize = 16;

/// One writer: a worker client on some server and the instance it updates.
#[derive(Clone)]
struct Writer {
    worker: Client,
    path: String,
    model_id: i64,
}

/// A worker with [`WRITERS`] instances, registered through `servers[0]`; writer `i` writes
/// through `servers[i % len]`.
async fn writers(servers: &[&Server]) -> Vec<Writer> {
    let base = |s: &Server| format!("http://{}", s.api_addr);
    let admin = Client::new(base(servers[0])).with_token(&servers[0].admin_key);
    let cluster = admin
        .post("/v2/clusters", &json!({"name": "c"}))
        .await
        .json();
    let reg = admin.with_token(cluster["registration_token"].as_str().unwrap());
    let w = reg
        .post(
            "/v2/workers",
            &json!({"name": "w", "ip": "127.0.0.1", "proxy_mode": "direct"}),
        )
        .await
        .json();
    let token = w["token"].as_str().unwrap().to_owned();
    let model: Value = admin.post("/v2/models", &json!({"name": "m"})).await.json();
    let model_id = model["id"].as_i64().unwrap();
    let mut out = Vec::new();
    for i in 0..WRITERS {
        let worker = Client::new(base(servers[i % servers.len()])).with_token(&token);
        let inst = worker
            .post(
                "/v2/model-instances",
                &json!({"model_id": model_id, "port": 40000 + i, "state": "starting"}),
            )
            .await
            .json();
        out.push(Writer {
            worker,
            path: format!("/v2/model-instances/{}", inst["id"].as_i64().unwrap()),
            model_id,
        });
    }
    out
}

/// `writers[..n]` each make one update at once; every answer must be 200.
async fn round(writers: &[Writer], n: usize, flip: bool) {
    let mut set = tokio::task::JoinSet::new();
    for (i, w) in writers[..n].iter().cloned().enumerate() {
        let state = if flip { "running" } else { "starting" };
        set.spawn(async move {
            let body = json!({"model_id": w.model_id, "port": 40000 + i, "state": state});
            w.worker.put(&w.path, &body).await.expect(200);
        });
    }
    while let Some(done) = set.join_next().await {
        done.unwrap();
    }
}

fn bench(c: &mut Criterion) {
    let Some(bench) = common::Bench::new() else {
        return;
    };
    let (rt, pg, shutdown) = (&bench.rt, &bench.pg, &bench.shutdown);
    let start = |sub: &'static str, url: Option<String>| bench.server(sub, url);
    let setups = rt.block_on(async {
        let sqlite = start("sqlite", None).await;
        let one = start("one", Some(pg.url())).await;
        let two_db = pg.create_database("two").expect("database");
        let (a, b) = (
            start("a", Some(two_db.clone())).await,
            start("b", Some(two_db)).await,
        );
        let setups = [
            ("sqlite", writers(&[&sqlite]).await),
            ("postgres", writers(&[&one]).await),
            ("postgres_two_servers", writers(&[&a, &b]).await),
        ];
        // The servers run until the process ends.
        std::mem::forget((sqlite, one, a, b));
        setups
    });
    let mut group = c.benchmark_group("api_writes");
    for (name, writers) in &setups {
        for n in [1, WRITERS] {
            group.throughput(Throughput::Elements(n as u64));
            let mut flip = false;
            group.bench_with_input(BenchmarkId::new(*name, n), &n, |b, &n| {
                b.iter(|| {
                    flip = !flip;
                    rt.block_on(round(writers, n, flip));
                });
            });
        }
    }
    group.finish();
    shutdown.cancel();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(8));
    targets = bench
}
criterion_main!(benches);
