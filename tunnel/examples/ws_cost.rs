//! Instructions per WebSocket message for callgrind: `ws_cost ws_io|tungstenite SIZE N` sends N
//! binary messages of SIZE bytes one way over an in-memory duplex, each read whole at the other
//! end (the exchange of `benches/ws_framing.rs`). Two runs with different N, subtracted, give
//! the instructions per message without the start-up:
//!
//! ```text
//! cargo build --profile bench -p tunnel --example ws_cost
//! for n in 1000 11000; do valgrind --tool=callgrind --callgrind-out-file=/tmp/w.$n \
//!   target/release/examples/ws_cost ws_io 12 $n; done
//! ```
//!
//! The figure `ws_io` is kept for: docs/performance.md.

// A measurement tool: it fails loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use bytes::{Bytes, BytesMut};
use futures_util::{SinkExt as _, StreamExt as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;
use tunnel::ws_io::{Endpoint, Liveness, WsIo};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [how, size, n] = args.as_slice() else {
        panic!("usage: ws_cost ws_io|tungstenite SIZE N");
    };
    let size: usize = size.parse().unwrap();
    let n: usize = n.parse().unwrap();
    let payload = Bytes::from(vec![0x5au8; size]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (a, b) = tokio::io::duplex(256 * 1024);
        match how.as_str() {
            "ws_io" => {
                let mut tx = WsIo::new(a, Endpoint::Client, Liveness::default(), BytesMut::new());
                let mut rx = WsIo::new(b, Endpoint::Server, Liveness::default(), BytesMut::new());
                let mut got = vec![0u8; size];
                for _ in 0..n {
                    let send = async {
                        tx.write_all(&payload).await.unwrap();
                        tx.flush().await.unwrap();
                    };
                    let recv = async { rx.read_exact(&mut got).await.unwrap() };
                    tokio::join!(send, recv);
                }
            }
            "tungstenite" => {
                let mut tx = WebSocketStream::from_raw_socket(a, Role::Client, None).await;
                let mut rx = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
                for _ in 0..n {
                    let send = async { tx.send(Message::Binary(payload.clone())).await.unwrap() };
                    let recv = async {
                        match rx.next().await.unwrap().unwrap() {
                            Message::Binary(data) => assert_eq!(data.len(), size),
                            other => panic!("unexpected {other:?}"),
                        }
                    };
                    tokio::join!(send, recv);
                }
            }
            _ => panic!("ws_io or tungstenite"),
        }
    });
}
