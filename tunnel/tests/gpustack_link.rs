//! The server end of a GPUStack tunnel against a worker that speaks GPUStack's messages (written
//! here from `gpustack.websocket_proxy`'s behaviour; `tests/gpustack/test_gpustack_workers.py`
//! runs GPUStack's own client): sessions as streams, a slow reader's session ending alone,
//! bad messages closing the tunnel, and the tunnel's end failing every session at once.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::net::IpAddr;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt as _, StreamExt as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message as Ws;
use tokio_tungstenite::tungstenite::protocol::Role;
use tunnel::gpustack_link::{GpuStackLink, GpuStackLinkConfig, parse_cidrs};
use tunnel::gpustack_message::{Message, SessionId};

const T: Duration = Duration::from_secs(10);
const IP: &str = "127.0.0.2";

/// What the fake worker saw, in order.
#[derive(Debug)]
enum Seen {
    Connect(SessionId, String),
    Data(SessionId, Bytes),
    Disconnect(SessionId, Option<String>),
}

/// A GPUStack-speaking worker end: answers every connect request with success, reports what it
/// receives, and sends what the test gives it.
struct FakeWorker {
    seen: mpsc::UnboundedReceiver<Seen>,
    send: mpsc::UnboundedSender<Ws>,
}

async fn pair(
    config: GpuStackLinkConfig,
) -> (GpuStackLink, FakeWorker, tokio::task::JoinHandle<()>) {
    let (server_io, worker_io): (DuplexStream, DuplexStream) = tokio::io::duplex(1 << 16);
    let server_ws = WebSocketStream::from_raw_socket(server_io, Role::Server, None).await;
    let mut worker_ws = WebSocketStream::from_raw_socket(worker_io, Role::Client, None).await;
    let (link, drive) =
        GpuStackLink::start(server_ws, parse_cidrs(&format!("{IP}/32")).unwrap(), config);
    let driver = tokio::spawn(async move {
        let _ = drive.await;
    });
    let (seen_tx, seen) = mpsc::unbounded_channel();
    let (send, mut to_send) = mpsc::unbounded_channel::<Ws>();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                out = to_send.recv() => match out {
                    Some(out) => { if worker_ws.send(out).await.is_err() { return; } }
                    None => { let _ = worker_ws.close(None).await; return; }
                },
                got = worker_ws.next() => {
                    let Some(Ok(Ws::Binary(bytes))) = got else {
                        if matches!(got, Some(Ok(Ws::Ping(_) | Ws::Pong(_)))) { continue; }
                        return;
                    };
                    match Message::decode(&bytes).unwrap() {
                        Message::ConnectRequest { session, target } => {
                            let ok = Message::ConnectResponse { session, success: true, error: None };
                            worker_ws.send(Ws::Binary(ok.encode().unwrap())).await.unwrap();
                            let _ = seen_tx.send(Seen::Connect(session, target));
                        }
                        Message::Data { session, data } => { let _ = seen_tx.send(Seen::Data(session, data)); }
                        Message::Disconnect { session, error } => { let _ = seen_tx.send(Seen::Disconnect(session, error)); }
                        other => panic!("unexpected {other:?}"),
                    }
                }
            }
        }
    });
    (link, FakeWorker { seen, send }, driver)
}

impl FakeWorker {
    async fn next(&mut self) -> Seen {
        tokio::time::timeout(T, self.seen.recv())
            .await
            .expect("nothing from the server")
            .expect("the worker end stopped")
    }

    fn data(&self, session: SessionId, data: &[u8]) {
        let msg = Message::Data {
            session,
            data: Bytes::copy_from_slice(data),
        };
        self.send.send(Ws::Binary(msg.encode().unwrap())).unwrap();
    }
}

fn ip() -> IpAddr {
    IP.parse().unwrap()
}

async fn connected(
    link: &GpuStackLink,
    worker: &mut FakeWorker,
    port: u16,
) -> (tunnel::gpustack_link::GpuStackStream, SessionId) {
    let stream = tokio::time::timeout(T, link.open(ip(), port))
        .await
        .unwrap()
        .unwrap();
    let Seen::Connect(session, target) = worker.next().await else {
        panic!("no connect request")
    };
    assert_eq!(target, format!("tcp://{IP}:{port}"));
    (stream, session)
}

#[tokio::test]
async fn sessions_carry_bytes_both_ways_and_end_with_a_disconnect() {
    let (link, mut worker, _driver) = pair(GpuStackLinkConfig::default()).await;
    let (mut stream, session) = connected(&link, &mut worker, 40000).await;
    stream.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let Seen::Data(s, data) = worker.next().await else {
        panic!()
    };
    assert_eq!((s, &data[..]), (session, &b"GET / HTTP/1.1\r\n\r\n"[..]));
    worker.data(session, b"HTTP/1.1 200 OK\r\n");
    let mut got = [0u8; 17];
    stream.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"HTTP/1.1 200 OK\r\n");
    assert_eq!(link.sessions(), 1);
    drop(stream);
    let Seen::Disconnect(s, None) = worker.next().await else {
        panic!()
    };
    assert_eq!(s, session);
    assert_eq!(link.sessions(), 0);
}

/// GPUStack's protocol has no half-close: a relay whose client went away shuts the session's
/// write half, and that must end the session (else it stays until the engine closes, and a
/// tunnel of clients that each make one request fills its session table).
#[tokio::test]
async fn shutting_down_the_write_half_ends_the_session() {
    let config = GpuStackLinkConfig {
        max_sessions: 2,
        ..GpuStackLinkConfig::default()
    };
    let (link, mut worker, _driver) = pair(config).await;
    for _ in 0..5 {
        let (mut stream, session) = connected(&link, &mut worker, 40000).await;
        worker.data(session, b"answer");
        let Seen::Disconnect(s, None) = ({
            stream.shutdown().await.unwrap();
            worker.next().await
        }) else {
            panic!("no disconnect")
        };
        assert_eq!(s, session);
        assert_eq!(link.sessions(), 0);
        // What the worker sent before is still read, then the stream ends; writes fail.
        let mut got = Vec::new();
        stream.read_to_end(&mut got).await.unwrap();
        assert!(got.is_empty() || got == b"answer", "{got:?}");
        assert!(stream.write_all(b"more").await.is_err());
        drop(stream);
    }
    // No second disconnect for any of them (the drop after the shutdown sends nothing): the
    // next thing the worker sees, in the same queue, is the next session's connect request.
    let (_next, _) = connected(&link, &mut worker, 40001).await;
}

#[tokio::test]
async fn targets_outside_the_workers_ranges_are_not_asked_for() {
    let (link, _worker, _driver) = pair(GpuStackLinkConfig::default()).await;
    let err = link
        .open("10.0.0.1".parse().unwrap(), 80)
        .await
        .unwrap_err();
    assert!(matches!(err, tunnel::TunnelError::OutOfRange(_)), "{err}");
}

/// A session whose reader does not read ends once its buffer would overflow; the other session
/// keeps flowing, and the tunnel's unread bytes never pass the bound.
#[tokio::test]
async fn a_slow_reader_ends_its_own_session_only() {
    let config = GpuStackLinkConfig {
        session_buffer: 64 * 1024,
        ..GpuStackLinkConfig::default()
    };
    let (link, mut worker, _driver) = pair(config).await;
    let (mut slow, slow_id) = connected(&link, &mut worker, 1).await;
    let (mut fast, fast_id) = connected(&link, &mut worker, 2).await;
    let chunk = vec![b'x'; 8192];
    // 128 KiB for the slow one, which reads nothing meanwhile; the fast one reads as it comes.
    for i in 0..16 {
        worker.data(slow_id, &chunk);
        worker.data(fast_id, &[i]);
        let mut one = [0u8; 1];
        tokio::time::timeout(T, fast.read_exact(&mut one))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(one[0], i);
    }
    let Seen::Disconnect(s, Some(why)) = worker.next().await else {
        panic!("no disconnect")
    };
    assert_eq!(s, slow_id);
    assert!(why.contains("too slow"), "{why}");
    // What fitted is still read, then the error.
    let mut kept = Vec::new();
    let err = slow.read_to_end(&mut kept).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::OutOfMemory);
    assert!(kept.len() <= 64 * 1024, "{}", kept.len());
    // The fast session is untouched.
    worker.data(fast_id, b"still here");
    let mut more = [0u8; 10];
    fast.read_exact(&mut more).await.unwrap();
    assert_eq!(&more, b"still here");
    assert_eq!(link.sessions(), 1);
}

#[tokio::test]
async fn a_bad_message_closes_the_tunnel_and_fails_its_sessions_at_once() {
    let (link, mut worker, driver) = pair(GpuStackLinkConfig::default()).await;
    let (mut stream, _) = connected(&link, &mut worker, 1).await;
    worker
        .send
        .send(Ws::Binary(Bytes::from_static(b"\x01\x09junk")))
        .unwrap();
    let mut buf = [0u8; 1];
    let err = tokio::time::timeout(T, stream.read(&mut buf))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionAborted);
    tokio::time::timeout(T, link.closed()).await.unwrap();
    tokio::time::timeout(T, driver).await.unwrap().unwrap();
    assert!(matches!(
        link.open(ip(), 1).await,
        Err(tunnel::TunnelError::Closed)
    ));
}

#[tokio::test]
async fn the_worker_going_away_fails_open_sessions_at_once() {
    let (link, mut worker, _driver) = pair(GpuStackLinkConfig::default()).await;
    let (mut stream, session) = connected(&link, &mut worker, 1).await;
    worker.data(session, b"partial");
    let mut got = [0u8; 7];
    stream.read_exact(&mut got).await.unwrap();
    drop(worker.send); // the worker end closes its WebSocket
    let mut buf = [0u8; 1];
    let err = tokio::time::timeout(T, stream.read(&mut buf))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionAborted);
}

#[tokio::test]
async fn the_worker_ending_a_session_is_the_end_of_its_stream() {
    let (link, mut worker, _driver) = pair(GpuStackLinkConfig::default()).await;
    let (mut stream, session) = connected(&link, &mut worker, 1).await;
    worker.data(session, b"done");
    let bye = Message::Disconnect {
        session,
        error: None,
    };
    worker.send.send(Ws::Binary(bye.encode().unwrap())).unwrap();
    let mut all = Vec::new();
    stream.read_to_end(&mut all).await.unwrap();
    assert_eq!(all, b"done");
    assert_eq!(link.sessions(), 0);
}
