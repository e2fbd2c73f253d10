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

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use net::pool::{Pool, PoolConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 64\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx";

async fn answer(mut stream: TcpStream) {
    stream.set_nodelay(true).unwrap();
    let mut buf = Vec::with_capacity(8192);
    loop {
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
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                tokio::spawn(answer(stream));
            }
        });
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
