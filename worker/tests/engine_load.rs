//! The worker's reading of its engines: the mock engine's vLLM-named page, its queue growing
//! while it is stalled, an engine without a page left alone, a late page still read, a restart
//! telling a new epoch.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use control_client::engine_load::{EngineLoads, Reading};
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle, PerfModel};
use serde_json::json;
use testkit::wait::wait_until;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use worker::engine_load::{DEFAULT_INTERVAL, SLOW_AFTER, scrape};

const LIMIT: Duration = Duration::from_secs(10);

fn perf_config() -> MockEngineConfig {
    MockEngineConfig {
        model: "demo".into(),
        tokens: 2,
        perf: Some(PerfModel {
            kv_blocks: 64,
            max_running: 2,
            ..PerfModel::default()
        }),
        ..MockEngineConfig::default()
    }
}

/// Reads `instances` into a new table until the returned token is cancelled.
fn start_scraper(instances: HashMap<i64, u16>) -> (Arc<EngineLoads>, CancellationToken) {
    let loads = EngineLoads::new();
    let shutdown = CancellationToken::new();
    let (tx, rx) = watch::channel(instances);
    let (l, s) = (loads.clone(), shutdown.clone());
    tokio::spawn(async move {
        let _keep = tx;
        scrape(rx, l, DEFAULT_INTERVAL, s).await;
    });
    (loads, shutdown)
}

fn reading(loads: &EngineLoads, id: i64) -> Option<Reading> {
    loads.get(id, Instant::now())
}

/// Sends `n` chats to `engine` in the background (they wait while it is stalled).
fn send_chats(engine: &MockEngineHandle, n: usize) {
    for _ in 0..n {
        let client = testkit::Client::new(format!("http://{}", engine.addr));
        tokio::spawn(async move {
            let body = json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}]});
            let _ = client.try_post("/v1/chat/completions", &body).await;
        });
    }
}

#[tokio::test]
async fn the_mock_engine_is_read_and_its_queue_seen_growing() {
    let engine = MockEngine::start(perf_config()).await.unwrap();
    let (loads, stop) = start_scraper(HashMap::from([(1, engine.port())]));
    wait_until(LIMIT, "a first reading", || reading(&loads, 1).is_some()).await;
    let first = reading(&loads, 1).unwrap().load;
    assert_eq!((first.waiting, first.running), (0, 0));
    assert_eq!(first.block_size, Some(16));
    assert_eq!(first.num_blocks, Some(64));
    assert_eq!(first.cache_tokens(), Some(1024));
    assert_eq!(first.kv_usage, Some(0.0));

    engine.stall();
    send_chats(&engine, 5);
    engine.wait_model_stats(|s| s.waiting == 5).await;
    let seen = Instant::now();
    wait_until(LIMIT, "five waiting", || {
        reading(&loads, 1).is_some_and(|r| r.load.waiting == 5)
    })
    .await;
    eprintln!(
        "the queue showed in the reading {:?} after the engine's",
        seen.elapsed()
    );
    let stalled = reading(&loads, 1).unwrap().load;
    assert_eq!(stalled.epoch, first.epoch, "a stall is no restart");
    engine.resume();
    wait_until(LIMIT, "the queue drained", || {
        reading(&loads, 1).is_some_and(|r| r.load.waiting == 0 && r.load.running == 0)
    })
    .await;
    stop.cancel();
}

/// A server that answers every request 404 and counts them.
async fn no_metrics_server() -> (u16, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = Arc::new(AtomicU64::new(0));
    let counted = hits.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |_req| {
                    counted.fetch_add(1, Ordering::Relaxed);
                    async {
                        http::Response::builder()
                            .status(404)
                            .body(http_body_util::Full::new(bytes::Bytes::new()))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    (port, hits)
}

#[tokio::test]
async fn an_engine_without_metrics_is_left_alone() {
    let engine = MockEngine::start(perf_config()).await.unwrap();
    let (plain, hits) = no_metrics_server().await;
    let (loads, stop) = start_scraper(HashMap::from([(1, engine.port()), (2, plain)]));
    // The mock engine's scrapes are the clock: 30 of them are about 3 s.
    let start = engine.stats.scrapes();
    wait_until(LIMIT, "30 reads of the engine with metrics", || {
        engine.stats.scrapes() >= start + 30
    })
    .await;
    let tries = hits.load(Ordering::Relaxed);
    assert!(
        (1..=u64::from(SLOW_AFTER) + 1).contains(&tries),
        "{tries} reads of a page that is not there"
    );
    assert!(reading(&loads, 2).is_none());
    assert!(reading(&loads, 1).is_some());
    stop.cancel();
}

#[tokio::test]
async fn a_restarted_engine_gets_a_new_epoch() {
    let engine = MockEngine::start(perf_config()).await.unwrap();
    let addr = engine.addr;
    let (loads, stop) = start_scraper(HashMap::from([(1, addr.port())]));
    // Some work, so that the counters have something to go back from.
    let client = testkit::Client::new(format!("http://{addr}"));
    client
        .post(
            "/v1/chat/completions",
            &json!({"model": "demo", "messages": [{"role": "user", "content": "hello there"}]}),
        )
        .await
        .expect(200);
    let done = engine.model_stats().prompt_tokens;
    assert!(done > 0);
    let scrapes = engine.stats.scrapes();
    wait_until(LIMIT, "a reading after the request", || {
        engine.stats.scrapes() > scrapes + 1
    })
    .await;
    let before = reading(&loads, 1).unwrap().load.epoch;
    engine.stop().await;
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let again = MockEngine::start_on(listener, perf_config()).unwrap();
    wait_until(LIMIT, "a reading with a new epoch", || {
        reading(&loads, 1).is_some_and(|r| r.load.epoch != before)
    })
    .await;
    assert_eq!(reading(&loads, 1).unwrap().load.epoch, before + 1);
    stop.cancel();
    again.stop().await;
}

/// A `/metrics` server that holds every request without an answer (the reader gives up on it)
/// until `answer` is set, then answers each a second late, with a page of one running request.
/// Counts the requests.
async fn late_metrics_server() -> (u16, Arc<AtomicU64>, Arc<AtomicBool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (hits, answer) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let (counted, answering) = (hits.clone(), answer.clone());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (counted, answering) = (counted.clone(), answering.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |_req| {
                    counted.fetch_add(1, Ordering::Relaxed);
                    let answer = answering.load(Ordering::Relaxed);
                    async move {
                        if !answer {
                            std::future::pending::<()>().await;
                        }
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        http::Response::builder().body(http_body_util::Full::new(
                            bytes::Bytes::from_static(
                                b"vllm:num_requests_running{model_name=\"m\"} 1.0\n\
                                  vllm:num_requests_waiting{model_name=\"m\"} 0.0\n",
                            ),
                        ))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    (port, hits, answer)
}

#[tokio::test]
async fn an_engine_that_answers_late_is_still_read() {
    // An engine busy with its batches answers its page late: it keeps being read at its interval
    // (a broken one is read every `SLOW_RETRY`, 10 s, after `SLOW_AFTER` failures), and a page
    // a second late is taken.
    let engine = MockEngine::start(perf_config()).await.unwrap();
    let (port, hits, answer) = late_metrics_server().await;
    let (loads, stop) = start_scraper(HashMap::from([(1, engine.port()), (2, port)]));
    let late = u64::from(SLOW_AFTER) + 1;
    wait_until(Duration::from_secs(60), "the late reads", || {
        hits.load(Ordering::Relaxed) >= late
    })
    .await;
    // The engine with a prompt page is the clock: 60 reads are about 6 s, three read limits.
    let (tries, scrapes) = (hits.load(Ordering::Relaxed), engine.stats.scrapes());
    wait_until(
        Duration::from_secs(60),
        "60 reads of the prompt engine",
        || engine.stats.scrapes() >= scrapes + 60,
    )
    .await;
    let more = hits.load(Ordering::Relaxed) - tries;
    assert!(more >= 2, "{more} reads of a late engine in about 6 s");
    answer.store(true, Ordering::Relaxed);
    wait_until(
        Duration::from_secs(60),
        "a reading of the late engine",
        || reading(&loads, 2).is_some(),
    )
    .await;
    assert_eq!(reading(&loads, 2).unwrap().load.running, 1);
    stop.cancel();
}
