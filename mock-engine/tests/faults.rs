//! The mock engine's jitter, token sizes and faults by rate. The timing checks run on paused
//! tokio time: the engine's waits (first token, between tokens, stalls, slow reads) are tokio
//! timers, so the client in the same runtime sees them exactly, however loaded the machine.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use mock_engine::{Faults, Jitter, MockEngine, MockEngineConfig};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// What one completion looked like from the client.
#[derive(Debug)]
struct Timed {
    status: u16,
    /// From the request to the first data of the answer.
    first: Duration,
    /// Between consecutive data frames.
    gaps: Vec<Duration>,
    /// From the request to the end of the answer.
    total: Duration,
}

/// A text completion of `prompt_bytes` bytes (8 tokens), on a fresh connection.
async fn complete(addr: SocketAddr, stream: bool, prompt_bytes: usize) -> Timed {
    let body = serde_json::json!({
        "model": "mock-model",
        "prompt": "x".repeat(prompt_bytes),
        "max_tokens": 8,
        "stream": stream,
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::post("/v1/completions")
        .header("host", "engine")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let sent = Instant::now();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut arrivals = Vec::new();
    while let Some(frame) = body.frame().await {
        if frame.unwrap().data_ref().is_some_and(|d| !d.is_empty()) {
            arrivals.push(Instant::now());
        }
    }
    let total = sent.elapsed();
    Timed {
        status,
        first: arrivals.first().map_or(total, |t| *t - sent),
        gaps: arrivals.windows(2).map(|w| w[1] - w[0]).collect(),
        total,
    }
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

#[tokio::test(start_paused = true)]
async fn jitter_spreads_the_time_to_first_token() {
    let e = MockEngine::start(MockEngineConfig {
        time_to_first_token: Duration::from_millis(60),
        ttft_jitter: Jitter::Uniform(Duration::from_millis(50)),
        inter_token_delay: Duration::from_millis(2),
        itl_jitter: Jitter::Normal(Duration::from_millis(1)),
        seed: 3,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut firsts = Vec::new();
    for _ in 0..60 {
        let t = complete(e.addr, true, 64).await;
        assert_eq!(t.status, 200);
        firsts.push(t.first);
    }
    // Uniform in [10, 110] ms.
    let (min, max) = (*firsts.iter().min().unwrap(), *firsts.iter().max().unwrap());
    let p50 = median(firsts);
    assert!(millis(min) >= 10.0 && millis(min) < 40.0, "{min:?}");
    assert!(millis(max) > 80.0 && millis(max) <= 111.0, "{max:?}");
    assert!((35.0..=95.0).contains(&millis(p50)), "{p50:?}");
}

#[tokio::test]
async fn faults_among_the_first_n_requests_depend_only_on_the_seed() {
    let faults = Faults {
        error_rate: 0.2,
        rate_limit_rate: 0.2,
        ..Faults::default()
    };
    // The statuses of 100 requests to a fresh engine with `seed`.
    let statuses = |seed| {
        let faults = faults.clone();
        async move {
            let e = MockEngine::start(MockEngineConfig {
                faults,
                seed,
                ..Default::default()
            })
            .await
            .unwrap();
            let mut out = Vec::new();
            for _ in 0..100 {
                out.push(complete(e.addr, false, 64).await.status);
            }
            out
        }
    };
    let (a, b, c) = (statuses(9).await, statuses(9).await, statuses(10).await);
    assert_eq!(a, b);
    assert_ne!(a, c);
    let count = |code| a.iter().filter(|s| **s == code).count();
    assert!((8..=35).contains(&count(500)), "{a:?}");
    assert!(count(429) > 0, "{a:?}");
}

#[tokio::test]
async fn tokens_have_the_configured_size() {
    let e = MockEngine::start(MockEngineConfig {
        bytes_per_token: 20,
        ..Default::default()
    })
    .await
    .unwrap();
    let client = testkit::http_client::Client::new(format!("http://{}", e.addr));
    let reply = client
        .post("/v1/completions", &serde_json::json!({"max_tokens": 5}))
        .await
        .expect(200);
    let text = reply.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(text.len(), 100);
    assert!(text.starts_with("tok0xxxxxxxxxxxxxxx tok1x"), "{text}");
}

#[tokio::test(start_paused = true)]
async fn stalls_and_slow_reads_take_their_time() {
    // Stall after the first token: one gap of the stall in each stream.
    let e = MockEngine::start(MockEngineConfig {
        faults: Faults {
            stall_after_first_rate: 1.0,
            stall: Duration::from_millis(200),
            ..Faults::default()
        },
        ..Default::default()
    })
    .await
    .unwrap();
    for _ in 0..4 {
        let t = complete(e.addr, true, 64).await;
        assert_eq!(t.status, 200);
        let longest = *t.gaps.iter().max().unwrap();
        assert!(millis(longest) >= 200.0, "{t:?}");
        assert!(millis(median(t.gaps.clone())) < 50.0, "{t:?}");
        assert!(millis(t.first) < 100.0, "{t:?}");
    }
    assert_eq!(e.stats.stalls(), 4);

    // 32 KiB read at 64 KiB/s: half a second.
    let e = MockEngine::start(MockEngineConfig {
        faults: Faults {
            slow_read_rate: 1.0,
            slow_read_bytes_per_sec: 64 * 1024,
            ..Faults::default()
        },
        ..Default::default()
    })
    .await
    .unwrap();
    let t = complete(e.addr, false, 32 * 1024).await;
    assert_eq!((t.status, e.stats.slow_reads()), (200, 1));
    assert!((450.0..=600.0).contains(&millis(t.total)), "{t:?}");
}
