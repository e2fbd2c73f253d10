//! Instructions per request of the upstream client for callgrind: `net::pool` with the client
//! side of `net::h1` against hyper-util's legacy `Client` (the crate it replaces), N requests in
//! turn on one kept-alive loopback connection to a tiny HTTP/1.1 server in the same process and
//! runtime (the server's share is the same for both). Two runs with different N, subtracted,
//! give the instructions per request without the start-up:
//!
//! ```text
//! cargo build --profile bench -p net --example upstream_cost
//! for n in 1000 6000; do valgrind --tool=callgrind --callgrind-out-file=/tmp/c.$n \
//!   target/release/examples/upstream_cost pool post $n; done
//! ```
//!
//! The same exchange as `benches/upstream_client.rs`; the figure: docs/performance.md.

// A measurement tool: it fails loudly.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::time::Duration;

use bytes::Bytes;
use http::Method;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use net::pool::{Pool, PoolConfig};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "../benches/tiny_upstream/mod.rs"]
mod tiny_upstream;

use tiny_upstream::{request, tiny_server};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [client, method, n] = args.as_slice() else {
        panic!("usage: upstream_cost pool|hyper get|post N");
    };
    let n: usize = n.parse().unwrap();
    let (method, body) = match method.as_str() {
        "get" => (Method::GET, Bytes::new()),
        "post" => (Method::POST, Bytes::from(vec![b'y'; 1024])),
        _ => panic!("method: get or post"),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let addr = tiny_server().await;
        match client.as_str() {
            "pool" => {
                let pool = Pool::new(PoolConfig {
                    connect_timeout: Duration::from_secs(5),
                    idle_timeout: Duration::from_secs(60),
                    max_idle: 16,
                });
                for _ in 0..n {
                    let response = pool.send(request(&method, addr, &body)).await.unwrap();
                    let got = response.into_body().collect().await.unwrap().to_bytes();
                    assert_eq!(got.len(), 64);
                }
            }
            "hyper" => {
                let client = Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(Duration::from_secs(60))
                    .build_http::<Full<Bytes>>();
                for _ in 0..n {
                    let response = client.request(request(&method, addr, &body)).await.unwrap();
                    let got = response.into_body().collect().await.unwrap().to_bytes();
                    assert_eq!(got.len(), 64);
                }
            }
            _ => panic!("client: pool or hyper"),
        }
    });
}
