//! Tunnel mode with the real binaries: a worker that listens on no port serves through the
//! tunnel it dials, both for the server's own gateway (in-process stream) and for a standalone
//! gateway (through the proxy port); after a server restart the worker is back within seconds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use mock_engine::{MockEngine, MockEngineConfig};
use serde_json::json;
use testkit::Client;
use testkit::process::{start, start_faden_server};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_faden"))
}

/// Socket inodes of `pid`'s listening TCP sockets (IPv4 and IPv6).
fn listening_sockets(pid: u32) -> Vec<u64> {
    let mine: HashSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect();
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // st == 0A is LISTEN; column 9 is the inode.
            if cols.len() > 9
                && cols[3] == "0A"
                && let Ok(inode) = cols[9].parse::<u64>()
                && mine.contains(&inode)
            {
                out.push(inode);
            }
        }
    }
    out
}

async fn chat_until_ok(client: &Client, limit: Duration) -> Option<String> {
    let body =
        json!({"model": "demo", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let r = client.post("/v1/chat/completions", &body).await;
        if r.status == 200 {
            return Some(r.text());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test]
async fn tunnel_worker_serves_without_listening_and_survives_a_server_restart() {
    let dir = tempfile::tempdir().unwrap();
    let server_dir = dir.path().join("server");
    let ports = [
        testkit::free_port(),
        testkit::free_port(),
        testkit::free_port(),
    ];
    let mut server = start_faden_server(bin(), &server_dir, ports, &[], &[]).await;
    let api = server.api_url();
    let admin = server.admin.clone();
    let cluster = admin
        .post("/v2/clusters", &json!({"name": "c"}))
        .await
        .expect(200)
        .json();
    admin
        .post("/v2/models", &json!({"name": "demo"}))
        .await
        .expect(200);
    let engine = MockEngine::start(MockEngineConfig {
        model: "demo".into(),
        tokens: 5,
        inter_token_delay: Duration::from_millis(10),
        ..Default::default()
    })
    .await
    .unwrap();

    let instance = format!("demo={}", engine.port());
    let worker_dir = dir.path().join("worker");
    let (worker, worker_id) = start(
        bin(),
        &[
            "worker",
            "--server-url",
            &api,
            "--token",
            cluster["registration_token"].as_str().unwrap(),
            "--proxy-mode",
            "tunnel",
            "--worker-ip",
            "10.255.0.7",
            "--disable-worker-metrics",
            "--instance",
            &instance,
            "--data-dir",
            worker_dir.to_str().unwrap(),
            "--probe-interval",
            "200ms",
            // One runtime thread: the current-thread scheduler, as the benchmarks run it (the
            // server keeps the default work-stealing one).
            "--worker-threads",
            "1",
        ],
        &[],
        "faden worker ready",
        "worker_id",
    )
    .await;
    // The worker listens on nothing: no inbound port at all.
    let pid = worker.child.id().unwrap();
    assert!(
        listening_sockets(pid).is_empty(),
        "tunnel worker must not listen: {:?}",
        listening_sockets(pid)
    );

    // Through the server's own gateway (in-process tunnel stream).
    let inference = admin
        .post("/v2/api-keys", &json!({"name": "u"}))
        .await
        .expect(200)
        .json();
    let user = inference["value"].as_str().unwrap().to_owned();
    let gateway = Client::new(format!("http://127.0.0.1:{}", ports[1])).with_token(&user);
    let text = chat_until_ok(&gateway, Duration::from_secs(10))
        .await
        .expect("never routable through the tunnel");
    assert!(
        text.contains("tok4") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    let w = admin
        .get(&format!("/v2/workers/{worker_id}"))
        .await
        .expect(200)
        .json();
    assert_eq!(w["proxy_address"], format!("http://127.0.0.1:{}", ports[2]));

    // Through a standalone gateway, which reaches tunnel workers via the proxy port.
    let (standalone, gw_addr) =
        common::standalone_gateway(&admin, &api, &[("FADEN_WORKER_THREADS", "1")]).await;
    let remote = Client::new(format!("http://{gw_addr}")).with_token(&user);
    let text = chat_until_ok(&remote, Duration::from_secs(10))
        .await
        .expect("standalone gateway cannot reach the tunnel worker");
    assert!(text.contains("tok4"), "{text}");
    // The proxy port refuses callers without a data-plane key.
    let proxy = Client::new(format!("http://127.0.0.1:{}", ports[2])).with_token(&user);
    let r = proxy
        .post("/v1/chat/completions", &json!({"model": "demo"}))
        .await;
    assert_eq!(r.status, 407, "{}", r.text());

    // Restart the server: the worker dials back by itself.
    server.kill().await;
    let down = Instant::now();
    let server = start_faden_server(bin(), &server_dir, ports, &[], &[]).await;
    let restarted = Instant::now();
    chat_until_ok(&gateway, Duration::from_secs(10))
        .await
        .expect("worker did not come back after the restart");
    eprintln!(
        "serving again {:?} after the server was back ({:?} after it went down)",
        restarted.elapsed(),
        down.elapsed()
    );

    for mut child in [worker.child, standalone.child, server.running.child] {
        child.start_kill().unwrap();
        let _ = child.wait().await;
    }
    engine.stop().await;
}
