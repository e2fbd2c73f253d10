//! Workers that leave without failing a request (issue #38), with the real binaries: a tunnel
//! worker stopped with SIGTERM under streaming load drains through its server, finishes its
//! streams and goes away; a rolling restart of three tunnel workers fails nothing, and the same
//! restart with `kill -9` counts what it fails.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use common::*;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle};
use serde_json::json;
use testkit::process::{FadenServer, Running, start_faden_server};
use testkit::wait_until;
use tokio::time::Instant;

/// A mock engine of model `demo` whose streams take about `tokens` × 10 ms, recording every
/// request (probes included) so that chat requests can be counted.
async fn streaming_engine(tokens: usize) -> MockEngineHandle {
    MockEngine::start(MockEngineConfig {
        model: "demo".into(),
        tokens,
        inter_token_delay: Duration::from_millis(10),
        record_limit: 1_000_000,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// Chat requests the engine received (its recorded requests, without the worker's probes).
fn chats(engine: &MockEngineHandle) -> usize {
    engine
        .stats
        .seen()
        .iter()
        .filter(|r| r.uri.contains("/chat/completions"))
        .count()
}

/// Client loops streaming chat completions through a gateway until stopped, counting what
/// succeeded (`[DONE]` after a 200) and what failed.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    failures: Arc<tokio::sync::Mutex<Vec<String>>>,
    loops: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(gateway: SocketAddr, key: &str, clients: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(tokio::sync::Mutex::new(Vec::new()));
        let loops = (0..clients)
            .map(|_| {
                let (stop, ok, failed, failures) =
                    (stop.clone(), ok.clone(), failed.clone(), failures.clone());
                let key = key.to_owned();
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        match one_stream(gateway, &key).await {
                            Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                            Err(why) => {
                                failures.lock().await.push(why);
                                // A refusal comes back at once: do not spin on it.
                                tokio::time::sleep(Duration::from_millis(10)).await;
                                failed.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                    }
                })
            })
            .collect();
        Self {
            stop,
            ok,
            failed,
            failures,
            loops,
        }
    }

    fn ok(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    /// Stops the loops after their current request; (succeeded, failed).
    async fn finish(self) -> (u64, u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for l in self.loops {
            l.await.unwrap();
        }
        let failures = self.failures.lock().await.clone();
        let ok = self.ok.load(Ordering::Relaxed);
        (ok, self.failed.load(Ordering::Relaxed), failures)
    }
}

async fn one_stream(gateway: SocketAddr, key: &str) -> Result<(), String> {
    let resp = chat(gateway, key, true, None).await.ok_or("no answer")?;
    let status = resp.status();
    let mut body = resp.into_body();
    let mut text = String::new();
    let clean = drain_body(&mut body, &mut text).await;
    if status != 200 {
        return Err(format!("{status}: {text}"));
    }
    if !clean || !text.ends_with("data: [DONE]\n\n") {
        return Err(format!("stream cut: {}", text.len()));
    }
    Ok(())
}

fn signal(pid: u32, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// A server (one serving core, so that one request proves what every request sees) with
/// tunnel workers, each in front of its own engine.
struct Fleet {
    server: FadenServer,
    key: String,
    reg: String,
    dir: std::path::PathBuf,
    extra: Vec<String>,
    /// The workers' `--proxy-mode`.
    mode: &'static str,
    engines: Vec<MockEngineHandle>,
    args: Vec<Vec<String>>,
    workers: Vec<Running>,
    ids: Vec<String>,
}

async fn fleet(dir: &Path, n: usize, extra: &[&str]) -> Fleet {
    fleet_of(dir, n, extra, "tunnel").await
}

async fn fleet_of(dir: &Path, n: usize, extra: &[&str], mode: &'static str) -> Fleet {
    let server = start_faden_server(
        bin(),
        &dir.join("server"),
        [0; 3],
        &["--worker-threads", "1"],
        &[],
    )
    .await;
    let (reg, key) = provision(&server.admin).await;
    let mut fleet = Fleet {
        server,
        key,
        reg,
        dir: dir.to_owned(),
        extra: extra.iter().map(|s| (*s).to_owned()).collect(),
        mode,
        engines: Vec::new(),
        args: Vec::new(),
        workers: Vec::new(),
        ids: Vec::new(),
    };
    for _ in 0..n {
        fleet.add().await;
    }
    fleet
}

impl Fleet {
    /// Starts one more tunnel worker, `w<i>`, in front of a new engine.
    async fn add(&mut self) {
        let i = self.workers.len();
        let engine = streaming_engine(20).await;
        let mut args = worker_args(
            &self.server.api_url(),
            &self.reg,
            self.mode,
            engine.port(),
            &self.dir.join(format!("worker-{i}")),
        );
        args.extend(["--name".to_owned(), format!("w{i}")]);
        args.extend(self.extra.iter().cloned());
        let (worker, id) = start_worker(&args).await;
        self.engines.push(engine);
        self.args.push(args);
        self.workers.push(worker);
        self.ids.push(id);
    }

    /// Worker `i`'s drain: `GET`, or `POST` with `body`.
    async fn drain(&self, i: usize, body: Option<serde_json::Value>) -> serde_json::Value {
        let path = format!("/v2/workers/{}/drain", self.ids[i]);
        match body {
            None => self.server.admin.get(&path).await.expect(200).json(),
            Some(body) => self
                .server
                .admin
                .post(&path, &body)
                .await
                .expect(200)
                .json(),
        }
    }

    /// Waits until worker `i`'s tunnel is up and the gateway routes to it (its engine answers
    /// a chat request while the gateway spreads requests).
    async fn wait_routed(&self, i: usize) {
        let before = chats(&self.engines[i]);
        let deadline = Instant::now() + T;
        while chats(&self.engines[i]) == before {
            assert!(Instant::now() < deadline, "worker {i} never took a request");
            if !serves(self.server.gateway, &self.key).await {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    /// Waits until every change made before this call is in the gateway's routing: a key
    /// created now works there only once the snapshot holding it (and all before it) is live.
    async fn barrier(&self) {
        self.barrier_at(&[self.server.gateway]).await;
    }

    /// [`Fleet::barrier`] for each of `gateways` (one serving core each).
    async fn barrier_at(&self, gateways: &[SocketAddr]) {
        let key = self
            .server
            .admin
            .post(
                "/v2/api-keys",
                &json!({"name": format!("barrier-{}", rand_suffix())}),
            )
            .await
            .expect(200)
            .json();
        let key = key["value"].as_str().unwrap().to_owned();
        let deadline = Instant::now() + T;
        for &gateway in gateways {
            loop {
                let resp = chat(gateway, &key, false, Some(1)).await;
                if resp.is_some_and(|r| r.status() != 401) {
                    break;
                }
                assert!(Instant::now() < deadline, "the barrier key never worked");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
}

fn rand_suffix() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

async fn wait_exit(worker: &mut Running, limit: Duration) -> std::process::ExitStatus {
    tokio::time::timeout(limit, worker.child.wait())
        .await
        .expect("the worker did not exit")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_of_one_of_two_tunnel_workers_fails_no_request() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = fleet(dir.path(), 2, &[]).await;
    fleet.wait_routed(0).await;
    fleet.wait_routed(1).await;
    // Also through a standalone gateway, which reaches the workers through the proxy port.
    let (mut standalone, gw) = standalone_gateway(
        &fleet.server.admin,
        &fleet.server.api_url(),
        &[("FADEN_WORKER_THREADS", "1")],
    )
    .await;
    wait_serving(gw, &fleet.key, T)
        .await
        .expect("standalone never served");
    let load = Load::start(fleet.server.gateway, &fleet.key, 4);
    let load_standalone = Load::start(gw, &fleet.key, 2);
    // Both engines are streaming when the signal comes.
    let busy = |e: &MockEngineHandle| {
        let s = &e.stats;
        chats(e) as u64 > s.completed() + s.disconnects()
    };
    wait_until(T, "both engines streaming", || {
        busy(&fleet.engines[0]) && busy(&fleet.engines[1])
    })
    .await;

    let signalled = Instant::now();
    signal(fleet.workers[0].child.id().unwrap(), "TERM");
    wait_until(T, "the worker drains", || {
        fleet.workers[0].printed("draining: the server sends")
    })
    .await;
    fleet.barrier_at(&[fleet.server.gateway, gw]).await;
    let reached = chats(&fleet.engines[0]);
    let status = wait_exit(&mut fleet.workers[0], Duration::from_secs(30)).await;
    let exited = signalled.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(fleet.workers[0].printed("drained: no stream left"));
    // Load keeps running on the other worker for a while after the exit.
    let ok_at_exit = load.ok();
    wait_until(T, "more requests served after the exit", || {
        load.ok() >= ok_at_exit + 10
    })
    .await;
    let (ok, failed, failures) = load.finish().await;
    let (ok_standalone, failed_standalone, failures_standalone) = load_standalone.finish().await;

    let e0 = &fleet.engines[0].stats;
    assert_eq!(failed, 0, "failed requests: {failures:?}");
    assert_eq!(
        failed_standalone, 0,
        "failed through the standalone gateway: {failures_standalone:?}"
    );
    assert!(ok_standalone > 0);
    assert_eq!(
        chats(&fleet.engines[0]),
        reached,
        "a request reached the draining worker after the drain was routed"
    );
    assert_eq!(
        e0.disconnects(),
        0,
        "a stream on the stopped worker was cut"
    );
    assert_eq!(e0.completed() as usize, reached);
    eprintln!(
        "SIGTERM of one of two tunnel workers: {} streams served (the server's gateway and a \
         standalone one), 0 failed; the worker exited {exited:?} after the signal ({reached} \
         streams on it finished)",
        ok + ok_standalone
    );
    stop(&mut standalone).await;
    for w in &mut fleet.workers[1..] {
        stop(w).await;
    }
    fleet.server.kill().await;
}

/// Restarts each of three tunnel workers in turn under load, with `signal_name`; returns
/// (succeeded, failed).
async fn rolling_restart(signal_name: &str) -> (u64, u64, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = fleet(dir.path(), 3, &[]).await;
    for i in 0..3 {
        fleet.wait_routed(i).await;
    }
    let load = Load::start(fleet.server.gateway, &fleet.key, 6);
    for i in 0..3 {
        signal(fleet.workers[i].child.id().unwrap(), signal_name);
        wait_exit(&mut fleet.workers[i], Duration::from_secs(30)).await;
        let (worker, id) = start_worker(&fleet.args[i]).await;
        assert_eq!(id, fleet.ids[i], "the restarted worker is the same worker");
        fleet.workers[i] = worker;
        // Back in the routing: its engine streams again before the next one stops.
        let before = chats(&fleet.engines[i]);
        wait_until(T, "the restarted worker takes requests", || {
            chats(&fleet.engines[i]) > before
        })
        .await;
    }
    let result = load.finish().await;
    for w in &mut fleet.workers {
        stop(w).await;
    }
    fleet.server.kill().await;
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_restart_of_three_tunnel_workers_with_sigterm_fails_no_request() {
    let started = Instant::now();
    let (ok, failed, failures) = rolling_restart("TERM").await;
    assert_eq!(failed, 0, "failed requests: {failures:?}");
    assert!(ok > 0);
    eprintln!(
        "rolling restart (SIGTERM) of three tunnel workers: {ok} streams served, 0 failed, in \
         {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_restart_of_three_tunnel_workers_with_kill_counts_the_failures() {
    let (ok, failed, failures) = rolling_restart("KILL").await;
    assert!(ok > 0);
    assert_eq!(failures.len() as u64, failed);
    eprintln!(
        "rolling restart (kill -9) of three tunnel workers: {ok} streams served, {failed} \
         failed: {:?}",
        failures.iter().take(5).collect::<Vec<_>>()
    );
}

/// Worker settings of the API drain tests: a heartbeat often enough that the worker hears of
/// its drain and reports its in-flight count within a fraction of a second.
const QUICK_BEATS: &[&str] = &["--heartbeat-interval", "200ms"];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_api_drain_of_one_of_two_workers_moves_its_traffic_and_ends_drained() {
    // Heartbeats every 5 s: the worker hears of its drain within 5 s, then reports every second.
    let took = api_drain_of_one_of_two("tunnel", &["--heartbeat-interval", "5s"]).await;
    eprintln!("API drain, tunnel workers: drained {took:?} after the drain began");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_api_drain_of_one_of_two_worker_port_workers_ends_drained() {
    let took = api_drain_of_one_of_two("worker", QUICK_BEATS).await;
    eprintln!("API drain, worker-port workers: drained {took:?} after the drain began");
}

/// Two workers of `mode` serve under load; worker 0 is drained through the API: nothing fails,
/// it gets no request once the drain is in the gateway's routing, it ends `drained`, and takes
/// requests again once the drain ends. Returns how long after the drain began it was drained.
async fn api_drain_of_one_of_two(mode: &'static str, extra: &[&str]) -> Duration {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = fleet_of(dir.path(), 2, extra, mode).await;
    fleet.wait_routed(0).await;
    fleet.wait_routed(1).await;
    let load = Load::start(fleet.server.gateway, &fleet.key, 6);
    wait_until(T, "both engines streaming", || {
        chats(&fleet.engines[0]) > 0 && chats(&fleet.engines[1]) > 0
    })
    .await;

    let plan = fleet.drain(0, Some(json!({}))).await;
    assert_eq!(plan["applied"], false);
    assert_eq!(plan["stops"], 0);
    assert_eq!(plan["instances"][0]["action"], "moves");
    let started = Instant::now();
    let draining = fleet.drain(0, Some(json!({"confirm_stops": 0}))).await;
    assert_eq!(draining["state"], "draining");
    fleet.barrier().await;
    let reached = chats(&fleet.engines[0]);
    // Drained once its relayed streams (pooled ones included) have closed.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = fleet.drain(0, None).await;
        if status["state"] == "drained" {
            break;
        }
        assert!(Instant::now() < deadline, "never drained: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let drained_after = started.elapsed();
    let ok_then = load.ok();
    wait_until(T, "more requests served", || load.ok() >= ok_then + 10).await;
    assert_eq!(
        chats(&fleet.engines[0]),
        reached,
        "a drained worker got a request"
    );

    // Ending the drain brings it back.
    fleet
        .server
        .admin
        .delete(&format!("/v2/workers/{}/drain", fleet.ids[0]))
        .await
        .expect(200);
    wait_until(T, "the worker takes requests again", || {
        chats(&fleet.engines[0]) > reached
    })
    .await;
    let (ok, failed, failures) = load.finish().await;
    assert_eq!(failed, 0, "failed requests: {failures:?}");
    assert_eq!(fleet.engines[0].stats.disconnects(), 0);
    eprintln!("API drain of one of two {mode} workers: {ok} streams served, 0 failed");
    for w in &mut fleet.workers {
        stop(w).await;
    }
    fleet.server.kill().await;
    drained_after
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_of_the_only_worker_keeps_serving_until_a_second_one_runs() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = fleet(dir.path(), 1, QUICK_BEATS).await;
    fleet.wait_routed(0).await;
    let plan = fleet.drain(0, None).await;
    assert_eq!(plan["stops"], 1);
    assert_eq!(plan["instances"][0]["action"], "would_stop");
    assert_eq!(
        plan["instances"][0]["reason"],
        "no other instance of the model"
    );
    // Without consent nothing changes.
    let asked = fleet.drain(0, Some(json!({}))).await;
    assert_eq!(asked["applied"], false);
    assert_eq!(fleet.drain(0, None).await["state"], "ready");
    let consented = fleet.drain(0, Some(json!({"confirm_stops": 1}))).await;
    assert_eq!(consented["state"], "draining");
    assert_eq!(consented["instances"][0]["routed"], true);

    // It keeps serving.
    let load = Load::start(fleet.server.gateway, &fleet.key, 4);
    let before = chats(&fleet.engines[0]);
    wait_until(T, "the draining worker still serves", || {
        chats(&fleet.engines[0]) >= before + 10
    })
    .await;
    // A second worker with the model registers: the traffic moves there.
    fleet.add().await;
    wait_until(T, "the new worker takes requests", || {
        chats(&fleet.engines[1]) > 0
    })
    .await;
    fleet.barrier().await;
    let reached = chats(&fleet.engines[0]);
    let ok_then = load.ok();
    wait_until(T, "more requests served", || load.ok() >= ok_then + 10).await;
    let (ok, failed, failures) = load.finish().await;
    assert_eq!(failed, 0, "failed requests: {failures:?}");
    assert_eq!(chats(&fleet.engines[0]), reached, "traffic did not move");
    assert_eq!(fleet.engines[0].stats.disconnects(), 0);
    let status = fleet.drain(0, None).await;
    assert_eq!(status["instances"][0]["action"], "moves");
    eprintln!("drain of the only worker: {ok} streams served, 0 failed; moved to w1");
    for w in &mut fleet.workers {
        stop(w).await;
    }
    fleet.server.kill().await;
}

/// Three servers on one PostgreSQL, a tunnel worker on each (each lists every server, its own
/// first), streaming load through a standalone gateway that lists every server. Each server is
/// stopped with SIGTERM and started again, one after the other: each stopping server asks its
/// tunnel worker to move, the worker dials another server while its old tunnel serves on, and
/// leaves the old one once the new one serves; nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_restart_of_three_servers_fails_no_request() {
    let dir = tempfile::tempdir().unwrap();
    let pg = testkit::postgres::Postgres::start().unwrap();
    let url = pg.url();
    let ports: Vec<[u16; 3]> = (0..3)
        .map(|_| {
            [
                testkit::free_port(),
                testkit::free_port(),
                testkit::free_port(),
            ]
        })
        .collect();
    let server_args = ["--database-url", url.as_str()];
    let mut servers = Vec::new();
    for (i, p) in ports.iter().enumerate() {
        let data = dir.path().join(format!("server-{i}"));
        servers.push(start_faden_server(bin(), &data, *p, &server_args, &[]).await);
    }
    let (reg, key) = provision(&servers[0].admin).await;
    let urls: Vec<String> = servers.iter().map(FadenServer::api_url).collect();
    let mut engines = Vec::new();
    let mut workers = Vec::new();
    for i in 0..3 {
        let engine = streaming_engine(20).await;
        let list = [&urls[i..], &urls[..i]].concat().join(",");
        let mut args = worker_args(
            &list,
            &reg,
            "tunnel",
            engine.port(),
            &dir.path().join(format!("worker-{i}")),
        );
        args.extend(["--name".to_owned(), format!("w{i}")]);
        workers.push(start_worker(&args).await);
        engines.push(engine);
    }
    let (mut standalone, gw) = standalone_gateway(&servers[0].admin, &urls.join(","), &[]).await;
    wait_serving(gw, &key, T).await.expect("never served");
    let load = Load::start(gw, &key, 6);
    let started = Instant::now();
    for i in 0..3 {
        let before = load.ok();
        signal(servers[i].running.child.id().unwrap(), "TERM");
        tokio::time::timeout(Duration::from_secs(40), servers[i].running.child.wait())
            .await
            .expect("the server did not exit")
            .unwrap();
        let stopped = &servers[i].running;
        wait_until(T, "the stopped server said its tunnels moved", || {
            stopped.printed("every tunnel moved to another server")
        })
        .await;
        let data = dir.path().join(format!("server-{i}"));
        servers[i] = start_faden_server(bin(), &data, ports[i], &server_args, &[]).await;
        // Every worker's tunnel up again somewhere, and the load going on.
        let admin = servers[i].admin.clone();
        testkit::wait_until_async(T, "every tunnel up", || {
            let admin = admin.clone();
            async move {
                let list = admin.get("/v2/workers").await.json();
                list["items"].as_array().is_some_and(|w| {
                    w.len() == 3 && w.iter().all(|w| !w["proxy_address"].is_null())
                })
            }
        })
        .await;
        wait_until(T, "load served after the restart", || {
            load.ok() > before + 10
        })
        .await;
    }
    let (ok, failed, failures) = load.finish().await;
    let mut kinds: Vec<(String, usize)> = Vec::new();
    for f in &failures {
        let kind = f.split(": ").next().unwrap_or_default().to_owned();
        match kinds.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => kinds.push((kind, 1)),
        }
    }
    eprintln!(
        "rolling restart (SIGTERM) of three servers on PostgreSQL, three tunnel workers, a \
         standalone gateway: {ok} streams served, {failed} failed in {:?}: {kinds:?}",
        started.elapsed(),
    );
    assert!(ok > 0);
    assert_eq!(failed, 0, "failed requests: {failures:?}");
    stop(&mut standalone).await;
    for (w, _) in &mut workers {
        stop(w).await;
    }
    for s in &mut servers {
        s.kill().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_of_one_of_two_worker_port_workers_fails_no_request() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = fleet_of(dir.path(), 2, &[], "worker").await;
    fleet.wait_routed(0).await;
    fleet.wait_routed(1).await;
    let load = Load::start(fleet.server.gateway, &fleet.key, 6);
    wait_until(T, "both engines streaming", || {
        chats(&fleet.engines[0]) > 0 && chats(&fleet.engines[1]) > 0
    })
    .await;
    let signalled = Instant::now();
    signal(fleet.workers[0].child.id().unwrap(), "TERM");
    wait_until(T, "the worker drains", || {
        fleet.workers[0].printed("draining: the server sends")
    })
    .await;
    fleet.barrier().await;
    let reached = chats(&fleet.engines[0]);
    let status = wait_exit(&mut fleet.workers[0], Duration::from_secs(30)).await;
    let exited = signalled.elapsed();
    assert!(status.success(), "{status:?}");
    let ok_at_exit = load.ok();
    wait_until(T, "more requests served after the exit", || {
        load.ok() >= ok_at_exit + 10
    })
    .await;
    let (ok, failed, failures) = load.finish().await;
    assert_eq!(failed, 0, "failed requests: {failures:?}");
    assert_eq!(chats(&fleet.engines[0]), reached);
    assert_eq!(fleet.engines[0].stats.disconnects(), 0);
    eprintln!(
        "SIGTERM of one of two worker-port workers: {ok} streams served, 0 failed; exited \
         {exited:?} after the signal"
    );
    for w in &mut fleet.workers[1..] {
        stop(w).await;
    }
    fleet.server.kill().await;
}
