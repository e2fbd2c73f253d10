//! The tiny keep-alive HTTP/1.1 upstream of the upstream-client measurements
//! (`benches/upstream_client.rs`, `examples/upstream_cost.rs`), and the request both send.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Every answer: 64 bytes of body, as a small JSON answer would be.
pub const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 64\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx";

/// A keep-alive HTTP/1.1 server that reads each request head (and a `Content-Length` body)
/// and writes [`ANSWER`].
pub async fn tiny_server() -> SocketAddr {
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

pub fn request(method: &Method, addr: SocketAddr, body: &Bytes) -> Request<Full<Bytes>> {
    let mut req = Request::builder()
        .method(method.clone())
        .uri(format!("http://{addr}/v1/chat/completions"));
    if !body.is_empty() {
        req = req.header("content-type", "application/json");
    }
    req.body(Full::new(body.clone())).unwrap()
}
