//! `faden worker` over https/wss with the real binaries: the server serves its API port (and
//! `/connect`) over TLS (`--api-tls-cert/--api-tls-key`); a tunnel worker given the CA
//! (`--server-ca`) registers over HTTPS and brings its tunnel up over `wss://`, and the server's
//! own gateway (synced over HTTPS, pinned to the API's certificate) serves through it. A worker
//! that trusts another CA, or only the platform roots, is refused with a clear error.
//! Plain `http` workers are covered by `tests/tunnel.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::time::{Duration, Instant};

use control_client::client::ApiClient;
use http::Method;
use mock_engine::{MockEngine, MockEngineConfig};
use serde_json::{Value, json};
use testkit::Client;
use testkit::certs::{PemDir, TestCa};
use testkit::process::{start, start_faden_server};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_faden"))
}

/// Runs `faden worker` expected to fail; returns its exit status and stderr.
async fn failing_worker(args: &[&str]) -> (std::process::ExitStatus, String) {
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(bin())
            .args(args)
            .env("FADEN_LOG", "info")
            .env_remove("FADEN_SERVER_CA")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the worker should give up at once")
    .unwrap();
    (
        output.status,
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn tunnel_worker_registers_and_connects_over_https_and_wss() {
    let dir = tempfile::tempdir().unwrap();
    let pem = PemDir::new();
    let ca = TestCa::new("faden test ca");
    let (cert, key) = pem.write_cert("api", &ca.server_cert());
    let ca_path = pem.write_ca("ca", &ca);
    let other_ca = pem.write_ca("other", &TestCa::new("someone else"));

    let server_dir = dir.path().join("server");
    let server = start_faden_server(
        bin(),
        &server_dir,
        [0; 3],
        &[
            "--api-tls-cert",
            cert.to_str().unwrap(),
            "--api-tls-key",
            key.to_str().unwrap(),
        ],
        &[],
    )
    .await;
    let api_addr = server.api;
    let api_url = format!("https://{api_addr}");
    let gateway_addr = server.gateway;

    // The admin talks HTTPS to the API, trusting the test CA.
    let admin_key = server.admin_key.as_str();
    let tls = control_client::tls::client_config(Some(&ca_path)).unwrap();
    let admin = ApiClient::with_tls(&api_url, Some(tls)).unwrap();
    let cluster: Value = admin
        .json(
            Method::POST,
            "/v2/clusters",
            admin_key,
            Some(&json!({"name": "c"})),
        )
        .await
        .unwrap();
    let _: Value = admin
        .json(
            Method::POST,
            "/v2/models",
            admin_key,
            Some(&json!({"name": "demo"})),
        )
        .await
        .unwrap();
    let registration = cluster["registration_token"].as_str().unwrap().to_owned();
    // Plain HTTP on the TLS port gets no answer.
    let plain = ApiClient::new(&format!("http://{api_addr}")).unwrap();
    assert!(
        plain
            .call(Method::GET, "/v2/clusters", admin_key, None)
            .await
            .is_err()
    );

    let engine = MockEngine::start(MockEngineConfig {
        model: "demo".into(),
        tokens: 3,
        ..Default::default()
    })
    .await
    .unwrap();
    let instance = format!("demo={}", engine.port());
    let worker_args = |data: &'static str, ca: Option<&Path>| -> Vec<String> {
        let mut args = vec![
            "worker".to_owned(),
            "--server-url".to_owned(),
            api_url.clone(),
            "--token".to_owned(),
            registration.clone(),
            "--proxy-mode".to_owned(),
            "tunnel".to_owned(),
            "--worker-ip".to_owned(),
            "10.255.0.9".to_owned(),
            "--disable-worker-metrics".to_owned(),
            "--instance".to_owned(),
            instance.clone(),
            "--data-dir".to_owned(),
            dir.path().join(data).to_str().unwrap().to_owned(),
            "--probe-interval".to_owned(),
            "200ms".to_owned(),
        ];
        if let Some(ca) = ca {
            args.extend(["--server-ca".to_owned(), ca.to_str().unwrap().to_owned()]);
        }
        args
    };

    // A certificate from another CA is refused, naming the reason.
    let args = worker_args("wrong-ca", Some(&other_ca));
    let (status, stderr) =
        failing_worker(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert!(!status.success());
    assert!(
        stderr.contains("certificate") && stderr.contains("UnknownIssuer"),
        "{stderr}"
    );
    // So is one that the platform roots do not know (no --server-ca).
    let args = worker_args("no-ca", None);
    let (status, stderr) =
        failing_worker(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert!(!status.success());
    assert!(stderr.contains("certificate"), "{stderr}");

    // With the CA: registered over HTTPS, tunnel up over wss.
    let args = worker_args("good", Some(&ca_path));
    let (_worker, worker_id) = start(
        bin(),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
        "faden worker ready",
        "worker_id",
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let worker: Value = admin
            .json(
                Method::GET,
                &format!("/v2/workers/{worker_id}"),
                admin_key,
                None,
            )
            .await
            .unwrap();
        if worker["proxy_address"].is_string() {
            break;
        }
        assert!(Instant::now() < deadline, "the tunnel never came up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The server's gateway (its routing synced over HTTPS) serves through the wss tunnel.
    let user: Value = admin
        .json(
            Method::POST,
            "/v2/api-keys",
            admin_key,
            Some(&json!({"name": "u"})),
        )
        .await
        .unwrap();
    let gateway =
        Client::new(format!("http://{gateway_addr}")).with_token(user["value"].as_str().unwrap());
    let body = json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}]});
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = gateway.post("/v1/chat/completions", &body).await;
        if r.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never served through the tunnel: {} {}",
            r.status,
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
