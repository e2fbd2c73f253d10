//! Fault suite (issue #6) with the real binaries: a tunnel worker killed or cut off mid-stream,
//! the server killed and restarted under live workers and writers, the management API gone
//! under a standalone gateway, a drain with 100 live streams, a client that stops reading
//! through the tunnel, and a tunnel worker restarted at once failing no request. Each test
//! asserts what the client sees and how the system comes back, and prints the recovery time it
//! measured (`cargo nextest run -p faden --test faults --no-capture`; the figures are in
//! docs/operations.md).
//!
//! The gateway-only faults (an engine killed mid-stream, a slow client) are in
//! `gateway/tests/faults.rs`; the reconnect storm of 1,000 workers in `tunnel/tests/storm.rs`;
//! acknowledged writes under `kill -9` without workers in `durability.rs`.

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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use mock_engine::MockEngineHandle;
use serde_json::json;
use testkit::Client;
use testkit::process::{FadenServer, Running, start, start_faden_server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// Opens a long stream and reads its first event.
async fn live_stream(addr: SocketAddr, key: &str) -> (Incoming, String) {
    let resp = chat(addr, key, true, None).await.expect("no answer");
    let status = resp.status();
    let mut body = resp.into_body();
    let mut text = String::new();
    if status != 200 {
        let _ = drain_body(&mut body, &mut text).await;
        panic!("{status}: {text}");
    }
    while !text.contains("\n\n") {
        let frame = tokio::time::timeout(T, body.frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&frame.into_data().unwrap()));
    }
    (body, text)
}

/// Asserts a stream cut by a fault ends abnormally, never with `[DONE]`; `Some(gateway error
/// code)` also requires the SSE error event. Returns how long after `since` the end came.
async fn assert_cut(
    mut body: Incoming,
    mut text: String,
    event: Option<&str>,
    since: Instant,
) -> Duration {
    let clean = drain_body(&mut body, &mut text).await;
    let took = since.elapsed();
    assert!(!clean, "a cut stream must end abnormally: {text}");
    assert!(
        !text.contains("[DONE]"),
        "clean [DONE] after a fault: {text}"
    );
    if let Some(code) = event {
        assert!(
            text.contains(&format!(r#""code":"{code}""#)),
            "no SSE error event {code}: {text}"
        );
    }
    took
}

/// A TCP relay whose open connections can be cut at once (a network path that breaks).
struct Relay {
    addr: SocketAddr,
    cut: tokio::sync::broadcast::Sender<()>,
    accept: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, _) = tokio::sync::broadcast::channel(1);
        let c = cut.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let mut cut = c.subscribe();
                tokio::spawn(async move {
                    let Ok(mut upstream) = TcpStream::connect(target).await else {
                        return;
                    };
                    // Cut: both sockets are dropped, so both peers see the connection close.
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
                        _ = cut.recv() => {}
                    }
                });
            }
        });
        Self { addr, cut, accept }
    }

    /// Drops every connection open now; returns how many. New connections are relayed.
    fn cut(&self) -> usize {
        self.cut.send(()).unwrap_or(0)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// A server on ephemeral ports with one tunnel worker in front of `engine`, serving.
struct TunnelSetup {
    server: FadenServer,
    key: String,
    args: Vec<String>,
    worker: Running,
    worker_id: String,
}

async fn tunnel_setup(dir: &Path, engine: &MockEngineHandle) -> TunnelSetup {
    let server = start_faden_server(bin(), &dir.join("server"), [0; 3], &[], &[]).await;
    let (reg, key) = provision(&server.admin).await;
    let args = worker_args(
        &server.api_url(),
        &reg,
        "tunnel",
        engine.port(),
        &dir.join("worker"),
    );
    let (worker, worker_id) = start_worker(&args).await;
    wait_serving(server.gateway, &key, T)
        .await
        .expect("never served through the tunnel");
    TunnelSetup {
        server,
        key,
        args,
        worker,
        worker_id,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_worker_killed_mid_stream_fails_the_stream_and_serves_again_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine(200, 20, 0).await;
    let TunnelSetup {
        mut server,
        key,
        args,
        mut worker,
        worker_id,
    } = tunnel_setup(dir.path(), &engine).await;

    let (body, text) = live_stream(server.gateway, &key).await;
    let killed = Instant::now();
    stop(&mut worker).await;
    let seen = assert_cut(body, text, Some("upstream_protocol"), killed).await;

    let restarted = Instant::now();
    let (mut again, id_again) = start_worker(&args).await;
    let process = restarted.elapsed();
    assert_eq!(
        id_again, worker_id,
        "the restarted worker is the same worker"
    );
    wait_serving(server.gateway, &key, T)
        .await
        .expect("the restarted worker never served");
    eprintln!(
        "worker kill -9: client saw the error {seen:?} after the kill; serving again {:?} after \
         the restart began (worker ready after {process:?})",
        restarted.elapsed(),
    );
    stop(&mut again).await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_cut_mid_stream_fails_the_stream_and_the_worker_reconnects() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start_faden_server(bin(), &dir.path().join("server"), [0; 3], &[], &[]).await;
    let (reg, key) = provision(&server.admin).await;
    let engine = engine(200, 20, 0).await;
    // The worker reaches the server (registration, heartbeats, tunnel) through a relay.
    let relay = Relay::start(server.api).await;
    let args = worker_args(
        &format!("http://{}", relay.addr),
        &reg,
        "tunnel",
        engine.port(),
        &dir.path().join("worker"),
    );
    let (mut worker, _) = start_worker(&args).await;
    wait_serving(server.gateway, &key, T)
        .await
        .expect("never served through the tunnel");

    let mut figures = Vec::new();
    for _ in 0..3 {
        let (body, text) = live_stream(server.gateway, &key).await;
        let cut = Instant::now();
        assert!(relay.cut() >= 1, "the tunnel was not relayed");
        let seen = assert_cut(body, text, Some("upstream_protocol"), cut).await;
        wait_serving(server.gateway, &key, T)
            .await
            .expect("the worker did not reconnect after the cut");
        let back = cut.elapsed();
        eprintln!(
            "tunnel cut: client saw the error {seen:?} after the cut; serving again {back:?} after it"
        );
        figures.push(back);
    }
    // Each back within `T` (`wait_serving`); the worker's reconnect backoff starts at 100 ms
    // (full jitter, up to 2 s).
    eprintln!("serving again after each cut: {figures:?}");
    stop(&mut worker).await;
    server.kill().await;
}

/// API keys created by `writers` tasks as fast as they can, until a request fails; each
/// records (name, value) of the keys whose creation was acknowledged.
/// `writers` tasks creating API keys one after the other until a request fails;
/// `acked_so_far` counts the keys acknowledged so far.
fn key_writers(
    admin: &Client,
    writers: usize,
    acked_so_far: &Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<Vec<(String, String)>>> {
    (0..writers)
        .map(|w| {
            let admin = admin.clone();
            let acked_so_far = acked_so_far.clone();
            tokio::spawn(async move {
                let mut acked = Vec::new();
                for i in 0.. {
                    let name = format!("k-{w}-{i}");
                    let r = tokio::time::timeout(
                        Duration::from_secs(10),
                        admin.try_post("/v2/api-keys", &json!({"name": name})),
                    )
                    .await;
                    match r {
                        Ok(Some(r)) if r.status == 200 => {
                            acked.push((name, r.json()["value"].as_str().unwrap().to_owned()));
                            acked_so_far.fetch_add(1, Ordering::SeqCst);
                        }
                        _ => break,
                    }
                }
                acked
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_kill_9_and_restart_under_live_workers_and_writers() {
    let dir = tempfile::tempdir().unwrap();
    let server_dir = dir.path().join("server");
    let ports = [
        testkit::free_port(),
        testkit::free_port(),
        testkit::free_port(),
    ];
    let mut server = start_faden_server(bin(), &server_dir, ports, &[], &[]).await;
    let (reg, key) = provision(&server.admin).await;
    let engine = engine(200, 20, 0).await;
    let args = worker_args(
        &server.api_url(),
        &reg,
        "tunnel",
        engine.port(),
        &dir.path().join("worker"),
    );
    let (mut worker, worker_id) = start_worker(&args).await;
    wait_serving(server.gateway, &key, T)
        .await
        .expect("never served through the tunnel");

    // A live stream, and writers creating API keys, when the server dies.
    let (body, text) = live_stream(server.gateway, &key).await;
    let acked_so_far = Arc::new(AtomicUsize::new(0));
    let writers = key_writers(&server.admin, 2, &acked_so_far);
    // Kill while writes are flowing: after some have been acknowledged (a loaded machine can
    // take longer than a fixed pause for them).
    testkit::wait_until(T, "20 acknowledged writes", || {
        acked_so_far.load(Ordering::SeqCst) > 20
    })
    .await;
    let killed = Instant::now();
    server.kill().await;
    // The gateway died with the server: no error event can come, only an abnormal end.
    assert_cut(body, text, None, killed).await;
    let mut acked = Vec::new();
    for w in writers {
        acked.extend(tokio::time::timeout(T, w).await.unwrap().unwrap());
    }
    assert!(
        acked.len() > 10,
        "too few acknowledged writes: {}",
        acked.len()
    );

    let restarted = Instant::now();
    let server = start_faden_server(bin(), &server_dir, ports, &[], &[]).await;
    let up = restarted.elapsed();
    let serving = wait_serving(server.gateway, &key, T)
        .await
        .expect("the tunnel worker did not come back after the restart");
    eprintln!(
        "server kill -9 + restart: process ready in {up:?}, tunnel worker serving again {:?} \
         after the restart began; {} key writes acknowledged before the kill",
        up + serving,
        acked.len()
    );

    // Routes came back from the store: the worker's tunnel is recorded again.
    let w = server
        .admin
        .get(&format!("/v2/workers/{worker_id}"))
        .await
        .expect(200)
        .json();
    assert_eq!(w["proxy_address"], format!("http://127.0.0.1:{}", ports[2]));
    // No acknowledged write was lost, and the newest ones (the most at risk) authenticate.
    let listed = server
        .admin
        .get("/v2/api-keys?perPage=-1")
        .await
        .expect(200)
        .json();
    let names: std::collections::HashSet<&str> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["name"].as_str().unwrap())
        .collect();
    let lost: Vec<&str> = acked
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| !names.contains(n))
        .collect();
    assert!(lost.is_empty(), "acknowledged keys lost: {lost:?}");
    for (name, value) in acked.iter().rev().take(10) {
        assert!(
            serves(server.gateway, value).await,
            "key {name} does not work"
        );
    }
    stop(&mut worker).await;
    let mut server = server;
    server.kill().await;
}

async fn readyz(addr: SocketAddr) -> (u16, String) {
    let r = Client::new(format!("http://{addr}")).get("/readyz").await;
    (r.status.as_u16(), r.text())
}

/// Waits until the gateway's snapshot is under a second old (heartbeats every 200 ms).
async fn fresh_snapshot(addr: SocketAddr) {
    testkit::wait::wait_until_async(T, "a fresh snapshot", || async move {
        snapshot_age(addr).await < 1.0
    })
    .await;
}

async fn snapshot_age(addr: SocketAddr) -> f64 {
    let text = Client::new(format!("http://{addr}"))
        .get("/metrics")
        .await
        .expect(200)
        .text();
    let line = text
        .lines()
        .find(|l| l.starts_with("faden_gateway_snapshot_age_seconds "))
        .unwrap_or_else(|| panic!("no snapshot age gauge:\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_gateway_serves_through_an_api_outage_and_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let server_dir = dir.path().join("server");
    let ports = [testkit::free_port(), 0, 0];
    // Watch heartbeats every 200 ms: an idle but healthy API keeps the snapshot fresh.
    let extra = ["--watch-heartbeat", "200ms"];
    let mut server = start_faden_server(bin(), &server_dir, ports, &extra, &[]).await;
    let (reg, key) = provision(&server.admin).await;
    let engine = engine(5, 10, 0).await;
    // A direct-mode worker: the gateway dials the engine itself, without the server.
    let args = worker_args(
        &server.api_url(),
        &reg,
        "direct",
        engine.port(),
        &dir.path().join("worker"),
    );
    let (mut worker, _) = start_worker(&args).await;
    let max_staleness = Duration::from_secs(2);
    // Retries of the management API wait at most 500 ms (default 10 s).
    let settings = [
        ("FADEN_MAX_STALENESS", "2s"),
        ("FADEN_SYNC_RETRY_MAX", "500ms"),
    ];
    let (mut gateway, gw) = standalone_gateway(&server.admin, &server.api_url(), &settings).await;
    wait_serving(gw, &key, T)
        .await
        .expect("the standalone gateway never served");
    assert_eq!(readyz(gw).await.0, 200);
    fresh_snapshot(gw).await;

    // The management API goes away.
    let killed = Instant::now();
    server.kill().await;
    let mut stale_after = None;
    let mut served = 0;
    // Until /readyz says stale (bounded: max_staleness + T).
    while stale_after.is_none() {
        assert!(
            killed.elapsed() < max_staleness + T,
            "/readyz never reported the stale snapshot"
        );
        // Traffic keeps flowing from the last snapshot the whole time.
        assert!(
            serves(gw, &key).await,
            "stopped serving {:?} into the outage",
            killed.elapsed()
        );
        served += 1;
        let (status, body) = readyz(gw).await;
        if status == 503 && stale_after.is_none() {
            assert!(body.contains("stale"), "{body}");
            stale_after = Some(killed.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stale_after = stale_after.unwrap();
    assert!(
        stale_after >= max_staleness - Duration::from_millis(300),
        "{stale_after:?}"
    );
    let age = snapshot_age(gw).await;
    assert!(age >= max_staleness.as_secs_f64(), "age {age}");
    eprintln!(
        "API outage: {served} requests served from the last snapshot; /readyz 503 after \
         {stale_after:?}; snapshot age {age:.1} s at the end"
    );

    // The API returns (same port, same data): the gateway resyncs, and a change made now
    // becomes visible to it.
    let restarted = Instant::now();
    let server = start_faden_server(bin(), &server_dir, ports, &extra, &[]).await;
    let started_in = restarted.elapsed();
    // Each resource stream retries with its own backoff (capped at --sync-retry-max):
    // ready once all are back.
    let mut ready_after = None;
    while restarted.elapsed() < Duration::from_secs(15) {
        if readyz(gw).await.0 == 200 {
            ready_after = Some(restarted.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ready_after = ready_after.expect("/readyz did not recover");
    // Retries wait at most 500 ms once the API is up again; only a hang guard bounds it here,
    // a loaded machine stretches each one.
    assert!(
        ready_after < started_in + T,
        "ready {ready_after:?} after the restart began, the API was up after {started_in:?}"
    );
    let fresh = server
        .admin
        .post("/v2/api-keys", &json!({"name": "after-outage"}))
        .await
        .expect(200)
        .json();
    let written = Instant::now();
    let visible = wait_serving(gw, fresh["value"].as_str().unwrap(), T)
        .await
        .expect("a key created after the outage never reached the gateway");
    // Ready means every part of the snapshot follows the API again: a change shows within `T`
    // (`wait_serving`), on the live watch.
    fresh_snapshot(gw).await;
    eprintln!(
        "API back: process ready in {started_in:?}, /readyz 200 {ready_after:?} after the \
         restart began; a new key usable {visible:?} after it was written ({:?})",
        written.elapsed()
    );
    stop(&mut gateway).await;
    stop(&mut worker).await;
    let mut server = server;
    server.kill().await;
}

fn sigterm(pid: u32) {
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_100_live_streams_and_refuses_new_connections() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("up");
    let drain_timeout = Duration::from_secs(15);
    // 20 tokens, 100 ms apart: each stream runs about 2 s.
    let (mut up, addr) = start(
        bin(),
        &[
            "up",
            "--data-dir",
            data.to_str().unwrap(),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--api-port",
            "0",
            "--proxy-port",
            "0",
            "--tokens",
            "20",
            "--itl",
            "100ms",
            "--drain-timeout",
            "15s",
        ],
        &[],
        "faden up ready",
        "gateway",
    )
    .await;
    let addr: SocketAddr = addr.parse().unwrap();
    let key = std::fs::read_to_string(data.join("inference.key"))
        .unwrap()
        .trim()
        .to_owned();

    let n = 100;
    let mut opening = tokio::task::JoinSet::new();
    for _ in 0..n {
        let key = key.clone();
        opening.spawn(async move { live_stream(addr, &key).await });
    }
    let mut streams = Vec::new();
    while let Some(s) = tokio::time::timeout(T, opening.join_next()).await.unwrap() {
        streams.push(s.unwrap());
    }
    assert_eq!(streams.len(), n);

    let pid = up.child.id().unwrap();
    let term = Instant::now();
    sigterm(pid);
    // New connections are refused while the streams still run.
    let mut refused_after = None;
    // Bounded by `T`; that it comes while the streams still run is checked below.
    while term.elapsed() < T {
        match TcpStream::connect(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                refused_after = Some(term.elapsed());
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    let refused_after = refused_after.expect("new connections still accepted during the drain");

    let mut finishing = tokio::task::JoinSet::new();
    for (mut body, mut text) in streams {
        finishing.spawn(async move {
            let clean = drain_body(&mut body, &mut text).await;
            (clean, text, term.elapsed())
        });
    }
    let mut completed = 0;
    let mut first_done = Duration::MAX;
    while let Some(r) = tokio::time::timeout(T, finishing.join_next())
        .await
        .unwrap()
    {
        let (clean, text, done) = r.unwrap();
        first_done = first_done.min(done);
        assert!(clean, "a stream was cut by the drain: {text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        completed += 1;
    }
    assert_eq!(completed, n);
    assert!(
        refused_after < first_done,
        "the refusal must come while the streams still run ({refused_after:?} vs {first_done:?})"
    );
    let status = tokio::time::timeout(drain_timeout, up.child.wait())
        .await
        .expect("the process outlived its drain timeout")
        .unwrap();
    assert!(status.success(), "{status}");
    eprintln!(
        "SIGTERM with {n} live streams: new connections refused after {refused_after:?}, all \
         {n} streams ended with [DONE], process exited {:?} after the signal",
        term.elapsed()
    );
}

/// Raw HTTP/1.1: a streamed chat request whose answer nobody reads.
async fn unread_stream(addr: SocketAddr, key: &str) -> TcpStream {
    let body = r#"{"model":"demo","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_does_not_slow_other_streams_through_the_tunnel() {
    let dir = tempfile::tempdir().unwrap();
    // 2,000 events of 8 KiB: 16 MiB per stream, more than every buffer on the path holds.
    let engine = engine(2000, 0, 8192).await;
    let TunnelSetup {
        mut server,
        key,
        mut worker,
        ..
    } = tunnel_setup(dir.path(), &engine).await;
    let done_before = engine.stats.completed();

    // Both the slow and the fast streams ride the same tunnel to the same engine. Once the
    // engine has the slow request, it fills every buffer on the path faster than anyone reads.
    let requests_before = engine.stats.requests();
    let mut slow = unread_stream(server.gateway, &key).await;
    tokio::time::timeout(T, engine.stats.wait_requests(requests_before + 1))
        .await
        .expect("the slow stream never reached the engine");
    let started = Instant::now();
    let mut fast = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let (addr, key) = (server.gateway, key.clone());
        fast.spawn(async move {
            let resp = chat(addr, &key, true, None).await.unwrap();
            assert_eq!(resp.status(), 200);
            let bytes = tokio::time::timeout(Duration::from_secs(20), resp.into_body().collect())
                .await
                .expect("a fast stream stalled behind the slow client")
                .unwrap()
                .to_bytes();
            assert!(bytes.ends_with(b"data: [DONE]\n\n"));
            bytes.len()
        });
    }
    while let Some(r) = fast.join_next().await {
        assert!(r.unwrap() > 2000 * 8192);
    }
    eprintln!(
        "tunnel: 2 fast streams of 16 MiB done in {:?} beside a client that reads nothing",
        started.elapsed()
    );
    assert_eq!(
        engine.stats.completed(),
        done_before + 2,
        "the slow stream was not held back"
    );

    // The slow client reads again and gets its whole stream.
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = slow.read(&mut buf).await.unwrap();
            assert!(n > 0, "the slow stream was cut");
            got.extend_from_slice(&buf[..n]);
            if got.ends_with(b"0\r\n\r\n") {
                break;
            }
        }
    })
    .await
    .expect("the slow stream did not resume");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"));
    assert!(text.contains("data: [DONE]"));
    stop(&mut worker).await;
    server.kill().await;
}

/// A tunnel worker with three instances killed and started again at once: from the moment its
/// new tunnel is up, every request is served (the worker proxy knows its instances before the
/// tunnel connects, not only once it has reported them again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_tunnel_worker_fails_no_request_once_its_tunnel_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let engines = [
        engine(2, 0, 0).await,
        engine(2, 0, 0).await,
        engine(2, 0, 0).await,
    ];
    let mut server = start_faden_server(bin(), &dir.path().join("server"), [0; 3], &[], &[]).await;
    let (reg, key) = provision(&server.admin).await;
    let mut args = worker_args(
        &server.api_url(),
        &reg,
        "tunnel",
        engines[0].port(),
        &dir.path().join("worker"),
    );
    for e in &engines[1..] {
        args.extend(["--instance".to_owned(), format!("demo={}", e.port())]);
    }
    let (mut worker, worker_id) = start_worker(&args).await;
    let path = format!("/v2/workers/{worker_id}");
    let proxy_address = |admin: Client, path: String| async move {
        admin.get(&path).await.expect(200).json()["proxy_address"].clone()
    };
    let running = |admin: Client| async move {
        let list = admin.get("/v2/model-instances").await.expect(200).json();
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["state"] == "running")
            .count()
    };
    testkit::wait_until_async(T, "three instances running", || {
        let admin = server.admin.clone();
        async move { running(admin).await == 3 }
    })
    .await;
    wait_serving(server.gateway, &key, T)
        .await
        .expect("never served");

    stop(&mut worker).await;
    testkit::wait_until_async(T, "the old tunnel gone", || {
        let (admin, path) = (server.admin.clone(), path.clone());
        async move { proxy_address(admin, path).await.is_null() }
    })
    .await;
    let (mut again, _) = start_worker(&args).await;
    testkit::wait_until_async(T, "the new tunnel up", || {
        let (admin, path) = (server.admin.clone(), path.clone());
        async move { !proxy_address(admin, path).await.is_null() }
    })
    .await;
    let mut failed = Vec::new();
    for _ in 0..30 {
        let status = chat(server.gateway, &key, false, Some(2))
            .await
            .map(|r| r.status().as_u16());
        if status != Some(200) {
            failed.push(status);
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 30 failed: {failed:?}",
        failed.len()
    );
    stop(&mut again).await;
    server.kill().await;
}
