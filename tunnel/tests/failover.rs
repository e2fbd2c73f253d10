//! A worker given several server URLs (servers sharing one database): it skips a dead one, and
//! when the server holding its tunnel goes away it comes up on another, and serves there; asked
//! to move, it comes up on another before it leaves the first.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tunnel::{TunnelClientConfig, TunnelServer};

/// A URL nothing listens on: the port is bound but not listening, so connections are refused
/// and no other test can take it meanwhile. Keep the socket as long as the URL is used.
fn dead_url() -> (tokio::net::TcpSocket, String) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    (socket, format!("http://{addr}"))
}

/// `Worker::client_config` with several URLs.
fn config(urls: &[String]) -> TunnelClientConfig {
    let mut c = Worker::client_config(&urls[0], "tok-1");
    c.server_urls = urls.to_vec();
    c
}

fn tunnel_url(addr: SocketAddr) -> String {
    format!("ws://{addr}/connect")
}

/// Waits for a tunnel up on `url` (at least the `n`th established).
async fn up_on(worker: &mut Worker, n: u64, url: &str) {
    tokio::time::timeout(
        T,
        worker
            .status
            .wait_for(|s| s.connected && s.connects >= n && s.url.as_deref() == Some(url)),
    )
    .await
    .unwrap_or_else(|_| panic!("no tunnel up on {url} in time"))
    .unwrap();
}

/// An echo through the worker's tunnel on `server`.
async fn echo(server: &TunnelServer) {
    let mut stream = server.open_stream(WORKER).await.unwrap();
    stream.write_all(b"eping").await.unwrap();
    stream.shutdown().await.unwrap();
    let mut back = Vec::new();
    tokio::time::timeout(T, stream.read_to_end(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, b"ping");
}

#[tokio::test]
async fn a_dead_first_url_is_skipped() {
    let (_reserved, dead) = dead_url();
    let mut srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
    let mut worker = Worker::start(config(&[dead, srv.url()]), test_handler);
    up_on(&mut worker, 1, &tunnel_url(srv.addr)).await;
    assert_eq!(srv.next_event().await.0, WORKER);
    assert_eq!(worker.status.borrow().connects, 1);
    echo(&srv.server).await;
    worker.stop().await;
    srv.stop().await;
}

#[tokio::test]
async fn a_worker_whose_server_goes_away_comes_up_on_another() {
    let tokens = tokens_with(&[("tok-1", WORKER)]);
    let mut a = ServerHarness::start(tokens.clone(), Default::default()).await;
    let mut b = ServerHarness::start(tokens, Default::default()).await;
    let mut worker = Worker::start(config(&[a.url(), b.url()]), test_handler);
    up_on(&mut worker, 1, &tunnel_url(a.addr)).await;
    assert!(matches!(a.next_event().await, (WORKER, Some(_))));
    echo(&a.server).await;

    // Server A goes away, closing its tunnels.
    let gone = tokio::time::Instant::now();
    a.stop().await;
    up_on(&mut worker, 2, &tunnel_url(b.addr)).await;
    let back_in = gone.elapsed();
    assert!(matches!(b.next_event().await, (WORKER, Some(_))));
    echo(&b.server).await;
    // The first retry goes to B (its wait, at most the backoff's 50 ms floor, is bounded here
    // only as a hang guard).
    assert!(back_in < T, "back up after {back_in:?}");
    worker.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn a_worker_asked_to_move_comes_up_on_another_server_before_it_leaves_the_first() {
    let tokens = tokens_with(&[("tok-1", WORKER)]);
    let mut a = ServerHarness::start(tokens.clone(), Default::default()).await;
    let mut b = ServerHarness::start(tokens, Default::default()).await;
    let mut worker = Worker::start(config(&[a.url(), b.url()]), test_handler);
    up_on(&mut worker, 1, &tunnel_url(a.addr)).await;
    assert!(matches!(a.next_event().await, (WORKER, Some(_))));

    // A stream open on A while the worker moves: it runs to its end there.
    let mut open = a.server.open_stream(WORKER).await.unwrap();
    open.write_all(b"e").await.unwrap();
    a.server.ask_to_move();
    up_on(&mut worker, 2, &tunnel_url(b.addr)).await;
    assert!(matches!(b.next_event().await, (WORKER, Some(_))));
    echo(&b.server).await;
    // Still up on A, serving the open stream.
    assert!(a.server.is_connected(WORKER));
    open.write_all(b"still here").await.unwrap();
    let mut back = [0u8; 10];
    open.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"still here");
    // After the settle, a go-away: A opens no new stream on it.
    tokio::time::timeout(T, async {
        while a.server.takes_streams(WORKER) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("no go-away on the old tunnel");
    assert!(a.server.open_stream(WORKER).await.is_err());
    // The last stream ends: the worker closes the old tunnel, and A has none left.
    open.shutdown().await.unwrap();
    let mut rest = Vec::new();
    open.read_to_end(&mut rest).await.unwrap();
    tokio::time::timeout(T, a.server.moved())
        .await
        .expect("the old tunnel never closed");
    assert!(matches!(a.next_event().await, (WORKER, None)));
    assert!(b.server.is_connected(WORKER));
    worker.stop().await;
    a.stop().await;
    b.stop().await;
}
