//! The load generator against the mock engine on 127.0.0.1:0: timings, bounds, load models,
//! error classes, the prefix-cache accounting from usage, --compare, and the binaries. The tests
//! that check timings run on paused tokio time: the engine's delays are tokio timers and the
//! load generator measures on tokio's clock, so the figures are exact however busy the machine.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::time::Duration;

use faden_loadtest::{LoadModel, Report, RunConfig, Workload, WorkloadKind};
use mock_engine::{Faults, MockEngine, MockEngineConfig, MockEngineHandle};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::time::Instant;

/// Bound on every test's run (the runs themselves are bounded; this catches hangs).
const HANG: Duration = Duration::from_secs(60);

async fn engine(config: MockEngineConfig) -> MockEngineHandle {
    MockEngine::start(config).await.unwrap()
}

fn timed(tokens: usize, ttft_ms: u64, itl_ms: u64) -> MockEngineConfig {
    MockEngineConfig {
        tokens,
        time_to_first_token: Duration::from_millis(ttft_ms),
        inter_token_delay: Duration::from_millis(itl_ms),
        record_limit: 0,
        ..Default::default()
    }
}

fn config(url: String, load: LoadModel, stream: bool, max_tokens: u32) -> RunConfig {
    let mut c = RunConfig::new(url, "mock-model");
    c.api_key = Some("test-key".to_owned());
    c.load = load;
    c.workloads = vec![Workload {
        kind: WorkloadKind::Chat,
        stream,
        max_tokens,
        ..Workload::default()
    }];
    c
}

fn url(e: &MockEngineHandle) -> String {
    format!("http://{}/v1", e.addr)
}

fn closed(c: usize) -> LoadModel {
    LoadModel::Closed { concurrency: c }
}

async fn run(c: RunConfig) -> Report {
    tokio::time::timeout(HANG, faden_loadtest::run(c))
        .await
        .expect("run hung")
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn known_delays_give_the_expected_percentiles() {
    let e = engine(timed(8, 50, 10)).await;
    let mut c = config(url(&e), closed(4), true, 8);
    c.requests = Some(40);
    let r = run(c).await;
    assert_eq!(r.ok, 40, "{}", r.to_text());
    assert_eq!(r.error_total, 0);
    assert_eq!(r.output_tokens, 40 * 8);
    let ttft = r.ttft.as_ref().unwrap();
    let itl = r.itl.as_ref().unwrap();
    let tpot = r.tpot.as_ref().unwrap();
    let lat = r.latency.as_ref().unwrap();
    assert!((45.0..=80.0).contains(&ttft.p50_ms), "{}", r.to_text());
    assert!(ttft.min_ms >= 49.0, "{}", r.to_text());
    assert!((7.0..=25.0).contains(&itl.p50_ms), "{}", r.to_text());
    assert_eq!(itl.count, 40 * 7);
    assert!((9.0..=20.0).contains(&tpot.p50_ms), "{}", r.to_text());
    // 50 ms + 7 × 10 ms.
    assert!((118.0..=200.0).contains(&lat.p50_ms), "{}", r.to_text());
    assert!(lat.max_ms >= lat.p99_ms && lat.p99_ms >= lat.p50_ms);
    // The engine saw our key and body.
    assert_eq!(e.stats.completed(), 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_stop_at_exactly_n() {
    let e = engine(MockEngineConfig::default()).await;
    let mut c = config(url(&e), closed(8), true, 4);
    c.requests = Some(57);
    let r = run(c).await;
    assert_eq!((r.sent, r.ok, r.unfinished), (57, 57, 0));
    assert_eq!(e.stats.requests(), 57);

    let mut c = config(
        url(&e),
        LoadModel::Open {
            rate: 500.0,
            max_outstanding: 64,
        },
        false,
        4,
    );
    c.requests = Some(25);
    let r = run(c).await;
    assert_eq!((r.sent, r.ok), (25, 25));
    assert_eq!(e.stats.requests(), 57 + 25);
}

#[tokio::test(start_paused = true)]
async fn duration_bounds_a_run_against_a_stalling_upstream() {
    let e = engine(MockEngineConfig {
        faults: Faults {
            stall_before_first_rate: 1.0,
            ..Faults::default()
        },
        ..timed(4, 0, 0)
    })
    .await;
    // With a timeout shorter than the run: timeouts, then new requests.
    let mut c = config(url(&e), closed(4), true, 4);
    c.duration = Some(Duration::from_secs(1));
    c.timeout = Duration::from_millis(300);
    let t = Instant::now();
    let r = run(c).await;
    assert!(
        t.elapsed() < Duration::from_millis(1800),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(r.ok, 0);
    assert!(r.errors.timeout >= 8, "{}", r.to_text());
    assert_eq!(r.error_total, r.errors.timeout);

    // With a long timeout: the end of the run cancels what is in flight.
    let mut c = config(url(&e), closed(4), false, 4);
    c.duration = Some(Duration::from_millis(500));
    let t = Instant::now();
    let r = run(c).await;
    assert!(
        t.elapsed() < Duration::from_millis(1300),
        "{:?}",
        t.elapsed()
    );
    assert_eq!((r.ok, r.error_total, r.unfinished), (0, 0, 4));
    assert!(r.elapsed_s <= 0.6, "{}", r.elapsed_s);
}

#[tokio::test(start_paused = true)]
async fn open_loop_keeps_its_rate() {
    let e = engine(timed(4, 5, 1)).await;
    let mut c = config(
        url(&e),
        LoadModel::Open {
            rate: 200.0,
            max_outstanding: 256,
        },
        true,
        4,
    );
    c.duration = Some(Duration::from_secs(2));
    let r = run(c).await;
    // 200/s × 2 s, less the few still running at the end.
    assert!((360..=401).contains(&r.sent), "{}", r.to_text());
    assert!(r.ok + r.unfinished >= r.sent - 1, "{}", r.to_text());
    assert_eq!(r.error_total, 0, "{}", r.to_text());
}

#[tokio::test(start_paused = true)]
async fn open_loop_drops_what_a_slow_target_cannot_take() {
    // Each answer takes 400 ms; 100/s with at most 5 in flight: most requests are dropped.
    let e = engine(timed(1, 400, 0)).await;
    let mut c = config(
        url(&e),
        LoadModel::Open {
            rate: 100.0,
            max_outstanding: 5,
        },
        false,
        1,
    );
    c.duration = Some(Duration::from_secs(1));
    let r = run(c).await;
    let due = r.sent + r.errors.dropped;
    assert!((95..=101).contains(&due), "{}", r.to_text());
    assert!(r.sent <= 15, "{}", r.to_text());
    assert!(r.errors.dropped >= 80, "{}", r.to_text());
    assert!(e.stats.requests() <= 15);
}

#[tokio::test(start_paused = true)]
async fn open_loop_latency_counts_from_the_intended_time() {
    // One slow answer (a 300 ms stall) with at most one request in flight: the requests due
    // meanwhile are dropped, never silently delayed. With room for more, the stall shows in one
    // request only, and the others keep their schedule.
    let e = engine(MockEngineConfig {
        faults: Faults {
            stall_before_first_rate: 0.05,
            stall: Duration::from_millis(300),
            ..Faults::default()
        },
        seed: 7,
        ..timed(1, 2, 0)
    })
    .await;
    let mut c = config(
        url(&e),
        LoadModel::Open {
            rate: 100.0,
            max_outstanding: 64,
        },
        false,
        1,
    );
    c.duration = Some(Duration::from_secs(1));
    let r = run(c).await;
    let stalls = e.stats.stalls();
    assert!(stalls > 0);
    let lat = r.latency.as_ref().unwrap();
    assert!(lat.max_ms >= 300.0, "{}", r.to_text());
    assert!(lat.p50_ms < 100.0, "{}", r.to_text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_counted_by_class() {
    let e = engine(MockEngineConfig {
        faults: Faults {
            error_rate: 0.15,
            error_status: 503,
            rate_limit_rate: 0.1,
            abort_rate: 0.1,
            abort_after_tokens: Some(2),
            ..Faults::default()
        },
        seed: 42,
        ..timed(4, 0, 1)
    })
    .await;
    let mut c = config(url(&e), closed(4), true, 4);
    c.requests = Some(200);
    let r = run(c).await;
    let s = &e.stats;
    assert!(s.injected_errors() > 10 && s.rate_limited() > 5 && s.aborted() > 5);
    assert_eq!(r.errors.status(503), s.injected_errors(), "{}", r.to_text());
    assert_eq!(r.errors.status(429), s.rate_limited(), "{}", r.to_text());
    assert_eq!(r.errors.stream_broken, s.aborted(), "{}", r.to_text());
    assert_eq!(r.errors.connect + r.errors.io + r.errors.timeout, 0);
    assert_eq!(r.ok + r.error_total, 200);
    assert_eq!(r.ok, s.completed());
    assert!(r.to_text().contains("HTTP 503 Service Unavailable"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_errors_are_counted() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut c = config(format!("http://127.0.0.1:{port}/v1"), closed(2), false, 1);
    c.duration = Some(Duration::from_millis(300));
    let r = run(c).await;
    assert_eq!(r.ok, 0);
    assert!(r.errors.connect > 0);
    assert_eq!(r.error_total, r.errors.connect);
}

/// A server answering every request with `response`, then closing.
async fn canned(response: &'static str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0; 64 * 1024];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(response.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    format!("http://{addr}/v1")
}

/// The canned answer of a stream with `body`, then a close.
fn stream_answer(body: &str) -> &'static str {
    let response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    Box::leak(response.into_boxed_str())
}

/// An engine that ends its stream after the finish reason and usage, without `[DONE]` (a
/// recorded answer of `transformers serve`), is answered; the same stream cut before its
/// finish reason is broken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ending_with_a_finish_reason_and_no_done_is_whole() {
    let recorded = include_str!("../../tests/fixtures/transformers-serve-stream.sse");
    let cut = recorded.find("\"finish_reason\"").unwrap();
    let cut = recorded[..cut].rfind("\n\n").unwrap() + 2;
    for (body, whole) in [(recorded, true), (&recorded[..cut], false)] {
        let url = canned(stream_answer(body)).await;
        let mut c = config(url, closed(1), true, 4);
        c.requests = Some(2);
        let r = run(c).await;
        let expected = if whole { (2, 0) } else { (0, 2) };
        assert_eq!((r.ok, r.errors.stream_broken), expected, "{}", r.to_text());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_without_done_or_with_an_error_event_are_broken() {
    let chunk = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n";
    for body in [
        // Ends cleanly but without [DONE] or a finish reason.
        Box::leak(chunk.to_owned().into_boxed_str()) as &'static str,
        // An error event, then [DONE].
        Box::leak(
            format!(
                "{chunk}event: error\ndata: {{\"message\":\"overloaded\"}}\n\ndata: [DONE]\n\n"
            )
            .into_boxed_str(),
        ),
    ] {
        let url = canned(stream_answer(body)).await;
        let mut c = config(url, closed(1), true, 4);
        c.requests = Some(3);
        let r = run(c).await;
        assert_eq!((r.ok, r.errors.stream_broken), (0, 3), "{}", r.to_text());
    }
}

fn http(content_type: &str, body: &str) -> &'static str {
    Box::leak(
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_boxed_str(),
    )
}

fn closed_n(url: String, n: u64, stream: bool) -> RunConfig {
    let mut c = config(url, closed(2), stream, 4);
    c.requests = Some(n);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hit_rate_is_cached_over_prompt_tokens_from_usage() {
    let usage = r#"{"prompt_tokens":100,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":60}}"#;
    let stream = format!(
        "data: {{\"choices\":[{{\"delta\":{{\"content\":\"a\"}}}}]}}\n\n\
         data: {{\"choices\":[{{\"delta\":{{}},\"finish_reason\":\"stop\"}}]}}\n\n\
         data: {{\"choices\":[],\"usage\":{usage}}}\n\ndata: [DONE]\n\n"
    );
    let url = canned(http("text/event-stream", &stream)).await;
    let r = run(closed_n(url, 10, true)).await;
    assert_eq!(r.ok, 10, "{}", r.to_text());
    assert_eq!((r.prompt_tokens, r.cached_tokens), (1000, 600));
    assert_eq!(r.cache_hit_rate, Some(0.6));
    assert_eq!((r.cache.prompt_reported, r.cache.cached_reported), (10, 10));
    assert!(r.to_text().contains("hit rate 60.0%"), "{}", r.to_text());

    // Non-streamed answers count too; an engine without cached_tokens gives 0 hits, and says so.
    let answer = r#"{"choices":[{"message":{"content":"a"}}],"usage":{"prompt_tokens":50,"completion_tokens":1,"prompt_tokens_details":null}}"#;
    let url = canned(http("application/json", answer)).await;
    let r = run(closed_n(url, 4, false)).await;
    assert_eq!((r.prompt_tokens, r.cached_tokens), (200, 0));
    assert_eq!(r.cache_hit_rate, Some(0.0));
    assert_eq!((r.cache.prompt_reported, r.cache.cached_reported), (4, 0));
}

#[tokio::test(start_paused = true)]
async fn compare_of_two_identical_engines_gives_ratios_near_one() {
    let a = engine(timed(4, 20, 5)).await;
    let b = engine(timed(4, 20, 5)).await;
    let mut ca = config(url(&a), closed(4), true, 4);
    ca.duration = Some(Duration::from_secs(2));
    let mut cb = ca.clone();
    cb.url = url(&b);
    let r = tokio::time::timeout(
        HANG,
        faden_loadtest::compare(ca, cb, Duration::from_millis(250)),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(r.slices, 4);
    assert!(r.a.ok > 20 && r.b.ok > 20);
    for key in [
        "rps",
        "latency_p50",
        "ttft_p50",
        "itl_p50",
        "output_tokens_per_s",
    ] {
        let v = r.ratio(key).unwrap();
        assert!((0.75..=1.33).contains(&v), "{key} = {v}\n{}", r.to_text());
    }
    assert!(r.to_text().contains("B/A"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mix_sends_each_workload() {
    let e = engine(MockEngineConfig {
        record_limit: 1000,
        ..timed(2, 0, 0)
    })
    .await;
    let mut c = RunConfig::new(url(&e), "mock-model");
    c.workloads = faden_loadtest::config::parse_mix(
        "- {workload: chat, stream: true, weight: 2, max_tokens: 3}\n- {workload: completions, max_tokens: 2}\n- {workload: embeddings, prompt_bytes: 1000}\n",
    )
    .unwrap();
    c.requests = Some(90);
    let r = run(c).await;
    assert_eq!(r.ok, 90, "{}", r.to_text());
    let seen = e.stats.seen();
    let count = |p: &str| seen.iter().filter(|s| s.uri == p).count();
    let (chat, cmpl, emb) = (
        count("/v1/chat/completions"),
        count("/v1/completions"),
        count("/v1/embeddings"),
    );
    assert_eq!(chat + cmpl + emb, 90);
    assert!(
        chat > cmpl && chat > emb && cmpl > 10 && emb > 10,
        "{chat} {cmpl} {emb}"
    );
    let emb_req = seen.iter().find(|s| s.uri == "/v1/embeddings").unwrap();
    assert_eq!(emb_req.body.len(), 1000);
    assert!(
        seen.iter()
            .all(|s| s.headers.get("authorization").is_none())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_the_key_and_the_body_size() {
    let e = engine(MockEngineConfig {
        record_limit: 10,
        ..timed(1, 0, 0)
    })
    .await;
    let mut c = config(url(&e), closed(1), true, 1);
    c.workloads[0].prompt_bytes = 4096;
    c.requests = Some(2);
    run(c).await;
    let last = e.stats.last_request().unwrap();
    assert_eq!(last.headers["authorization"], "Bearer test-key");
    assert_eq!(last.body.len(), 4096);
    let v: serde_json::Value = serde_json::from_slice(&last.body).unwrap();
    assert_eq!(v["stream"], true);
    assert_eq!(v["model"], "mock-model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_runs_a_load_and_writes_its_report() {
    let engine = engine(timed(3, 0, 1)).await;
    let addr = engine.addr;
    let dir = tempfile_dir();
    let json = dir.join("report.json");
    let out = tokio::time::timeout(
        HANG,
        tokio::process::Command::new(env!("CARGO_BIN_EXE_faden-loadtest"))
            .args([
                "--url",
                &format!("http://{addr}/v1"),
                "--model",
                "m",
                "-c",
                "2",
            ])
            .args([
                "--requests",
                "10",
                "--stream",
                "--max-tokens",
                "3",
                "--json",
            ])
            .arg(&json)
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ttft"), "{stdout}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["ok"], 10);
    assert_eq!(v["output_tokens"], 30);
    // A progress line only on a terminal or when asked: not here.
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(dir);
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("faden-loadtest-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `connection_per_request`: every request opens its own connection; without it one connection
/// carries them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_per_request_when_asked() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    const BODY: &str =
        r#"{"choices":[{"message":{"content":"a"}}],"usage":{"completion_tokens":1}}"#;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = vec![0; 64 * 1024];
                // Small requests on loopback: one read is one request.
                while s.read(&mut buf).await.is_ok_and(|n| n > 0) {
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{BODY}",
                        BODY.len()
                    );
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    for (per_request, connections) in [(false, 1), (true, 10)] {
        accepted.store(0, Ordering::SeqCst);
        let mut c = config(format!("http://{addr}/v1"), closed(1), false, 1);
        c.requests = Some(10);
        c.connection_per_request = per_request;
        let r = run(c).await;
        assert_eq!(r.ok, 10, "{}", r.to_text());
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            connections,
            "{per_request}"
        );
    }
}
