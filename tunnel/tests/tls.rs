//! `wss://`: the worker trusts exactly the CA bundle it is given.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use std::sync::Arc;

use common::*;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tunnel::{TunnelServer, WorkerIdentity};

#[tokio::test]
async fn tunnel_over_tls_with_an_explicit_ca() {
    let ca = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let cert_der = CertificateDer::from(ca.cert.der().to_vec());
    let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ca.signing_key.serialize_der()));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server_tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert_der], key_der)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_tls));

    let server = TunnelServer::builder(Default::default(), |token: String| async move {
        (token == "tok-1").then_some(WorkerIdentity {
            worker_id: WORKER,
            cluster_id: 1,
        })
    })
    .build();
    let router = connect_router(&server);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let acceptor = acceptor.clone();
            let router = router.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection_with_upgrades(
                        TokioIo::new(tls),
                        TowerToHyperService::new(router),
                    )
                    .await;
            });
        }
    });

    // A wss URL without TLS settings is refused up front.
    let url = format!("https://127.0.0.1:{}", addr.port());
    assert!(tunnel::TunnelClient::new(Worker::client_config(&url, "tok-1")).is_err());

    // Trusting some other CA: the handshake fails, and the worker keeps retrying.
    let other = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let mut config = Worker::client_config(&url, "tok-1");
    config.tls = Some(tunnel::tls::client_config(other.cert.pem().as_bytes()).unwrap());
    let mut wrong = Worker::start(config, test_handler);
    tokio::time::timeout(
        T,
        wrong
            .status
            .wait_for(|s| s.last_error.as_deref().is_some_and(|e| e.contains("tls"))),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(!server.is_connected(WORKER));
    wrong.stop().await;

    // Trusting the server's CA: up, and streams flow.
    let mut config = Worker::client_config(&url, "tok-1");
    config.tls = Some(tunnel::tls::client_config(ca.cert.pem().as_bytes()).unwrap());
    let mut worker = Worker::start(config, test_handler);
    worker.connected(1).await;
    let mut s = server.open_stream(WORKER).await.unwrap();
    s.write_all(b"eover tls").await.unwrap();
    s.shutdown().await.unwrap();
    let mut back = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, b"over tls");

    assert!(tunnel::tls::client_config(b"not a pem").is_err());
    worker.stop().await;
    tokio::time::timeout(T, server.shutdown()).await.unwrap();
    accept.abort();
}
