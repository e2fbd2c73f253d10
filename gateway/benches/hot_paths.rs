//! Per-request hot paths of the gateway, each alone: `model` extraction from JSON bodies, the
//! prompt's block hashes read in the same pass (per KiB of prompt), key verification, the P2C pick, header sanitising, the response counter and the token usage
//! scanners.

// Benchmark setup: failing loudly is right.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::sync::Arc;

use control_client::model::{ProxyMode, Scope};
use control_client::routing::{CredentialEntry, Endpoint, RoutingSnapshot};
use control_client::tokens;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gateway::balance::{Balancer, Outcome};
use gateway::metrics::Metrics;
use gateway::{EjectionConfig, auth, route};
use http::{HeaderMap, HeaderName, HeaderValue};
use net::headers;

#[path = "usage_inputs/mod.rs"]
mod usage_inputs;

use usage_inputs::{
    chat_answer, chat_stream, scan_json, scan_sse, serde_json_sse, serde_json_whole,
};

/// A chat request of about `size` bytes, `model` last (the scanner must skip everything).
fn chat_body(size: usize) -> Vec<u8> {
    let mut messages = String::new();
    let mut i = 0;
    while messages.len() + 64 < size {
        if i > 0 {
            messages.push(',');
        }
        messages.push_str(&format!(
            r#"{{"role":"user","content":"message {i}: the quick brown fox \"jumps\""}}"#
        ));
        i += 1;
    }
    format!(r#"{{"messages":[{messages}],"max_tokens":64,"model":"llama-3-8b"}}"#).into_bytes()
}

fn model_extraction(c: &mut Criterion) {
    let mut g = c.benchmark_group("model_from_json");
    for (name, size) in [("1KB", 1024), ("100KB", 100 * 1024)] {
        let body = chat_body(size);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| route::model_from_json(black_box(body)).unwrap());
        });
    }
    g.finish();
}

/// The routing policy's reading of a request: the model with and without the prompt's shape
/// (its rendering's chained block hashes), and the hashing alone over a rendering. Throughput
/// in bytes: criterion's time per iteration over the size gives the cost per KiB of prompt.
fn prompt_hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("prompt_shape");
    for (name, size) in [("1KB", 1024), ("16KB", 16 * 1024), ("100KB", 100 * 1024)] {
        let body = chat_body(size);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(BenchmarkId::new("model_only", name), &body, |b, body| {
            b.iter(|| route::read_json_request_with(black_box(body), false).unwrap());
        });
        g.bench_with_input(
            BenchmarkId::new("model_and_blocks", name),
            &body,
            |b, body| {
                b.iter(|| route::read_json_request_with(black_box(body), true).unwrap());
            },
        );
        g.bench_with_input(
            BenchmarkId::new("blocks_of_rendering", name),
            &body,
            |b, body| {
                b.iter(|| gateway::prompt::PromptShape::of(black_box(body)));
            },
        );
    }
    g.finish();
}

fn key_verification(c: &mut Criterion) {
    let mut snapshot = RoutingSnapshot::default();
    let mut keys = Vec::new();
    for id in 0..1000 {
        let key = tokens::generate("gpustack");
        snapshot.credentials.insert(
            key.access_id.clone(),
            CredentialEntry {
                id,
                digest: key.digest,
                scope: Scope::Inference,
                expires_at: None,
            },
        );
        keys.push(key);
    }
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {}", keys[500].value)).unwrap(),
    );
    let now = chrono::Utc::now();
    c.bench_function("authenticate (1000 keys)", |b| {
        b.iter(|| auth::authenticate(black_box(&snapshot), black_box(&headers), || now).unwrap());
    });
}

fn endpoints(n: i64) -> Vec<Endpoint> {
    (1..=n)
        .map(|id| Endpoint {
            instance_id: id,
            model_id: 1,
            worker_id: id,
            worker_name: format!("w{id}"),
            cluster_id: 1,
            address: "10.0.0.1".into(),
            instance_port: 40000,
            worker_port: 10150,
            proxy_mode: ProxyMode::Direct,
            proxy_address: None,
        })
        .collect()
}

fn p2c_pick(c: &mut Criterion) {
    let mut g = c.benchmark_group("p2c_pick");
    for n in [1i64, 2, 100, 10_000] {
        let eps = endpoints(n);
        let balancer = Balancer::new(EjectionConfig::default());
        // Some load, so that the comparison has something to compare.
        let guards: Vec<_> = (0..n.min(64))
            .map(|_| balancer.pick(&eps, &[]).unwrap().start())
            .collect();
        g.bench_with_input(BenchmarkId::from_parameter(n), &eps, |b, eps| {
            b.iter(|| {
                let pick = balancer.pick(black_box(eps), &[]).unwrap();
                black_box(pick.endpoint.instance_id)
            });
        });
        if n < 2 {
            continue;
        }
        // A retry: one instance excluded (the fast path, unless that one is drawn).
        g.bench_with_input(BenchmarkId::new("retry", n), &eps, |b, eps| {
            b.iter(|| {
                let pick = balancer.pick(black_box(eps), &[1]).unwrap();
                black_box(pick.endpoint.instance_id)
            });
        });
        drop(guards);
    }
    // Every instance ejected (fail open): the full scan, which was the only path before the
    // two-draw fast path.
    let eps = endpoints(10_000);
    let balancer = Balancer::new(EjectionConfig::default());
    for i in 0..eps.len() {
        let pick = balancer.pick(&eps[i..=i], &[]).unwrap();
        for _ in 0..EjectionConfig::default().consecutive_failures {
            balancer.report(&pick.state, Outcome::Failure);
        }
    }
    g.bench_with_input(BenchmarkId::new("all_ejected", 10_000), &eps, |b, eps| {
        b.iter(|| {
            let pick = balancer.pick(black_box(eps), &[]).unwrap();
            black_box(pick.endpoint.instance_id)
        });
    });
    g.finish();
}

fn header_sanitising(c: &mut Criterion) {
    let mut client = HeaderMap::new();
    for (k, v) in [
        ("host", "gateway:8080"),
        ("user-agent", "openai-python/1.40"),
        ("accept", "application/json"),
        ("content-type", "application/json"),
        ("content-length", "1024"),
        (
            "authorization",
            "Bearer gpustack_0123456789abcdef_0123456789abcdef0123456789abcdef",
        ),
        ("x-request-id", "4f1c2b"),
    ] {
        client.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
    }
    c.bench_function("sanitize_request (7 headers)", |b| {
        b.iter_batched_ref(
            || client.clone(),
            |h| headers::sanitize_request(black_box(h)),
            criterion::BatchSize::SmallInput,
        );
    });
}

fn response_counter(c: &mut Criterion) {
    let metrics = Arc::new(Metrics::default());
    c.bench_function("metrics.request (existing label)", |b| {
        b.iter(|| metrics.request(black_box("llama-3-8b"), "chat/completions", 200));
    });
}

fn usage_scanning(c: &mut Criterion) {
    let small = chat_answer(8);
    c.bench_function("json usage scan (chat answer, one chunk)", |b| {
        b.iter(|| scan_json(&[&small]));
    });
    let mut tokens = 8;
    while chat_answer(tokens + 1).len() <= 4096 {
        tokens += 1;
    }
    let large = chat_answer(tokens);
    assert_eq!(serde_json_whole(&[&large]), scan_json(&[&large]));
    let chunks: Vec<&[u8]> = large.chunks(1024).collect();
    c.bench_function("json usage scan (4 KiB answer, 1 KiB chunks)", |b| {
        b.iter(|| scan_json(&chunks));
    });
    let stream = chat_stream(8);
    c.bench_function("sse usage scan (8 events + usage, one chunk each)", |b| {
        b.iter(|| scan_sse(&stream));
    });

    // The same jobs done with serde_json, the crate the scanners replace (the figure they are
    // kept for, docs/performance.md).
    assert_eq!(serde_json_whole(&[&small]), scan_json(&[&small]));
    c.bench_function("serde_json usage (chat answer, one chunk)", |b| {
        b.iter(|| serde_json_whole(&[&small]));
    });
    c.bench_function("serde_json usage (4 KiB answer, 1 KiB chunks)", |b| {
        b.iter(|| serde_json_whole(&chunks));
    });
    assert_eq!(serde_json_sse(&stream), scan_sse(&stream));
    c.bench_function(
        "serde_json sse usage (8 events + usage, one chunk each)",
        |b| {
            b.iter(|| serde_json_sse(&stream));
        },
    );
}

/// The trace context every request carries to its engine: the client's `traceparent` read,
/// the gateway's span id drawn, the header written (with and without a client context).
fn trace_propagation(c: &mut Criterion) {
    use gateway::trace_context;
    let mut with_parent = HeaderMap::new();
    with_parent.insert(
        "traceparent",
        HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    );
    for (name, headers) in [
        ("trace context (client traceparent)", with_parent),
        ("trace context (none: new trace)", HeaderMap::new()),
    ] {
        c.bench_function(name, |b| {
            b.iter_batched_ref(
                || headers.clone(),
                |h| {
                    let context = trace_context::child_of(trace_context::extract(h));
                    trace_context::inject(black_box(h), &context);
                },
                criterion::BatchSize::SmallInput,
            );
        });
    }
}

criterion_group!(
    benches,
    trace_propagation,
    model_extraction,
    prompt_hashing,
    key_verification,
    p2c_pick,
    header_sanitising,
    response_counter,
    usage_scanning
);
criterion_main!(benches);
