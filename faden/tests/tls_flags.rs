//! The gateway's TLS flags on the real binary: `--tls-cert/--tls-key` serve TLS (and nothing
//! else) on the gateway port; a bad certificate file stops the start, naming the file.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use testkit::certs::{PemDir, TestCa, client_config, connect};
use testkit::process::start_faden_server;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_faden"))
}

#[tokio::test]
async fn gateway_serves_tls_with_the_given_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let pem = PemDir::new();
    let ca = TestCa::new("faden test ca");
    let (cert, key) = pem.write_cert("gateway", &ca.server_cert());
    let data = dir.path().join("data");
    let mut server = start_faden_server(
        bin(),
        &data,
        [0; 3],
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
        &[],
    )
    .await;
    let gateway = server.gateway;

    let mut tls = connect(gateway, client_config(&ca, None, &[b"http/1.1"]))
        .await
        .unwrap();
    tls.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    tls.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // A client that does not trust the CA refuses the gateway.
    let other = TestCa::new("someone else");
    assert!(
        connect(gateway, client_config(&other, None, &[]))
            .await
            .is_err()
    );
    // Plain HTTP on the TLS port gets no HTTP answer.
    let plain = testkit::Client::new(format!("http://{gateway}"));
    let refused = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        plain.try_post("/v1/chat/completions", &serde_json::json!({})),
    )
    .await
    .unwrap();
    assert!(refused.is_none());
    server.running.child.start_kill().unwrap();
    let _ = server.running.child.wait().await;
}

#[tokio::test]
async fn a_bad_certificate_file_stops_the_start_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let bogus = dir.path().join("not-a-cert.pem");
    std::fs::write(&bogus, "hello").unwrap();
    let out = tokio::process::Command::new(bin())
        .args([
            "server",
            "--data-dir",
            dir.path().join("d").to_str().unwrap(),
            "--host",
            "127.0.0.1",
            "--api-port",
            "0",
            "--port",
            "0",
            "--proxy-port",
            "0",
            "--tls-cert",
            bogus.to_str().unwrap(),
            "--tls-key",
            bogus.to_str().unwrap(),
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not-a-cert.pem"), "{stderr}");
    // --tls-key without --tls-cert is refused by the CLI.
    let out = tokio::process::Command::new(bin())
        .args(["server", "--tls-key", bogus.to_str().unwrap()])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
}
