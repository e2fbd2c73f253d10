//! The performance model over real sockets: prefix-cache hits in answers and metrics, LRU
//! eviction, the bound on running requests and its queue, stall and resume, a cache cleared; and
//! `/metrics` with the model off.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use mock_engine::prompt::{self, BYTES_PER_TOKEN};
use mock_engine::{
    MockEngine, MockEngineConfig, MockEngineHandle, ModelStats, PerfModel, StreamKind,
};
use serde_json::{Value, json};
use testkit::http_client::{Client, read_until};
use tokio::task::JoinSet;

/// Bytes of one 16-token block.
const BLOCK: usize = 16 * BYTES_PER_TOKEN;

async fn engine(perf: PerfModel) -> MockEngineHandle {
    MockEngine::start(MockEngineConfig {
        tokens: 2,
        perf: Some(perf),
        ..MockEngineConfig::default()
    })
    .await
    .unwrap()
}

fn model(kv_blocks: usize) -> PerfModel {
    PerfModel {
        kv_blocks,
        prefill_per_token: Duration::from_micros(100),
        ..PerfModel::default()
    }
}

fn client(engine: &MockEngineHandle) -> Client {
    Client::new(format!("http://{}", engine.addr))
}

/// A text completion of `prompt`, not streamed: its `usage`.
async fn complete(c: &Client, prompt: &str) -> Value {
    let reply = c
        .post(
            "/v1/completions",
            &json!({"model": "mock-model", "prompt": prompt}),
        )
        .await
        .expect(200);
    reply.json()["usage"].clone()
}

fn cached(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// A prompt of `blocks` whole blocks plus `extra` bytes, from the letter `c`.
fn text(c: char, blocks: usize, extra: usize) -> String {
    c.to_string().repeat(blocks * BLOCK + extra)
}

fn streaming_client() -> HyperClient<HttpConnector, Full<Bytes>> {
    HyperClient::builder(TokioExecutor::new()).build_http()
}

/// Starts a streamed chat completion and returns its response head (the body still streaming).
async fn start_stream(engine: &MockEngineHandle, user: &str) -> http::Response<Incoming> {
    let body = json!({
        "model": "mock-model",
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": user}],
    });
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("http://{}/v1/chat/completions", engine.addr))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), streaming_client().request(req))
        .await
        .unwrap()
        .unwrap()
}

/// The samples of a Prometheus text page, keyed by `name{labels}`; panics on a malformed line
/// or a sample whose family has no `# TYPE`.
fn parse_metrics(page: &str) -> HashMap<String, f64> {
    let mut types = HashMap::new();
    let mut samples = HashMap::new();
    for line in page.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            types.insert(name.to_owned(), kind.to_owned());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (key, value) = line.rsplit_once(' ').unwrap();
        let name = key.split('{').next().unwrap();
        assert!(
            name.starts_with("vllm:") && key.ends_with('}'),
            "malformed sample: {line}"
        );
        let family = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| types.contains_key(*f)))
            .unwrap_or(name);
        assert!(types.contains_key(family), "no # TYPE for {line}");
        assert!(
            key.contains(r#"model_name="mock-model""#) && key.contains(r#"engine="0""#),
            "labels of {line}"
        );
        samples.insert(key.to_owned(), value.parse::<f64>().unwrap());
    }
    samples
}

async fn scrape(engine: &MockEngineHandle) -> HashMap<String, f64> {
    let reply = client(engine).get("/metrics").await.expect(200);
    assert!(
        reply.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    parse_metrics(&reply.text())
}

fn sample(samples: &HashMap<String, f64>, name: &str) -> f64 {
    let key = format!(r#"vllm:{name}{{model_name="mock-model",engine="0"}}"#);
    *samples
        .get(&key)
        .unwrap_or_else(|| panic!("no {key} in {samples:?}"))
}

#[tokio::test]
async fn a_repeated_prompt_hits_the_cache_and_its_prefill_is_shorter() {
    let e = engine(model(64)).await;
    let c = client(&e);
    // 5 whole blocks and 2 bytes: 81 tokens.
    let p = text('a', 5, 2);
    let started = tokio::time::Instant::now();
    let first = complete(&c, &p).await;
    assert_eq!(first["prompt_tokens"], 81);
    assert_eq!(cached(&first), 0);
    let s1 = e.model_stats();
    // The scheduled time to first token is the prefill of every token...
    assert_eq!(s1.ttft_sum, Duration::from_micros(100) * 81);
    assert!(started.elapsed() >= s1.ttft_sum);

    let second = complete(&c, &p).await;
    assert_eq!(cached(&second), 80);
    let s2 = e.model_stats();
    // ...then of the one token past the cached blocks.
    assert_eq!(s2.ttft_sum - s1.ttft_sum, Duration::from_micros(100));
    assert_eq!((s2.prefix_cache_queries, s2.prefix_cache_hits), (162, 80));
    assert_eq!(s2.cached_blocks, 5);

    // A prompt of whole blocks: its last token is always computed, so its last block is not a
    // hit (as in vLLM).
    let whole = text('w', 4, 0);
    assert_eq!(cached(&complete(&c, &whole).await), 0);
    assert_eq!(cached(&complete(&c, &whole).await), 48);

    // An engine restart forgets its cache.
    e.clear_cache();
    assert_eq!(e.model_stats().cached_blocks, 0);
    assert_eq!(cached(&complete(&c, &p).await), 0);
    assert_eq!(cached(&complete(&c, &p).await), 80);
}

#[tokio::test]
async fn a_shared_prefix_hits_only_its_whole_shared_blocks() {
    let e = engine(model(64)).await;
    let c = client(&e);
    let system = "s".repeat(200);
    let chat = |user: &str| {
        json!({"model": "mock-model", "max_tokens": 3, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "text", "text": user}]},
        ]})
    };
    // "system\n" + 200 bytes + "\n" + "user\n" are shared: 213 bytes, 3 whole blocks of 64.
    let a = chat(&"x".repeat(100));
    let b = chat(&"y".repeat(100));
    let rendered = prompt::render_prompt(StreamKind::Chat, a.to_string().as_bytes()).unwrap();
    assert_eq!(rendered.len(), 7 + 200 + 1 + 5 + 100 + 1);
    let tokens = prompt::token_count(rendered.len()) as u64;

    let ua = c.post("/v1/chat/completions", &a).await.expect(200).json()["usage"].clone();
    assert_eq!(ua["prompt_tokens"].as_u64(), Some(tokens));
    assert_eq!(ua["completion_tokens"], 3);
    assert_eq!(cached(&ua), 0);
    let ub = c.post("/v1/chat/completions", &b).await.expect(200).json()["usage"].clone();
    assert_eq!(cached(&ub), 48);
    // The first request's own blocks are all there: 4 whole blocks of its 314 bytes.
    let again = c.post("/v1/chat/completions", &a).await.expect(200).json()["usage"].clone();
    assert_eq!(cached(&again), 64);
    assert_eq!(
        e.model_stats().prefix_cache_hits,
        48 + 64,
        "hits count tokens"
    );
}

#[tokio::test]
async fn a_small_cache_evicts_the_least_recently_used_blocks_tail_first() {
    // 4 blocks; each prompt below has 2 whole blocks (33 tokens).
    let e = engine(model(4)).await;
    let c = client(&e);
    let (a, b, d) = (text('a', 2, 4), text('b', 2, 4), text('d', 2, 4));
    let mut hits = Vec::new();
    for p in [&a, &b, &d, &b, &a, &d] {
        hits.push(cached(&complete(&c, p).await));
    }
    // a, b fill the cache; d evicts a (released first); b is still there and is touched; a
    // evicts d; d evicts b.
    assert_eq!(hits, [0, 0, 0, 32, 0, 0]);
    let s = e.model_stats();
    assert_eq!((s.cached_blocks, s.used_blocks, s.kv_blocks), (4, 0, 4));

    // A one-block prompt evicts only the least recently used block: the tail of the prompt
    // released longest ago, whose head stays a hit.
    let e = engine(model(4)).await;
    let c = client(&e);
    complete(&c, &a).await;
    complete(&c, &b).await;
    complete(&c, &text('z', 1, 4)).await;
    assert_eq!(cached(&complete(&c, &a).await), 16);
}

#[tokio::test]
async fn the_running_bound_queues_requests_in_arrival_order() {
    let e = MockEngine::start(MockEngineConfig {
        tokens: 2,
        // The second token never comes while the test runs: each stream holds its slot.
        inter_token_delay: Duration::from_secs(3600),
        perf: Some(PerfModel {
            max_running: 2,
            ..model(64)
        }),
        ..MockEngineConfig::default()
    })
    .await
    .unwrap();
    let mut first = start_stream(&e, "one").await.into_body();
    let mut second = start_stream(&e, "two").await.into_body();
    let mut third = start_stream(&e, "three").await.into_body();
    let s = e
        .wait_model_stats(|s| s.running == 2 && s.waiting == 1)
        .await;
    assert!(!s.stalled);
    let m = scrape(&e).await;
    assert_eq!(sample(&m, "num_requests_running"), 2.0);
    assert_eq!(sample(&m, "num_requests_waiting"), 1.0);
    for body in [&mut first, &mut second] {
        let mut buf = String::new();
        assert!(
            read_until(body, &mut buf, Duration::from_secs(30), |t| t
                .contains("tok0"))
            .await
        );
    }
    // A client that leaves frees its slot: the queued stream starts.
    drop(first);
    let mut buf = String::new();
    assert!(
        read_until(&mut third, &mut buf, Duration::from_secs(30), |t| t
            .contains("tok0"))
        .await
    );
    e.wait_model_stats(|s| s.running == 2 && s.waiting == 0)
        .await;
    drop((second, third));
    e.wait_model_stats(|s| s.running == 0).await;
}

#[tokio::test]
async fn a_stalled_engine_queues_everything_until_resumed() {
    let e = engine(PerfModel {
        max_running: 2,
        ..model(64)
    })
    .await;
    let c = client(&e);
    e.stall();
    let mut requests = JoinSet::new();
    for i in 0..5 {
        let c = c.clone();
        requests.spawn(async move { complete(&c, &text('q', 3, i + 1)).await });
    }
    let s = e.wait_model_stats(|s| s.waiting == 5).await;
    assert_eq!((s.running, s.stalled), (0, true));
    let m = scrape(&e).await;
    assert_eq!(sample(&m, "num_requests_waiting"), 5.0);
    assert_eq!(sample(&m, "num_requests_running"), 0.0);
    e.resume();
    let mut hits = 0;
    while let Some(usage) = requests.join_next().await {
        hits += cached(&usage.unwrap());
    }
    // They share 3 whole blocks; the first prefill's blocks are cached when it ends, after the
    // second was admitted beside it: 3 requests hit them.
    assert_eq!(hits, 3 * 48);
    let s = e.model_stats();
    assert_eq!((s.running, s.waiting, s.stalled), (0, 0, false));
}

#[tokio::test]
async fn metrics_match_the_answers() {
    let e = engine(model(32)).await;
    let c = client(&e);
    let (mut prompt_tokens, mut cached_tokens, mut completion_tokens) = (0, 0, 0);
    for p in [
        text('m', 3, 1),
        text('m', 3, 9),
        text('n', 1, 0),
        text('m', 5, 0),
    ] {
        let usage = complete(&c, &p).await;
        prompt_tokens += usage["prompt_tokens"].as_u64().unwrap();
        completion_tokens += usage["completion_tokens"].as_u64().unwrap();
        cached_tokens += cached(&usage);
    }
    // A stream's usage chunk carries the details too.
    let mut body = start_stream(&e, &text('m', 3, 1)).await.into_body();
    let mut sse = String::new();
    read_until(&mut body, &mut sse, Duration::from_secs(30), |t| {
        t.ends_with("data: [DONE]\n\n")
    })
    .await;
    let usage_event = sse
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v["usage"].is_object())
        .unwrap();
    let usage = &usage_event["usage"];
    assert_eq!(usage_event["choices"], json!([]));
    prompt_tokens += usage["prompt_tokens"].as_u64().unwrap();
    completion_tokens += usage["completion_tokens"].as_u64().unwrap();
    cached_tokens += cached(usage);
    assert!(cached_tokens > 0);
    e.wait_model_stats(|s| s.running == 0).await;

    let m = scrape(&e).await;
    assert_eq!(sample(&m, "prefix_cache_hits_total"), cached_tokens as f64);
    assert_eq!(
        sample(&m, "prefix_cache_queries_total"),
        prompt_tokens as f64
    );
    assert_eq!(sample(&m, "prompt_tokens_total"), prompt_tokens as f64);
    assert_eq!(
        sample(&m, "generation_tokens_total"),
        completion_tokens as f64
    );
    assert_eq!(sample(&m, "kv_cache_usage_perc"), 0.0);
    assert_eq!(sample(&m, "time_to_first_token_seconds_count"), 5.0);
    let s = e.model_stats();
    assert_eq!(
        sample(&m, "time_to_first_token_seconds_sum"),
        s.ttft_sum.as_secs_f64()
    );
    let info = m
        .iter()
        .find(|(k, _)| k.starts_with("vllm:cache_config_info{"))
        .unwrap();
    assert!(info.0.contains(r#"block_size="16""#), "{}", info.0);
    assert!(info.0.contains(r#"num_gpu_blocks="32""#), "{}", info.0);
    assert!(info.0.contains(r#"enable_prefix_caching="True""#));
    assert_eq!(*info.1, 1.0);
    let inf =
        r#"vllm:time_to_first_token_seconds_bucket{model_name="mock-model",engine="0",le="+Inf"}"#;
    assert_eq!(m[inf], 5.0);
    // Scrapes are not requests.
    assert_eq!(e.stats.requests(), 5);
    assert_eq!(e.stats.scrapes(), 1);
}

#[tokio::test]
async fn kv_cache_usage_counts_the_pinned_blocks_of_running_requests() {
    let e = MockEngine::start(MockEngineConfig {
        tokens: 2,
        inter_token_delay: Duration::from_secs(3600),
        perf: Some(model(8)),
        ..MockEngineConfig::default()
    })
    .await
    .unwrap();
    // "user\n" + 123 bytes + "\n": 129 bytes, 2 whole blocks.
    let mut body = start_stream(&e, &"u".repeat(123)).await.into_body();
    let mut buf = String::new();
    assert!(
        read_until(&mut body, &mut buf, Duration::from_secs(30), |t| t
            .contains("tok0"))
        .await
    );
    let s = e.wait_model_stats(|s| s.used_blocks == 2).await;
    assert_eq!(s.cached_blocks, 2);
    assert_eq!(sample(&scrape(&e).await, "kv_cache_usage_perc"), 0.25);
    drop(body);
    let s = e.wait_model_stats(|s| s.running == 0).await;
    assert_eq!((s.used_blocks, s.cached_blocks), (0, 2));
}

#[tokio::test]
async fn without_the_model_metrics_count_requests_in_flight() {
    let e = MockEngine::start(MockEngineConfig {
        tokens: 2,
        inter_token_delay: Duration::from_secs(3600),
        ..MockEngineConfig::default()
    })
    .await
    .unwrap();
    let m = scrape(&e).await;
    assert_eq!(sample(&m, "num_requests_running"), 0.0);
    assert_eq!(sample(&m, "prefix_cache_hits_total"), 0.0);
    assert!(
        m.keys()
            .any(|k| k.contains(r#"enable_prefix_caching="False""#))
    );

    let mut body = start_stream(&e, "hello").await.into_body();
    let mut buf = String::new();
    assert!(
        read_until(&mut body, &mut buf, Duration::from_secs(30), |t| t
            .contains("tok0"))
        .await
    );
    let s = e.wait_model_stats(|s| s.running == 1).await;
    assert_eq!(
        s,
        ModelStats {
            running: 1,
            prompt_tokens: s.prompt_tokens,
            generation_tokens: 1,
            ..ModelStats::default()
        }
    );
    assert_eq!(sample(&scrape(&e).await, "num_requests_running"), 1.0);
    drop(body);
    e.wait_model_stats(|s| s.running == 0).await;

    // Answers keep their usage without details; stall and clear do nothing.
    e.stall();
    let usage = client(&e)
        .post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}))
        .await
        .expect(200)
        .json()["usage"]
        .clone();
    assert!(usage.get("prompt_tokens_details").is_none(), "{usage}");
    e.clear_cache();
    assert_eq!(e.stats.requests(), 2);
}

#[tokio::test]
async fn the_binary_takes_the_model_flags() {
    let (_engine, addr) = testkit::process::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_faden-mock-engine")),
        &[
            "--port",
            "0",
            "--tokens",
            "2",
            "--kv-blocks",
            "100",
            "--block-tokens",
            "8",
            "--max-running",
            "4",
            "--prefill-per-token",
            "10us",
            "--itl-per-running",
            "1us",
        ],
        &[],
        "mock engine listening",
        "addr",
    )
    .await;
    let c = Client::new(format!("http://{addr}"));
    let p = text('b', 2, 1);
    assert_eq!(cached(&complete(&c, &p).await), 0);
    // 2 blocks of 16 tokens are 4 blocks of 8.
    assert_eq!(cached(&complete(&c, &p).await), 32);
    let page = c.get("/metrics").await.expect(200).text();
    let m = parse_metrics(&page);
    assert_eq!(sample(&m, "prefix_cache_hits_total"), 32.0);
    assert!(page.contains(r#"block_size="8""#) && page.contains(r#"num_gpu_blocks="100""#));
}
