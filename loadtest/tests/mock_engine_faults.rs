//! The mock engine's jitter, token sizes and faults by rate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use faden_loadtest::{LoadModel, Report, RunConfig, Workload, WorkloadKind};
use mock_engine::{Faults, Jitter, MockEngine, MockEngineConfig};

async fn load(
    config: MockEngineConfig,
    requests: u64,
    stream: bool,
    prompt_bytes: usize,
) -> (Report, mock_engine::MockEngineHandle) {
    let e = MockEngine::start(config).await.unwrap();
    let mut c = RunConfig::new(format!("http://{}/v1", e.addr), "mock-model");
    c.load = LoadModel::Closed { concurrency: 4 };
    c.requests = Some(requests);
    c.timeout = Duration::from_secs(10);
    c.workloads = vec![Workload {
        kind: WorkloadKind::Completions,
        stream,
        prompt_bytes,
        max_tokens: 8,
        ..Workload::default()
    }];
    let r = tokio::time::timeout(Duration::from_secs(60), faden_loadtest::run(c))
        .await
        .unwrap()
        .unwrap();
    (r, e)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jitter_spreads_the_time_to_first_token() {
    let (r, _e) = load(
        MockEngineConfig {
            time_to_first_token: Duration::from_millis(60),
            ttft_jitter: Jitter::Uniform(Duration::from_millis(50)),
            inter_token_delay: Duration::from_millis(2),
            itl_jitter: Jitter::Normal(Duration::from_millis(1)),
            seed: 3,
            ..Default::default()
        },
        60,
        true,
        64,
    )
    .await;
    let t = r.ttft.unwrap();
    assert_eq!(r.ok, 60);
    // Uniform in [10, 110] ms.
    assert!(t.min_ms >= 9.0 && t.min_ms < 40.0, "{t:?}");
    assert!(t.max_ms > 80.0 && t.max_ms < 200.0, "{t:?}");
    assert!((35.0..=95.0).contains(&t.p50_ms), "{t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_among_the_first_n_requests_depend_only_on_the_seed() {
    let faults = Faults {
        error_rate: 0.2,
        rate_limit_rate: 0.2,
        ..Faults::default()
    };
    let config = |seed| MockEngineConfig {
        faults: faults.clone(),
        seed,
        ..Default::default()
    };
    let (a, _) = load(config(9), 100, false, 64).await;
    let (b, _) = load(config(9), 100, false, 64).await;
    let (c, _) = load(config(10), 100, false, 64).await;
    assert_eq!(a.errors, b.errors);
    assert_ne!(a.errors, c.errors);
    assert!((8..=35).contains(&a.errors.status(500)), "{:?}", a.errors);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalls_and_slow_reads_take_their_time() {
    // Stall after the first token: one gap of the stall in each stream.
    let (r, e) = load(
        MockEngineConfig {
            faults: Faults {
                stall_after_first_rate: 1.0,
                stall: Duration::from_millis(200),
                ..Faults::default()
            },
            ..Default::default()
        },
        4,
        true,
        64,
    )
    .await;
    assert_eq!(r.ok, 4);
    assert_eq!(e.stats.stalls(), 4);
    let itl = r.itl.unwrap();
    assert!(itl.max_ms >= 195.0 && itl.p50_ms < 50.0, "{itl:?}");
    assert!(r.ttft.unwrap().p50_ms < 100.0);

    // 32 KiB read at 64 KiB/s: about half a second.
    let (r, e) = load(
        MockEngineConfig {
            faults: Faults {
                slow_read_rate: 1.0,
                slow_read_bytes_per_sec: 64 * 1024,
                ..Faults::default()
            },
            ..Default::default()
        },
        1,
        false,
        32 * 1024,
    )
    .await;
    assert_eq!((r.ok, e.stats.slow_reads()), (1, 1));
    let lat = r.latency.unwrap();
    assert!((450.0..=1500.0).contains(&lat.p50_ms), "{lat:?}");
}
