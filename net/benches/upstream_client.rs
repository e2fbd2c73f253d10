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

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use net::pool::{Pool, PoolConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Every answer: 64 bytes of body, as a small JSON answer would be.
const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 64\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx";

/// A keep-alive HTTP/1.1 server that reads each request head (and a `Content-Length` body)
/// and writes [`ANSWER`].
async fn tiny_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            tokio::spawn(answer(stream));
        }
    });
    addr
}

async fn answer(mut stream: TcpStream) {
    stream.set_nodelay(true).unwrap();
    let mut buf = Vec::with_capacity(8192);
    loop {
        // One whole request (head and body) in `buf`, then the answer.
        let consumed = loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut req = httparse::Request::new(&mut headers);
            if let httparse::Status::Complete(head) = req.parse(&buf).unwrap() {
                let body = req
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                    .map_or(0, |h| {
                        std::str::from_utf8(h.value).unwrap().parse().unwrap()
                    });
                if buf.len() >= head + body {
                    break head + body;
                }
            }
            if stream.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                return;
            }
        };
        buf.drain(..consumed);
        if stream.write_all(ANSWER).await.is_err() {
            return;
        }
    }
}

fn request(method: &Method, addr: SocketAddr, body: &Bytes) -> Request<Full<Bytes>> {
    let mut req = Request::builder()
        .method(method.clone())
        .uri(format!("http://{addr}/v1/chat/completions"));
    if !body.is_empty() {
        req = req.header("content-type", "application/json");
    }
    req.body(Full::new(body.clone())).unwrap()
}

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
