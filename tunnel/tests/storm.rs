//! Fault suite (issue #6): a reconnect storm. 1,000 workers (in-process tunnel clients with the
//! default backoff) lose their tunnels at once when the server stops, and all dial again when it
//! is back on the same port. Every one comes back, the registry holds each worker once, and the
//! process's tasks return to their baseline (nothing of the old sessions is left behind).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use testkit::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::time::Instant;

const WORKERS: i64 = 1000;

/// A `/proc/self/status` field in kB.
fn status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap()
}

fn open_files_limit() -> u64 {
    std::fs::read_to_string("/proc/self/limits")
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("Max open files")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(u64::MAX)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_workers_reconnect_after_a_server_restart() {
    // Two sockets per worker (both ends live in this process), plus slack.
    let limit = open_files_limit();
    assert!(
        limit >= 2 * WORKERS as u64 + 200,
        "this test needs `ulimit -n` >= {} (it is {limit})",
        2 * WORKERS + 200
    );
    let names: Vec<String> = (1..=WORKERS).map(|w| format!("tok-{w}")).collect();
    let pairs: Vec<(&str, i64)> = names
        .iter()
        .zip(1..=WORKERS)
        .map(|(t, w)| (t.as_str(), w))
        .collect();
    let tokens = tokens_with(&pairs);
    let srv = ServerHarness::start(tokens.clone(), Default::default()).await;
    let addr = srv.addr;

    let started = Instant::now();
    let mut workers = Vec::new();
    for (token, _) in &pairs {
        // The defaults a real worker runs with: backoff 100 ms .. 2 s, full jitter.
        let config = tunnel::TunnelClientConfig::new(srv.url(), *token);
        workers.push(Worker::start(config, test_handler));
    }
    let server = srv.server.clone();
    wait_until(
        Duration::from_secs(30),
        "first connect of every worker",
        || server.connected().len() == WORKERS as usize,
    )
    .await;
    eprintln!("{WORKERS} workers connected in {:?}", started.elapsed());
    // The baseline: every worker up once, each session registered on both ends.
    wait_until(
        Duration::from_secs(10),
        "every worker sees its tunnel",
        || workers.iter().all(|w| w.status.borrow().connected),
    )
    .await;
    let metrics = tokio::runtime::Handle::current().metrics();
    let tasks_before = metrics.num_alive_tasks();
    let rss_before = status_kb("VmRSS:");

    // The server goes away: every tunnel drops at the same moment.
    srv.stop().await;
    wait_until(Duration::from_secs(10), "every worker noticed", || {
        workers.iter().all(|w| !w.status.borrow().connected)
    })
    .await;
    // Down until every worker has failed a dial (a status update) and is in its backoff.
    for w in &mut workers {
        w.status.borrow_and_update();
    }
    wait_until(
        Duration::from_secs(10),
        "every worker failed a dial",
        || workers.iter().all(|w| w.status.has_changed().unwrap()),
    )
    .await;
    assert!(workers.iter().all(|w| !w.status.borrow().connected));

    // Back on the same port with an empty registry.
    let listener = TcpListener::bind(addr).await.unwrap();
    let srv = ServerHarness::start_on(listener, tokens, Default::default()).await;
    let back = Instant::now();
    let server = srv.server.clone();
    wait_until(Duration::from_secs(30), "every worker reconnected", || {
        server.connected().len() == WORKERS as usize
    })
    .await;
    let took = back.elapsed();
    // Workers count the tunnel as up a moment after the server does.
    wait_until(
        Duration::from_secs(10),
        "every worker sees its tunnel",
        || {
            workers.iter().all(|w| {
                let s = w.status.borrow();
                s.connected && s.connects >= 2
            })
        },
    )
    .await;
    eprintln!("reconnect storm: all {WORKERS} workers back {took:?} after the server returned");

    // Each worker exactly once, and each reconnected exactly once (no flapping, no duplicate
    // sessions replacing each other).
    let mut ids: Vec<i64> = server.connected().iter().map(|u| u.worker_id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), WORKERS as usize);
    let connects: Vec<u64> = workers.iter().map(|w| w.status.borrow().connects).collect();
    assert!(
        connects.iter().all(|&c| c == 2),
        "some workers connected more than twice: {:?}",
        connects.iter().filter(|&&c| c != 2).collect::<Vec<_>>()
    );

    // A sample of workers serve through their new tunnels.
    for w in (1..=WORKERS).step_by(97) {
        let mut s = tokio::time::timeout(T, server.open_stream(w))
            .await
            .unwrap()
            .unwrap();
        s.write_all(b"eping").await.unwrap();
        s.shutdown().await.unwrap();
        let mut back = Vec::new();
        tokio::time::timeout(T, s.read_to_end(&mut back))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(back, b"ping", "worker {w}");
    }

    // Nothing of the old sessions is left: tasks back to the baseline (small slack for the
    // sample streams winding down), memory close to it.
    wait_until(
        Duration::from_secs(10),
        "the alive tasks back to the baseline",
        || metrics.num_alive_tasks() <= tasks_before + 10,
    )
    .await;
    let tasks_after = metrics.num_alive_tasks();
    let rss_after = status_kb("VmRSS:");
    eprintln!(
        "alive tasks {tasks_before} -> {tasks_after}; RSS {} MiB -> {} MiB",
        rss_before / 1024,
        rss_after / 1024
    );
    assert!(
        tasks_after <= tasks_before + 10,
        "tasks leaked over the storm: {tasks_before} -> {tasks_after}"
    );
    assert!(
        rss_after <= rss_before + rss_before / 2,
        "memory grew over the storm: {rss_before} kB -> {rss_after} kB"
    );

    let mut stops = tokio::task::JoinSet::new();
    for w in workers {
        stops.spawn(w.stop());
    }
    while tokio::time::timeout(T, stops.join_next())
        .await
        .unwrap()
        .is_some()
    {}
    srv.stop().await;
}
