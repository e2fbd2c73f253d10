//! Several `faden server` processes on one real PostgreSQL (a private cluster per test): a change
//! through one server reaches another's routing, tunnel workers are served through every
//! server's gateway and a standalone one, the elected heartbeat monitor moves when its server is
//! killed, and a server killed under load loses no acknowledged write while its workers come
//! back through another server. Each test prints what it measured (`--no-capture`; the figures
//! are in docs/operations.md and docs/benchmarks.md).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use testkit::Client;
use testkit::postgres::Postgres;
use testkit::process::{FadenServer, start_faden_server};
use tokio::time::Instant;

/// The marker of the elected monitor's log line (see `control::store::lease`).
const ELECTED: &str = "this server now runs it";

/// `n` servers on one fresh database, started one after the other.
async fn servers(pg: &Postgres, dir: &Path, n: usize, extra: &[&str]) -> Vec<FadenServer> {
    let url = pg.url();
    let mut args = vec!["--database-url", url.as_str()];
    args.extend_from_slice(extra);
    let mut out = Vec::new();
    for i in 0..n {
        let data = dir.join(format!("server-{i}"));
        out.push(start_faden_server(bin(), &data, [0; 3], &args, &[]).await);
    }
    out
}

fn proxy_url(server: &FadenServer) -> String {
    let proxy = server
        .running
        .log_field("faden server ready", "proxy")
        .unwrap();
    format!("http://{proxy}")
}

async fn worker_record(admin: &Client, worker_id: &str) -> Value {
    admin
        .get(&format!("/v2/workers/{worker_id}"))
        .await
        .expect(200)
        .json()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// An instance turned `running` (or back) through server A, measured 60 times from A's
/// acknowledgement until server C's gateway lists (or stops listing) its model. Each change must
/// arrive within `T`; the p50 and p99 are printed, not asserted (a loaded machine stretches
/// them, and docs/operations.md reports them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_through_one_server_reaches_another_servers_routing() {
    let dir = tempfile::tempdir().unwrap();
    let pg = Postgres::start().unwrap();
    let s = servers(&pg, dir.path(), 3, &[]).await;
    let (a, c) = (&s[0], &s[2]);
    let (reg, key) = provision(&a.admin).await;
    // A worker made through the API (nothing dials it: listing a model does not).
    let registered = a
        .admin
        .with_token(&reg)
        .post(
            "/v2/workers",
            &json!({"name": "w", "ip": "127.0.0.1", "proxy_mode": "direct"}),
        )
        .await
        .expect(200)
        .json();
    let worker = a.admin.with_token(registered["token"].as_str().unwrap());
    worker
        .post("/v2/worker-heartbeat", &json!({}))
        .await
        .expect(204);
    let model = a.admin.get("/v2/models").await.expect(200).json()["items"][0].clone();
    let body = |state: &str| json!({"model_id": model["id"], "port": 40000, "state": state});
    let inst = worker
        .post("/v2/model-instances", &body("starting"))
        .await
        .expect(200)
        .json();
    let path = format!("/v2/model-instances/{}", inst["id"]);
    let listed = Client::new(format!("http://{}", c.gateway)).with_token(&key);
    let mut took = Vec::new();
    for i in 0..60 {
        let running = i % 2 == 0;
        worker
            .put(&path, &body(if running { "running" } else { "starting" }))
            .await
            .expect(200);
        let acked = Instant::now();
        loop {
            let models = listed.get("/v1/models").await.expect(200).json();
            let shown = models["data"].as_array().is_some_and(|d| !d.is_empty());
            if shown == running {
                break;
            }
            assert!(acked.elapsed() < T, "change {i} never reached server C");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        took.push(acked.elapsed());
    }
    took.sort();
    let (p50, p99) = (percentile(&took, 0.5), percentile(&took, 0.99));
    println!(
        "change through A -> C's gateway routes by it: p50 {p50:?}, p99 {p99:?}, max {:?}",
        took[took.len() - 1]
    );
}

/// A tunnel worker whose tunnel ends on server A is served through B's and C's gateways (one
/// hop through A's proxy port) and through a standalone gateway synced from C; started again
/// against B, its tunnel (and the record of its owner) moves to B and every gateway follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_workers_are_served_through_every_gateway_via_their_owner() {
    let dir = tempfile::tempdir().unwrap();
    let pg = Postgres::start().unwrap();
    let s = servers(&pg, dir.path(), 3, &[]).await;
    let (reg, key) = provision(&s[0].admin).await;
    let engine = engine(3, 0, 0).await;
    let mut args = worker_args(
        &s[0].api_url(),
        &reg,
        "tunnel",
        engine.port(),
        &dir.path().join("worker"),
    );
    let (mut worker, worker_id) = start_worker(&args).await;
    let (mut standalone, gw) = standalone_gateway(&s[2].admin, &s[2].api_url(), &[]).await;
    let gateways = [s[0].gateway, s[1].gateway, s[2].gateway, gw];
    for addr in gateways {
        wait_serving(addr, &key, T)
            .await
            .unwrap_or_else(|| panic!("gateway {addr} never served the tunnel worker"));
    }
    let record = worker_record(&s[2].admin, &worker_id).await;
    assert_eq!(record["proxy_address"], proxy_url(&s[0]));

    stop(&mut worker).await;
    args[2] = s[1].api_url();
    let (mut again, _) = start_worker(&args).await;
    let owner = proxy_url(&s[1]);
    testkit::wait_until_async(T, "the tunnel recorded on server B", || {
        let (admin, id, owner) = (s[0].admin.clone(), worker_id.clone(), owner.clone());
        async move { worker_record(&admin, &id).await["proxy_address"] == owner }
    })
    .await;
    for addr in gateways {
        for _ in 0..5 {
            assert!(serves(addr, &key).await, "gateway {addr} after the move");
        }
    }
    stop(&mut again).await;
    stop(&mut standalone).await;
}

/// The server that runs the heartbeat monitor is killed: another takes the role within about a
/// second, and a worker that then stops heartbeating is marked `not_ready` by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_monitor_moves_when_its_server_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let pg = Postgres::start().unwrap();
    let mut s = servers(&pg, dir.path(), 3, &["--worker-heartbeat-timeout", "1s"]).await;
    let elected = |s: &[FadenServer]| -> Vec<usize> {
        (0..s.len())
            .filter(|&i| s[i].running.printed(ELECTED))
            .collect()
    };
    testkit::wait_until(T, "one server elected", || elected(&s).len() == 1).await;
    let leader = elected(&s)[0];
    s[leader].kill().await;
    let killed = Instant::now();
    let others: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    testkit::wait_until(T, "another server elected", || {
        others.iter().any(|&i| s[i].running.printed(ELECTED))
    })
    .await;
    let moved = killed.elapsed();
    let survivors: Vec<usize> = others
        .iter()
        .copied()
        .filter(|&i| s[i].running.printed(ELECTED))
        .collect();
    assert_eq!(survivors.len(), 1, "exactly one survivor runs the monitor");
    // Within `T` (the wait above): PostgreSQL frees the dead server's lock with its connection.
    println!("heartbeat monitor moved {moved:?} after its server was killed");

    // It does the work: a worker that stops heartbeating becomes not_ready.
    let alive = &s[others[0]];
    let (reg, _) = provision(&alive.admin).await;
    let engine = engine(2, 0, 0).await;
    let args = worker_args(
        &alive.api_url(),
        &reg,
        "direct",
        engine.port(),
        &dir.path().join("worker"),
    );
    let (mut worker, worker_id) = start_worker(&args).await;
    testkit::wait_until_async(T, "the worker ready", || {
        let (admin, id) = (alive.admin.clone(), worker_id.clone());
        async move { worker_record(&admin, &id).await["state"] == "ready" }
    })
    .await;
    stop(&mut worker).await;
    testkit::wait_until_async(T, "the silent worker not_ready", || {
        let (admin, id) = (alive.admin.clone(), worker_id.clone());
        async move { worker_record(&admin, &id).await["state"] == "not_ready" }
    })
    .await;
}

/// What one client loop saw: `(since the kill, status)` per request (`None`: no answer).
type Seen = Vec<(Option<Duration>, Option<u16>)>;

/// Sends short chats through `addr` until `stop`; the time of each relative to `killed` once
/// that is set.
fn client_loop(
    addr: SocketAddr,
    key: String,
    stop: tokio_util::sync::CancellationToken,
    killed: std::sync::Arc<std::sync::OnceLock<Instant>>,
) -> tokio::task::JoinHandle<Seen> {
    tokio::spawn(async move {
        let mut seen = Seen::new();
        while !stop.is_cancelled() {
            let status = chat(addr, &key, false, Some(2))
                .await
                .map(|r| r.status().as_u16());
            seen.push((killed.get().map(|k| k.elapsed()), status));
            if status != Some(200) {
                // A dead gateway refuses at once: do not spin on it.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        seen
    })
}

/// Creates API keys through `admin` until `stop` or a failure; the names acknowledged.
fn writer_loop(
    admin: Client,
    prefix: String,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let mut acked = Vec::new();
        for i in 0.. {
            if stop.is_cancelled() {
                break;
            }
            let name = format!("{prefix}-{i}");
            let reply = tokio::time::timeout(
                Duration::from_secs(10),
                admin.try_post("/v2/api-keys", &json!({"name": name})),
            )
            .await;
            match reply {
                Ok(Some(r)) if r.status == 200 => acked.push(name),
                _ => break,
            }
        }
        acked
    })
}

/// Three servers on one database, a tunnel worker on each (each lists the three servers,
/// starting with its own), writers on all three servers. The one that runs the heartbeat
/// monitor, X, is killed with `kill -9` under load from clients on every server's gateway and on
/// a standalone gateway synced from X first (the clients of X's own gateway fail with it): no acknowledged write is lost, X's worker serves
/// again through another server within about 2 s, the clients fail only requests X had in
/// flight, and another server takes the monitor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_under_load_loses_no_write_and_its_workers_move() {
    let dir = tempfile::tempdir().unwrap();
    let pg = Postgres::start().unwrap();
    let mut s = servers(&pg, dir.path(), 3, &[]).await;
    let (reg, key) = provision(&s[0].admin).await;
    let urls: Vec<String> = s.iter().map(FadenServer::api_url).collect();
    let engines = [
        engine(2, 0, 0).await,
        engine(2, 0, 0).await,
        engine(2, 0, 0).await,
    ];
    let mut workers = Vec::new();
    for i in 0..3 {
        let list = [&urls[i..], &urls[..i]].concat().join(",");
        let mut args = worker_args(
            &list,
            &reg,
            "tunnel",
            engines[i].port(),
            &dir.path().join(format!("worker-{i}")),
        );
        // One host, three workers: each needs its own name (the default is the hostname).
        args.extend(["--name".to_owned(), format!("worker-{i}")]);
        workers.push(start_worker(&args).await);
    }
    for (i, (_, id)) in workers.iter().enumerate() {
        let owner = proxy_url(&s[i]);
        testkit::wait_until_async(T, "each tunnel on its first server", || {
            let (admin, id, owner) = (s[0].admin.clone(), id.clone(), owner.clone());
            async move { worker_record(&admin, &id).await["proxy_address"] == owner }
        })
        .await;
    }
    testkit::wait_until(T, "one server elected", || {
        s.iter().filter(|x| x.running.printed(ELECTED)).count() == 1
    })
    .await;
    let x = (0..3).find(|&i| s[i].running.printed(ELECTED)).unwrap();
    let others: Vec<usize> = (0..3).filter(|&i| i != x).collect();
    let standalone_urls = [&urls[x..], &urls[..x]].concat().join(",");
    let (mut standalone, gw) = standalone_gateway(&s[others[0]].admin, &standalone_urls, &[]).await;
    // Clients on every gateway; those of X's own die with it and are only counted.
    let gateways = [s[others[0]].gateway, s[others[1]].gateway, gw, s[x].gateway];
    for addr in gateways {
        wait_serving(addr, &key, T).await.expect("never served");
    }

    let stop_clients = tokio_util::sync::CancellationToken::new();
    let killed = std::sync::Arc::new(std::sync::OnceLock::new());
    let clients: Vec<_> = gateways
        .iter()
        .flat_map(|&addr| [addr, addr])
        .map(|addr| client_loop(addr, key.clone(), stop_clients.clone(), killed.clone()))
        .collect();
    let stop_writes = tokio_util::sync::CancellationToken::new();
    let writers: Vec<_> = (0..3)
        .map(|i| writer_loop(s[i].admin.clone(), format!("w{i}"), stop_writes.clone()))
        .collect();
    tokio::time::sleep(Duration::from_millis(800)).await;

    s[x].kill().await;
    let _ = killed.set(Instant::now());
    let started = Instant::now();
    let (moved_worker, dead_owner) = (workers[x].1.clone(), proxy_url(&s[x]));
    let alive = &s[others[0]];
    // Moved: its record names a live server; back: its engine then serves a new request.
    let moved = loop {
        let owner = worker_record(&alive.admin, &moved_worker).await["proxy_address"].clone();
        if owner.as_str().is_some_and(|o| o != dead_owner) {
            assert!(
                others.iter().any(|&i| owner == proxy_url(&s[i])),
                "X's worker is owned by {owner}"
            );
            break started.elapsed();
        }
        assert!(started.elapsed() < T, "X's worker never moved");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let served_before = engines[x].stats.completed();
    let back = loop {
        if engines[x].stats.completed() > served_before {
            break started.elapsed();
        }
        assert!(started.elapsed() < T, "X's worker never served again");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    testkit::wait_until(T, "another server elected", || {
        others.iter().any(|&i| s[i].running.printed(ELECTED))
    })
    .await;
    let elected = started.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop_clients.cancel();
    stop_writes.cancel();

    let mut report = Vec::new();
    let mut failed_total = 0;
    for (i, client) in clients.into_iter().enumerate() {
        let seen = client.await.unwrap();
        let failed: Vec<_> = seen.iter().filter(|(_, st)| *st != Some(200)).collect();
        let on_x = gateways[i / 2] == s[x].gateway;
        if on_x {
            let last_ok = seen.iter().rev().find(|(_, st)| *st == Some(200));
            report.push(format!(
                "client {i} (X's own gateway, killed): {} requests, {} failed, the last success {:?} after the kill",
                seen.len(),
                failed.len(),
                last_ok.and_then(|(at, _)| *at)
            ));
            continue;
        }
        failed_total += failed.len();
        let shown: Vec<_> = failed.iter().take(5).collect();
        report.push(format!(
            "client {i} ({}): {} requests, {} failed {shown:?}",
            gateways[i / 2],
            seen.len(),
            failed.len(),
        ));
    }
    let mut acked = Vec::new();
    for writer in writers {
        acked.extend(writer.await.unwrap());
    }
    let listed = alive
        .admin
        .get("/v2/api-keys?page=-1")
        .await
        .expect(200)
        .json();
    let names: std::collections::HashSet<&str> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|k| k["name"].as_str())
        .collect();
    let lost: Vec<&String> = acked
        .iter()
        .filter(|n| !names.contains(n.as_str()))
        .collect();
    println!(
        "kill -9 of the monitor's server under load: its worker's tunnel moved {moved:?} after, served again {back:?} after, the monitor moved {elected:?} after; {} acknowledged writes, {} lost; {failed_total} failed requests\n{}",
        acked.len(),
        lost.len(),
        report.join("\n")
    );
    assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
    // Only what X had in flight may fail: one request per client loop at most.
    assert!(
        failed_total <= 6,
        "{failed_total} failed:\n{}",
        report.join("\n")
    );
    for (mut w, _) in workers {
        stop(&mut w).await;
    }
    stop(&mut standalone).await;
}
