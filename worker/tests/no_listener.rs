//! The worker end listens on no port: it only dials out. Checked on the process's own sockets
//! (this binary holds only this test, so nothing else opens sockets meanwhile).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

// The tunnel crate's harness (server, workers, proxy port), and a worker proxy behind it.
mod behind_tunnel;
#[path = "../../tunnel/tests/common/mod.rs"]
mod common;

use std::collections::HashSet;

use behind_tunnel::*;
use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt as _, Full};

/// Inodes of the TCP sockets in LISTEN state that this process holds.
fn own_listeners() -> HashSet<u64> {
    let own: HashSet<u64> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect();
    let mut listening = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // st == 0A is LISTEN; column 9 is the inode.
            if cols.len() > 9
                && cols[3] == "0A"
                && let Ok(inode) = cols[9].parse::<u64>()
                && own.contains(&inode)
            {
                listening.insert(inode);
            }
        }
    }
    listening
}

#[tokio::test]
async fn the_worker_side_opens_no_listening_port() {
    let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    // The engine is the instance itself (on 127.0.0.1, as vLLM would be).
    let (_engine, handler) = worker_proxy(Default::default()).await;
    let before = own_listeners();
    assert!(before.len() >= 2, "server and engine listen: {before:?}");

    let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), handler);
    worker.connected(1).await;
    let stream = srv.server.open_stream(WORKER).await.unwrap();
    let req = http::Request::post("/v1/completions")
        .header("x-gpustack-model-instance", "model-1-7.static")
        .header("authorization", format!("Bearer {WORKER_CRED}"))
        .body(Full::new(Bytes::from_static(
            br#"{"model":"mock-model","prompt":"x"}"#,
        )))
        .unwrap();
    let resp = tunnel::http::send_request(stream, req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let _ = resp.into_body().collect().await.unwrap();

    // Serving through the tunnel added no listening socket.
    assert_eq!(own_listeners(), before);
    worker.stop().await;
    srv.stop().await;
}
