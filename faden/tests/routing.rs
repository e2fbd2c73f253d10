//! Cache-aware routing with the real binaries: a `faden server`, one worker reading four mock
//! engines' metrics, and a tenant's stream of requests. When the tenant's home engine stalls
//! (its queue grows), the engine's own reading reaches the gateway and new work goes elsewhere:
//! the test prints how long after the stall the stalled engine got its last request, and checks
//! that it got none afterwards while every request kept being answered by the others.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle, PerfModel};
use serde_json::json;
use testkit::process::start_faden_server;
use tokio::time::Instant;

use common::{T, bin, provision, start_worker, worker_args};

/// Chat requests an engine received (the worker's probes of it are requests too).
fn chats(e: &MockEngineHandle) -> usize {
    e.stats
        .seen()
        .iter()
        .filter(|r| r.uri.starts_with("/v1/chat/completions"))
        .count()
}

async fn engine() -> MockEngineHandle {
    MockEngine::start(MockEngineConfig {
        model: "demo".into(),
        tokens: 2,
        perf: Some(PerfModel {
            kv_blocks: 4096,
            prefill_per_token: Duration::from_micros(2),
            ..PerfModel::default()
        }),
        ..Default::default()
    })
    .await
    .unwrap()
}

/// One streamed chat of the tenant, sent and read to its end in the background.
fn send(gw: SocketAddr, key: &str, n: usize) -> tokio::task::JoinHandle<u16> {
    let system = "the tenant's shared instructions. ".repeat(100);
    let body = json!({"model": "demo", "stream": true, "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("question {n}")}]});
    let key = key.to_owned();
    tokio::spawn(async move {
        let Some(resp) = common::chat_body(gw, &key, body).await else {
            return 0;
        };
        let status = resp.status().as_u16();
        let mut text = String::new();
        let _ = common::drain_body(&mut resp.into_body(), &mut text).await;
        status
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_engine_stops_getting_work_and_its_tenant_moves() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_faden_server(bin(), &dir.path().join("server"), [0, 0, 0], &[], &[]).await;
    let (reg, key) = provision(&server.admin).await;
    let mut engines = Vec::new();
    for _ in 0..4 {
        engines.push(engine().await);
    }
    let mut args = worker_args(
        &server.api_url(),
        &reg,
        "direct",
        engines[0].port(),
        &dir.path().join("worker"),
    );
    for e in &engines[1..] {
        args.extend(["--instance".to_owned(), format!("demo={}", e.port())]);
    }
    // The worker reads the engines' metrics every 100 ms (the default).
    let (_worker, _) = start_worker(&args).await;
    let gw = server.gateway;
    testkit::wait::wait_until_async(T, "all four instances routable", || async {
        send(gw, &key, 0).await.unwrap() == 200
            && server.admin.get("/v2/model-instances?page=-1").await.json()["items"]
                .as_array()
                .is_some_and(|i| i.iter().filter(|i| i["state"] == "running").count() == 4)
    })
    .await;
    // The tenant's home: where its requests go.
    for n in 0..10 {
        assert_eq!(send(gw, &key, n).await.unwrap(), 200);
    }
    let counts: Vec<usize> = engines.iter().map(chats).collect();
    let home = (0..4).max_by_key(|i| counts[*i]).unwrap();
    assert!(counts[home] >= 10, "the tenant has no home: {counts:?}");

    // The home engine stalls: nothing it holds moves, its queue grows.
    engines[home].stall();
    let stalled_at = Instant::now();
    let mut last_to_home = Duration::ZERO;
    let at_stall = chats(&engines[home]);
    let mut seen = at_stall;
    let mut answered = Vec::new();
    let mut n = 100;
    let elsewhere = || -> usize {
        (0..4)
            .filter(|i| *i != home)
            .map(|i| chats(&engines[i]) - counts[i])
            .sum()
    };
    // 40 requests a second until the stalled engine has had no new request for a whole second
    // and the tenant was answered elsewhere (more than 50 requests): the load readings may lag
    // on a busy machine, so the test waits for that rather than judging a fixed window.
    loop {
        answered.push(send(gw, &key, n));
        n += 1;
        tokio::time::sleep(Duration::from_millis(25)).await;
        let now_seen = chats(&engines[home]);
        if now_seen > seen {
            seen = now_seen;
            last_to_home = stalled_at.elapsed();
        }
        if stalled_at.elapsed() - last_to_home >= Duration::from_secs(1) && elsewhere() > 50 {
            break;
        }
        assert!(
            stalled_at.elapsed() < Duration::from_secs(30),
            "the stalled engine still got work {last_to_home:?} after the stall, or the tenant \
             did not move: {} elsewhere",
            elsewhere()
        );
    }
    println!(
        "the stalled engine's last new request came {} ms after the stall ({} requests to it after the stall)",
        last_to_home.as_millis(),
        chats(&engines[home]) - at_stall,
    );
    engines[home].resume();
    for a in answered {
        assert_eq!(a.await.unwrap(), 200);
    }
}
