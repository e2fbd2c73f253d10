//! `faden worker` end to end with the real binaries: registration, the worker path through the
//! worker reverse proxy, token reuse after a restart, and configuration errors.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::time::Duration;

use mock_engine::{MockEngine, MockEngineConfig};
use serde_json::json;
use testkit::Client;
use testkit::process::{start, start_faden_server};

const SHARED: &str = "test-worker-credential-0123456789";

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_faden"))
}

fn field<'a>(log: &'a [String], marker: &str, key: &str) -> &'a str {
    let line = log
        .iter()
        .rev()
        .find(|l| l.contains(marker))
        .expect("marker line");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .expect("field")
}

#[tokio::test]
async fn worker_registers_serves_through_its_proxy_and_reuses_its_token() {
    let dir = tempfile::tempdir().unwrap();
    let server_dir = dir.path().join("server");
    let mut server = start_faden_server(
        bin(),
        &server_dir,
        [0; 3],
        &[],
        &[("FADEN_WORKER_CREDENTIAL", SHARED)],
    )
    .await;
    let admin = &server.admin;
    let cluster = admin
        .post("/v2/clusters", &json!({"name": "c"}))
        .await
        .expect(200)
        .json();
    admin
        .post("/v2/models", &json!({"name": "demo"}))
        .await
        .expect(200);
    let reg_token = cluster["registration_token"].as_str().unwrap().to_owned();
    let engine = MockEngine::start(MockEngineConfig {
        model: "demo".into(),
        tokens: 3,
        ..Default::default()
    })
    .await
    .unwrap();

    let worker_dir = dir.path().join("worker");
    let instance = format!("demo={}", engine.port());
    // The same ports across the restart below (a changed port means a new registration).
    let (wport, mport) = (
        testkit::free_port().to_string(),
        testkit::free_port().to_string(),
    );
    let worker_args = [
        "worker",
        "--server-url",
        &server.api_url(),
        "--token",
        &reg_token,
        "--worker-ip",
        "127.0.0.1",
        "--worker-port",
        &wport,
        "--worker-metrics-port",
        &mport,
        "--instance",
        &instance,
        "--data-dir",
        worker_dir.to_str().unwrap(),
        "--probe-interval",
        "200ms",
        "--worker-credential",
        SHARED,
    ];
    let (mut worker, worker_id) =
        start(bin(), &worker_args, &[], "faden worker ready", "worker_id").await;
    let token_before = std::fs::read_to_string(worker_dir.join("worker.token")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(worker_dir.join("worker.token"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    let w = admin
        .get(&format!("/v2/workers/{worker_id}"))
        .await
        .expect(200)
        .json();
    assert_eq!(
        w["proxy_mode"], "worker",
        "a standalone worker defaults to the worker path"
    );

    // A request through the gateway reaches the engine through the worker reverse proxy.
    let inference = admin
        .post("/v2/api-keys", &json!({"name": "u"}))
        .await
        .expect(200)
        .json();
    let client = Client::new(format!("http://{}", server.gateway))
        .with_token(inference["value"].as_str().unwrap());
    let body = json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}]});
    let mut answer = None;
    for _ in 0..100 {
        let r = client.post("/v1/chat/completions", &body).await;
        if r.status == 200 {
            answer = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let answer = answer.expect("the model never became routable through the worker");
    assert_eq!(
        answer.json()["choices"][0]["message"]["content"],
        "tok0 tok1 tok2 "
    );
    let seen = engine.stats.last_request().unwrap();
    assert!(
        seen.headers.get("authorization").is_none(),
        "credentials must not reach the engine"
    );

    // The metrics endpoint answers.
    assert_eq!(
        field(&worker.log, "faden worker ready", "metrics"),
        format!("0.0.0.0:{mport}")
    );
    let metrics = Client::new(format!("http://127.0.0.1:{mport}"))
        .get("/metrics")
        .await
        .expect(200);
    assert!(metrics.text().contains("faden_worker_info"));

    // Restart: the stored token is reused, same worker row.
    worker.child.start_kill().unwrap();
    worker.child.wait().await.unwrap();
    let (mut again, id_again) =
        start(bin(), &worker_args, &[], "faden worker ready", "worker_id").await;
    assert_eq!(id_again, worker_id);
    assert!(
        again
            .log
            .iter()
            .any(|l| l.contains("reusing the stored worker token")),
        "{:?}",
        again.log
    );
    assert_eq!(
        std::fs::read_to_string(worker_dir.join("worker.token")).unwrap(),
        token_before
    );
    let workers = admin.get("/v2/workers").await.expect(200).json();
    assert_eq!(workers["pagination"]["total"], 1);

    again.child.start_kill().unwrap();
    server.running.child.start_kill().unwrap();
    let _ = again.child.wait().await;
    let _ = server.running.child.wait().await;
    engine.stop().await;
}

#[tokio::test]
async fn bad_worker_configuration_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("worker.yaml");
    std::fs::write(
        &file,
        "worker_port: 10150\nservice_port_range: \"40000-40\"\nproxy_mod: tunnel\n",
    )
    .unwrap();
    let out = tokio::process::Command::new(bin())
        .args([
            "worker",
            "--server-url",
            "http://127.0.0.1:9",
            "--token",
            "x",
            "--config-file",
            file.to_str().unwrap(),
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("service_port_range"), "{stderr}");
    assert!(stderr.contains("proxy_mod"), "{stderr}");
    assert!(
        stderr.contains("worker.yaml:2:"),
        "line numbers expected: {stderr}"
    );
    // A bad flag value is refused by the CLI itself.
    let out = tokio::process::Command::new(bin())
        .args([
            "worker",
            "--server-url",
            "http://127.0.0.1:9",
            "--token",
            "x",
            "--instance",
            "demo=0",
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("port must be 1-65535"));
}
