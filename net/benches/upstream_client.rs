//! One request and its response through the upstream client, `net::pool` with the client side of
//! `net::h1` against hyper-util's legacy `Client` (the crate it replaces), both on kept-alive
//! loopback connections to the same tiny HTTP/1.1 server on one current-thread runtime. The
//! figure the hand-written client is kept for: docs/performance.md.

// Benchmark setup: failing loudly is right.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::Method;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use net::pool::{Pool, PoolConfig};

#[path = "tiny_upstream/mod.rs"]
mod tiny_upstream;

use tiny_upstream::{request, tiny_server};

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let addr = rt.block_on(tiny_server());
    let pool = rt.block_on(async {
        Pool::new(PoolConfig {
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            max_idle: 16,
        })
    });
    let hyper_client = rt.block_on(async {
        Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build_http::<Full<Bytes>>()
    });
    let post_body = Bytes::from(vec![b'y'; 1024]);
    for (name, method, body) in [
        ("GET", Method::GET, Bytes::new()),
        ("POST 1 KiB", Method::POST, post_body),
    ] {
        let mut group = c.benchmark_group(format!("upstream client {name}"));
        group.bench_function("net::pool", |b| {
            b.to_async(&rt).iter(|| async {
                let response = pool.send(request(&method, addr, &body)).await.unwrap();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                assert_eq!(body.len(), 64);
            });
        });
        group.bench_function("hyper-util legacy Client", |b| {
            b.to_async(&rt).iter(|| async {
                let response = hyper_client
                    .request(request(&method, addr, &body))
                    .await
                    .unwrap();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                assert_eq!(body.len(), 64);
            });
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
