#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;

use super::*;

const T: Duration = Duration::from_secs(10);

/// Serves `/up` on a `net` listener with upgrades (as the API's is, with TLS when given):
/// the connection it takes over goes through [`take_transport`], which must find the
/// socket; the relay reads the 5 bytes sent behind the request and answers `plain`,
/// `tls..` or `wrapd` by the variant.
async fn api_listener(tls: Option<tokio_rustls::TlsAcceptor>) -> (SocketAddr, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let up = |mut req: Request<hyper::body::Incoming>, _peer| async move {
        let on_upgrade = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            let (mut transport, read_ahead) = take_transport(on_upgrade.await.unwrap());
            let answer: &[u8] = match &transport {
                Either::Left(Either::Left(_)) => b"plain",
                Either::Left(Either::Right(_)) => b"tls..",
                Either::Right(_) => b"wrapd",
            };
            let mut early = read_ahead.to_vec();
            while early.len() < 5 {
                let mut more = [0u8; 5];
                let n = transport.read(&mut more).await.unwrap();
                assert!(n > 0);
                early.extend_from_slice(&more[..n]);
            }
            assert_eq!(&early, b"early");
            transport.write_all(answer).await.unwrap();
        });
        let mut resp = Response::new(Full::new(Bytes::new()));
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        resp.headers_mut()
            .insert(header::UPGRADE, HeaderValue::from_static("test"));
        resp
    };
    let shutdown = CancellationToken::new();
    let options = net::listener::ServeOptions {
        tls,
        upgrades: true,
        ..Default::default()
    };
    let config = net::config::ListenerConfig::default();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        net::listener::serve_with(listener, &config, options, up, stop, || {}).await;
    });
    (addr, shutdown)
}

/// Sends the upgrade request and 5 bytes behind it in one write; the 5-byte answer.
async fn upgrade_and_ask<S: AsyncRead + AsyncWrite + Unpin>(mut io: S) -> [u8; 5] {
    io.write_all(
        b"GET /up HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: test\r\n\r\nearly",
    )
    .await
    .unwrap();
    let head = testkit::raw::read_head(&mut io).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let mut answer = [0u8; 5];
    tokio::time::timeout(T, io.read_exact(&mut answer))
        .await
        .unwrap()
        .unwrap();
    answer
}

/// The tunnel's socket comes out of `Upgraded` on the API listener, plain and TLS, with
/// the bytes hyper read past the request.
#[tokio::test]
async fn tunnels_run_on_the_socket_itself() {
    let (addr, shutdown) = api_listener(None).await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    assert_eq!(&upgrade_and_ask(tcp).await, b"plain");
    shutdown.cancel();

    let ca = testkit::certs::TestCa::new("tunnel test CA");
    let server = testkit::certs::server_config(&ca.server_cert(), None, &[b"http/1.1"]);
    let (addr, shutdown) = api_listener(Some(server.into())).await;
    let client = testkit::certs::client_config(&ca, None, &[b"http/1.1"]);
    let tls = testkit::certs::connect(addr, client).await.unwrap();
    assert_eq!(&upgrade_and_ask(tls).await, b"tls..");
    shutdown.cancel();
}
