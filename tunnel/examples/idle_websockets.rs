//! Idle memory per open WebSocket connection: `tunnel::ws_io` against tokio-tungstenite, with
//! its default buffers and with 4 KiB read and write buffers.
//!
//! Each connection is a loopback TCP pair in this process, both ends framed (client and server)
//! and each end read by a task of its own, as the tunnel's connection task reads. Every
//! connection carries one 16 KiB message each way (opened 20 at a time, each batch left
//! [`IDLE_RELEASE`] and a bit to go idle), then all sit idle for two seconds before the
//! resident set is read; the growth over a warm-up batch, divided by the count, is the cost of
//! one idle connection, both ends together. `bare` holds the same TCP pairs and tasks without
//! framing: subtract it for the framing's own share. mimalloc with `no_thp`, as in `faden`.
//!
//! ```text
//! cargo build --profile bench -p tunnel --example idle_websockets
//! for m in bare ws_io tungstenite tungstenite-4k; do target/release/examples/idle_websockets $m 2000; done
//! ```

// A measurement tool: it prints its report and fails loudly.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::{SinkExt as _, StreamExt as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tunnel::ws_io::{Endpoint, IDLE_RELEASE, Liveness, WsIo};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WARMUP: usize = 50;
/// Connections opened together (see `main`).
const BATCH: usize = 20;
const MESSAGE: usize = 16 * 1024;
/// The message each end sends (static: no per-connection copy outlives the exchange).
/// `ws_io` ends that still held a buffer half a second after their last message.
static HELD: AtomicUsize = AtomicUsize::new(0);
static PAYLOAD: [u8; MESSAGE] = [0x5a; MESSAGE];

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Both ends of one framed connection: one message each way, then each end waits to read.
async fn open(mode: &str, listener: &TcpListener) {
    let client = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (server, _) = listener.accept().await.unwrap();
    let (done_tx, done_rx) = tokio::sync::mpsc::channel::<()>(2);
    let payload = Bytes::from_static(&PAYLOAD);
    match mode {
        "bare" => {
            for (mut io, first) in [(client, true), (server, false)] {
                let done = done_tx.clone();
                let payload = payload.clone();
                tokio::spawn(async move {
                    let mut got = vec![0u8; MESSAGE];
                    if first {
                        io.write_all(&payload).await.unwrap();
                        io.read_exact(&mut got).await.unwrap();
                    } else {
                        io.read_exact(&mut got).await.unwrap();
                        io.write_all(&payload).await.unwrap();
                    }
                    drop(got);
                    done.send(()).await.unwrap();
                    let mut byte = [0u8; 1];
                    let _ = io.read(&mut byte).await;
                });
            }
        }
        "ws_io" => {
            for (io, endpoint) in [(client, Endpoint::Client), (server, Endpoint::Server)] {
                let done = done_tx.clone();
                let payload = payload.clone();
                tokio::spawn(async move {
                    let mut ws = WsIo::new(io, endpoint, Liveness::default(), BytesMut::new());
                    let mut got = vec![0u8; MESSAGE];
                    if endpoint == Endpoint::Client {
                        ws.write_all(&payload).await.unwrap();
                        ws.flush().await.unwrap();
                        ws.read_exact(&mut got).await.unwrap();
                    } else {
                        ws.read_exact(&mut got).await.unwrap();
                        ws.write_all(&payload).await.unwrap();
                        ws.flush().await.unwrap();
                    }
                    drop(got);
                    done.send(()).await.unwrap();
                    let mut byte = [0u8; 1];
                    // Idle past the release time, then say whether buffers are still held.
                    let idle = tokio::time::timeout(Duration::from_millis(500), ws.read(&mut byte));
                    assert!(idle.await.is_err(), "nothing arrives");
                    if ws.buffers() != (false, 0) {
                        HELD.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = ws.read(&mut byte).await;
                });
            }
        }
        "tungstenite" | "tungstenite-4k" => {
            let config = (mode == "tungstenite-4k").then(|| {
                WebSocketConfig::default()
                    .read_buffer_size(4 * 1024)
                    .write_buffer_size(4 * 1024)
            });
            for (io, role) in [(client, Role::Client), (server, Role::Server)] {
                let done = done_tx.clone();
                let payload = payload.clone();
                tokio::spawn(async move {
                    let mut ws = WebSocketStream::from_raw_socket(io, role, config).await;
                    if role == Role::Client {
                        ws.send(Message::Binary(payload)).await.unwrap();
                        ws.next().await.unwrap().unwrap();
                    } else {
                        ws.next().await.unwrap().unwrap();
                        ws.send(Message::Binary(payload)).await.unwrap();
                    }
                    done.send(()).await.unwrap();
                    let _ = ws.next().await;
                });
            }
        }
        _ => panic!("mode: bare, ws_io, tungstenite or tungstenite-4k"),
    }
    // Both ends have exchanged their message (each keeps its sender while it waits).
    let mut done_rx = done_rx;
    for _ in 0..2 {
        done_rx.recv().await.unwrap();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().cloned().unwrap_or_else(|| "ws_io".into());
    let n: usize = args.get(1).map_or(2000, |n| n.parse().unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        for _ in 0..WARMUP {
            open(&mode, &listener).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = rss_kib();
        // In batches, each given time to go idle: `ws_io` drops its buffers after
        // `IDLE_RELEASE`, and memory freed by the allocator stays resident (reused, not
        // returned), so opening all at once would measure the buffers of every connection
        // busy at the same time.
        for batch in 0..n.div_ceil(BATCH) {
            for _ in 0..BATCH.min(n - batch * BATCH) {
                open(&mode, &listener).await;
            }
            tokio::time::sleep(IDLE_RELEASE + Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after = rss_kib();
        println!(
            "{mode}: {n} idle connections (both ends), RSS {before} -> {after} KiB, {:.0} bytes per connection",
            (after - before) as f64 * 1024.0 / n as f64
        );
        if mode == "ws_io" {
            println!("ws_io ends holding a buffer when idle: {}", HELD.load(Ordering::Relaxed));
        }
    });
}
