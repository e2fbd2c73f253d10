//! TLS on the listener (ALPN, client certificates), mutual TLS to upstreams, and refusal of
//! requests with both Content-Length and Transfer-Encoding. Certificates are made by rcgen at
//! test time; every socket is on 127.0.0.1.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use gateway::{
    ConfigError, Gateway, GatewayConfig, ServerTlsConfig, TlsConfigError, UpstreamTls,
    UpstreamTlsConfig,
};
use http::Request;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle};
use testkit::certs::{self, PemDir, TestCa, TlsFront};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

async fn engine() -> MockEngineHandle {
    MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap()
}

/// A listener TLS setting from a fresh server certificate of `ca`.
fn listener_tls(dir: &PemDir, ca: &TestCa, client_ca: Option<&TestCa>) -> ServerTlsConfig {
    let (cert_chain, private_key) = dir.write_cert("gateway", &ca.server_cert());
    ServerTlsConfig {
        cert_chain,
        private_key,
        client_ca: client_ca.map(|c| dir.write_ca("client-ca", c)),
    }
}

/// Sends `req` over HTTP/1.1 on `io`.
async fn send_h1<I>(io: I, req: Request<Full<Bytes>>) -> hyper::Result<http::Response<Incoming>>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(conn);
    sender.send_request(req).await
}

/// Sends `req` over HTTP/2 on `io`.
async fn send_h2<I>(io: I, req: Request<Full<Bytes>>) -> hyper::Result<http::Response<Incoming>>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io)).await?;
    tokio::spawn(conn);
    sender.send_request(req).await
}

fn metric(h: &Harness, line_start: &str) -> u64 {
    let text = h.gateway.metrics_text();
    text.lines()
        .find_map(|l| l.strip_prefix(line_start))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {line_start} in:\n{text}"))
}

#[tokio::test]
async fn tls_listener_speaks_http1_and_h2_by_alpn() {
    let e = engine().await;
    let ca = TestCa::new("faden test CA");
    let dir = PemDir::new();
    let config = GatewayConfig {
        tls: Some(listener_tls(&dir, &ca, None)),
        ..GatewayConfig::default()
    };
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;

    let tls = certs::connect(h.addr, certs::client_config(&ca, None, &[b"http/1.1"]))
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let resp = tokio::time::timeout(T, send_h1(tls, h.chat(false)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_11);
    let _ = body_bytes(resp).await;

    let tls = certs::connect(
        h.addr,
        certs::client_config(&ca, None, &[b"h2", b"http/1.1"]),
    )
    .await
    .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let resp = tokio::time::timeout(T, send_h2(tls, h.chat(true)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let body = body_bytes(resp).await;
    assert!(body.ends_with(b"data: [DONE]\n\n"), "{body:?}");
    assert_eq!(e.stats.requests(), 2);

    // A client that does not trust the gateway's CA refuses it.
    let other = TestCa::new("other CA");
    assert!(
        certs::connect(h.addr, certs::client_config(&other, None, &[b"http/1.1"]))
            .await
            .is_err()
    );

    // Plain HTTP to the TLS port gets no HTTP answer, and the failure is counted.
    let out = raw(h.addr, b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await;
    assert!(!out.contains("HTTP/1.1 200"), "{out}");
    assert!(
        metric(
            &h,
            "faden_gateway_tls_handshake_failures_total{reason=\"protocol\"}"
        ) >= 1
    );
    h.stop().await;
}

#[tokio::test]
async fn tls_handshake_is_bounded_by_the_header_read_timeout() {
    let ca = TestCa::new("faden test CA");
    let dir = PemDir::new();
    let mut config = GatewayConfig {
        tls: Some(listener_tls(&dir, &ca, None)),
        ..GatewayConfig::default()
    };
    config.listener.header_read_timeout = Duration::from_millis(300);
    let h = Harness::start(config, &[]).await;
    let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    // The first byte of a ClientHello, then silence.
    s.write_all(&[0x16]).await.unwrap();
    // Closed within `T` by the 300 ms deadline (the default is 30 s).
    let mut out = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        metric(
            &h,
            "faden_gateway_tls_handshake_failures_total{reason=\"timeout\"}"
        ),
        1
    );
    h.stop().await;
}

#[tokio::test]
async fn client_certificates_are_verified() {
    let e = engine().await;
    let server_ca = TestCa::new("server CA");
    let client_ca = TestCa::new("client CA");
    let other_ca = TestCa::new("unrelated CA");
    let dir = PemDir::new();
    let config = GatewayConfig {
        tls: Some(listener_tls(&dir, &server_ca, Some(&client_ca))),
        ..GatewayConfig::default()
    };
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;

    // A certificate from the client CA: accepted.
    let good = client_ca.client_cert("tenant-a");
    let tls = certs::connect(
        h.addr,
        certs::client_config(&server_ca, Some(&good), &[b"http/1.1"]),
    )
    .await
    .unwrap();
    let resp = tokio::time::timeout(T, send_h1(tls, h.chat(false)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 200);
    let _ = body_bytes(resp).await;

    // No certificate, or one from another CA: no response. With TLS 1.3 the client finishes
    // its handshake before the server checks the certificate, so the failure may show on the
    // handshake or on the first request.
    let stranger = other_ca.client_cert("stranger");
    for client in [None, Some(&stranger)] {
        let config = certs::client_config(&server_ca, client, &[b"http/1.1"]);
        let refused = match certs::connect(h.addr, config).await {
            Err(_) => true,
            Ok(tls) => tokio::time::timeout(T, send_h1(tls, h.chat(false)))
                .await
                .unwrap()
                .is_err(),
        };
        assert!(refused, "client cert {:?} was accepted", client.is_some());
    }
    assert_eq!(e.stats.requests(), 1);
    // Counted once the server side has seen both failures.
    testkit::wait_until(T, "both handshake failures counted", || {
        metric(
            &h,
            "faden_gateway_tls_handshake_failures_total{reason=\"certificate\"}",
        ) >= 2
    })
    .await;
    h.stop().await;
}

/// An upstream behind TLS: a front presenting a certificate of `server_ca`, requiring client
/// certificates of `client_ca` when given, forwarding to a plain mock engine.
async fn tls_upstream(
    server_ca: &TestCa,
    client_ca: Option<&TestCa>,
) -> (MockEngineHandle, TlsFront) {
    let e = engine().await;
    let config = certs::server_config(&server_ca.server_cert(), client_ca, &[b"http/1.1"]);
    let front = TlsFront::start(config, e.addr).await;
    (e, front)
}

fn upstream_tls(dir: &PemDir, ca: &TestCa, client: Option<(&str, &TestCa)>) -> UpstreamTls {
    let (client_cert, client_key) = match client {
        Some((name, issuer)) => {
            let (c, k) = dir.write_cert(name, &issuer.client_cert(name));
            (Some(c), Some(k))
        }
        None => (None, None),
    };
    UpstreamTls {
        ca_bundle: dir.write_ca(&format!("upstream-ca-{}", rand_suffix()), ca),
        client_cert,
        client_key,
        server_name: None,
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn with_default(tls: UpstreamTls) -> GatewayConfig {
    GatewayConfig {
        upstream_tls: UpstreamTlsConfig {
            default: Some(tls),
            ..UpstreamTlsConfig::default()
        },
        ..GatewayConfig::default()
    }
}

#[tokio::test]
async fn upstream_mutual_tls_is_accepted() {
    let upstream_ca = TestCa::new("upstream CA");
    let client_ca = TestCa::new("gateway client CA");
    let (e, front) = tls_upstream(&upstream_ca, Some(&client_ca)).await;
    let dir = PemDir::new();
    let config = with_default(upstream_tls(&dir, &upstream_ca, Some(("gw", &client_ca))));
    let h = Harness::start(config, &[Inst::direct(1, front.port())]).await;
    for stream in [false, true, false] {
        let resp = send(h.addr, h.chat(stream)).await;
        assert_eq!(resp.status(), 200);
        let _ = body_bytes(resp).await;
    }
    assert_eq!(e.stats.requests(), 3);
    // Pooled: the three requests shared one TLS connection.
    assert_eq!(front.handshakes.load(Ordering::SeqCst), 1);
    h.stop().await;
}

#[tokio::test]
async fn a_body_larger_than_the_socket_buffers_reaches_a_tls_upstream() {
    // 16 MiB: more than loopback's socket buffers hold, so the pooled TLS connection writes
    // against a full socket (rustls then keeps records for the flush; that the pool flushes
    // is checked deterministically by `pool::tests::a_request_is_flushed_...`).
    let upstream_ca = TestCa::new("upstream CA");
    let (e, front) = tls_upstream(&upstream_ca, None).await;
    let dir = PemDir::new();
    let config = with_default(upstream_tls(&dir, &upstream_ca, None));
    let h = Harness::start(config, &[Inst::direct(1, front.port())]).await;
    let input = "x".repeat(16 << 20);
    let req = h.post(
        "/v1/embeddings",
        format!(r#"{{"model":"{MODEL}","input":"{input}"}}"#),
    );
    let resp = tokio::time::timeout(T, send(h.addr, req)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = json(resp).await;
    assert_eq!(body["object"], "list", "{body}");
    assert_eq!(e.stats.requests(), 1);
    h.stop().await;
}

#[tokio::test]
async fn upstream_certificate_from_another_ca_is_refused() {
    let upstream_ca = TestCa::new("upstream CA");
    let other_ca = TestCa::new("unrelated CA");
    let client_ca = TestCa::new("gateway client CA");
    // The upstream presents a certificate of `other_ca`; the gateway trusts only `upstream_ca`.
    let (e, front) = tls_upstream(&other_ca, Some(&client_ca)).await;
    let dir = PemDir::new();
    let config = with_default(upstream_tls(&dir, &upstream_ca, Some(("gw", &client_ca))));
    let h = Harness::start(config, &[Inst::direct(1, front.port())]).await;
    let resp = send(h.addr, h.chat(false)).await;
    assert_error(resp, 502, "upstream_tls").await;
    assert_eq!(e.stats.requests(), 0);
    assert!(
        metric(
            &h,
            "faden_gateway_upstream_errors_total{kind=\"upstream_tls\"}"
        ) >= 1
    );
    h.stop().await;
}

#[tokio::test]
async fn upstream_requiring_a_client_certificate_refuses_none() {
    let upstream_ca = TestCa::new("upstream CA");
    let client_ca = TestCa::new("gateway client CA");
    let (e, front) = tls_upstream(&upstream_ca, Some(&client_ca)).await;
    let dir = PemDir::new();
    let config = with_default(upstream_tls(&dir, &upstream_ca, None));
    let h = Harness::start(config, &[Inst::direct(1, front.port())]).await;
    let resp = send(h.addr, h.chat(false)).await;
    assert_error(resp, 502, "upstream_tls").await;
    assert_eq!(e.stats.requests(), 0);
    h.stop().await;
}

#[tokio::test]
async fn worker_setting_wins_and_pools_do_not_mix_identities() {
    let upstream_ca = TestCa::new("upstream CA");
    let client_ca = TestCa::new("gateway client CA");
    let (e, front) = tls_upstream(&upstream_ca, Some(&client_ca)).await;
    let dir = PemDir::new();
    let with_cert = upstream_tls(&dir, &upstream_ca, Some(("gw", &client_ca)));
    let without_cert = upstream_tls(&dir, &upstream_ca, None);
    let mut config = GatewayConfig {
        retry: false,
        ..GatewayConfig::default()
    };
    // Cluster 1 (every test worker) presents a certificate; worker 2 does not.
    config.upstream_tls.by_cluster.insert(1, with_cert);
    config.upstream_tls.by_worker.insert(2, without_cert);
    let h = Harness::start(config, &[Inst::direct(1, front.port())]).await;
    let resp = send(h.addr, h.chat(false)).await;
    assert_eq!(resp.status(), 200);
    let _ = body_bytes(resp).await;

    // Same address and port, other worker: a pooled connection made with the client
    // certificate must not be reused for it.
    h.publish(
        &[Inst::direct(2, front.port())],
        std::slice::from_ref(&h.cred),
    );
    let resp = send(h.addr, h.chat(false)).await;
    assert_error(resp, 502, "upstream_tls").await;
    assert_eq!(e.stats.requests(), 1);

    // A plain worker next to TLS ones takes the plain path.
    let plain = engine().await;
    let mut config = GatewayConfig::default();
    config
        .upstream_tls
        .by_worker
        .insert(9, upstream_tls(&dir, &upstream_ca, None));
    let h2 = Harness::start(config, &[Inst::direct(3, plain.port())]).await;
    let resp = send(h2.addr, h2.chat(false)).await;
    assert_eq!(resp.status(), 200);
    let _ = body_bytes(resp).await;
    assert_eq!(plain.stats.requests(), 1);
    h2.stop().await;
    h.stop().await;
}

#[test]
fn tls_file_errors_name_the_file() {
    let ca = TestCa::new("ca");
    let dir = PemDir::new();
    let snapshots = || Arc::new(arc_swap::ArcSwap::from_pointee(snapshot(&[], &[])));
    let build = |config: GatewayConfig| Gateway::new(config, snapshots()).unwrap_err();

    let missing = dir.path().join("missing.crt");
    let mut tls = listener_tls(&dir, &ca, None);
    tls.cert_chain = missing.clone();
    let err = build(GatewayConfig {
        tls: Some(tls),
        ..GatewayConfig::default()
    });
    assert!(
        matches!(err, ConfigError::Tls(TlsConfigError::File { .. })),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );

    let not_pem = dir.write("garbage.key", "not a key");
    let mut tls = listener_tls(&dir, &ca, None);
    tls.private_key = not_pem.clone();
    let err = build(GatewayConfig {
        tls: Some(tls),
        ..GatewayConfig::default()
    });
    assert!(
        err.to_string().contains(&not_pem.display().to_string()),
        "{err}"
    );

    // A key that is not the certificate's.
    let mut tls = listener_tls(&dir, &ca, None);
    let (_, other_key) = dir.write_cert("other", &ca.server_cert());
    tls.private_key = other_key;
    let err = build(GatewayConfig {
        tls: Some(tls),
        ..GatewayConfig::default()
    });
    assert!(
        matches!(err, ConfigError::Tls(TlsConfigError::KeyPair { .. })),
        "{err:?}"
    );

    let mut half = upstream_tls(&dir, &ca, Some(("c", &ca)));
    half.client_key = None;
    let mut config = GatewayConfig::default();
    config.upstream_tls.by_worker.insert(4, half);
    let err = build(config);
    assert!(err.to_string().contains("worker 4"), "{err}");

    let empty_bundle = dir.write("empty.pem", "");
    let mut bad = upstream_tls(&dir, &ca, None);
    bad.ca_bundle = empty_bundle.clone();
    let err = build(with_default(bad));
    assert!(
        err.to_string()
            .contains(&empty_bundle.display().to_string()),
        "{err}"
    );
}

/// A request with both framing headers whose chunked body smuggles a second request.
fn smuggling_request(h: &Harness) -> Vec<u8> {
    let body = format!(r#"{{"model":"{MODEL}","messages":[]}}"#);
    let inner = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        h.bearer(),
        body.len()
    );
    // Framed by Transfer-Encoding, the outer body is a valid chat request: without the
    // refusal, the gateway would answer it (200) and then close.
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ncontent-type: application/json\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n{inner}",
        h.bearer(),
        body.len()
    )
    .into_bytes()
}

fn count_status_lines(out: &str) -> usize {
    out.matches("HTTP/1.1 ").count()
}

#[tokio::test]
async fn content_length_with_transfer_encoding_gets_400_and_close() {
    let e = engine().await;
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;

    let out = raw(h.addr, &smuggling_request(&h)).await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    assert_eq!(count_status_lines(&out), 1, "{out}");
    assert_eq!(e.stats.requests(), 0);

    // Sent byte by byte: same answer.
    let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    for b in smuggling_request(&h) {
        if s.write_all(&[b]).await.is_err() {
            break;
        }
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(T, s.read_to_end(&mut out))
        .await
        .unwrap();
    let out = String::from_utf8_lossy(&out);
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    assert_eq!(count_status_lines(&out), 1, "{out}");

    // After a good request on the same connection: the good one is answered, then 400.
    let body = format!(r#"{{"model":"{MODEL}","messages":[]}}"#);
    let mut pipelined = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        h.bearer(),
        body.len()
    )
    .into_bytes();
    pipelined.extend_from_slice(&smuggling_request(&h));
    let out = raw(h.addr, &pipelined).await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert_eq!(count_status_lines(&out), 2, "{out}");
    assert!(out.contains("HTTP/1.1 400"), "{out}");
    assert_eq!(e.stats.requests(), 1);

    // A chunked request alone and a Content-Length request alone still work, keep-alive.
    let chunked = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\nGET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        h.bearer(),
        body.len()
    );
    let out = raw(h.addr, chunked.as_bytes()).await;
    assert_eq!(out.matches("HTTP/1.1 200").count(), 2, "{out}");
    assert_eq!(e.stats.requests(), 2);

    assert!(metric(&h, "faden_gateway_framing_conflicts_total") >= 3);
    h.stop().await;
}

#[tokio::test]
async fn content_length_with_transfer_encoding_over_tls_gets_400() {
    let e = engine().await;
    let ca = TestCa::new("faden test CA");
    let dir = PemDir::new();
    let config = GatewayConfig {
        tls: Some(listener_tls(&dir, &ca, None)),
        ..GatewayConfig::default()
    };
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;
    let mut tls = certs::connect(h.addr, certs::client_config(&ca, None, &[b"http/1.1"]))
        .await
        .unwrap();
    tls.write_all(&smuggling_request(&h)).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(T, tls.read_to_end(&mut out))
        .await
        .unwrap();
    let out = String::from_utf8_lossy(&out);
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    assert_eq!(count_status_lines(&out), 1, "{out}");
    assert_eq!(e.stats.requests(), 0);
    h.stop().await;
}
