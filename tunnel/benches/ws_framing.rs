//! One binary WebSocket message sent one way over an in-memory duplex and read whole at the
//! other end: `tunnel::ws_io` (client end masking, server end unmasking) against
//! tokio-tungstenite (the crate it replaces), for 12 B (a yamux window update), 512 B and
//! 16 KiB. The figure `ws_io` is kept for: docs/performance.md.

// Benchmark setup: failing loudly is right.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::time::Instant;

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use futures_util::{SinkExt as _, StreamExt as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;
use tunnel::ws_io::{Endpoint, Liveness, WsIo};

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for size in [12usize, 512, 16 * 1024] {
        let payload = Bytes::from(vec![0x5au8; size]);
        let mut group = c.benchmark_group(format!("ws message {size} B"));
        group.throughput(Throughput::Bytes(size as u64));

        let (a, b) = tokio::io::duplex(256 * 1024);
        let (mut tx, mut rx) = rt.block_on(async {
            (
                WsIo::new(a, Endpoint::Client, Liveness::default(), BytesMut::new()),
                WsIo::new(b, Endpoint::Server, Liveness::default(), BytesMut::new()),
            )
        });
        let mut got = vec![0u8; size];
        group.bench_function("ws_io", |bench| {
            bench.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let send = async {
                            tx.write_all(&payload).await.unwrap();
                            tx.flush().await.unwrap();
                        };
                        let recv = async { rx.read_exact(&mut got).await.unwrap() };
                        tokio::join!(send, recv);
                    }
                    start.elapsed()
                })
            });
        });

        let (a, b) = tokio::io::duplex(256 * 1024);
        let (mut tx, mut rx) = rt.block_on(async {
            (
                WebSocketStream::from_raw_socket(a, Role::Client, None).await,
                WebSocketStream::from_raw_socket(b, Role::Server, None).await,
            )
        });
        group.bench_function("tokio-tungstenite", |bench| {
            bench.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let send =
                            async { tx.send(Message::Binary(payload.clone())).await.unwrap() };
                        let recv = async {
                            match rx.next().await.unwrap().unwrap() {
                                Message::Binary(data) => assert_eq!(data.len(), payload.len()),
                                other => panic!("unexpected {other:?}"),
                            }
                        };
                        tokio::join!(send, recv);
                    }
                    start.elapsed()
                })
            });
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
