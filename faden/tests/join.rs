//! The join commands the management API renders start real workers: the `faden worker` part of
//! a Docker cluster's `docker run` command, and the container of a Kubernetes cluster's worker
//! DaemonSet (its arguments and environment), run against a real `faden server`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use testkit::Client;
use testkit::process::{FadenServer, Running, start, start_faden_server};

/// What the server tells workers to dial; no host has this name, so only a rendered command
/// with the test server's URL swapped in can register.
const ADVERTISED: &str = "http://faden.example:30080";
const IMAGE: &str = "registry.example.com/faden/faden:test";

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_faden"))
}

/// Replaces the value after `flag` in `args`, which must be `expected`.
fn swap(args: &mut [String], flag: &str, expected: &str, value: &str) {
    let at = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    assert_eq!(args[at + 1], expected, "{flag} in {args:?}");
    args[at + 1] = value.to_owned();
}

/// Points rendered worker arguments at the test server and a data directory under `dir`,
/// which it returns.
fn point_at(args: &mut [String], server: &FadenServer, dir: &Path) -> std::path::PathBuf {
    swap(args, "--server-url", ADVERTISED, &server.api_url());
    let data = dir.join("worker");
    swap(args, "--data-dir", "/var/lib/faden", data.to_str().unwrap());
    data
}

/// Polls the worker until the server records its tunnel (the worker is then fully joined).
async fn tunnel_up(admin: &Client, worker_id: &str) -> Value {
    for _ in 0..200 {
        let w = admin
            .get(&format!("/v2/workers/{worker_id}"))
            .await
            .expect(200)
            .json();
        if w["proxy_address"].is_string() {
            return w;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("worker {worker_id}'s tunnel never came up");
}

/// A server advertising [`ADVERTISED`] and [`IMAGE`], with the cluster `body` created.
async fn server_with(body: Value) -> (tempfile::TempDir, FadenServer, Value) {
    let dir = tempfile::tempdir().unwrap();
    let server = start_faden_server(
        bin(),
        &dir.path().join("server"),
        [0; 3],
        &["--server-url", ADVERTISED, "--worker-image", IMAGE],
        &[],
    )
    .await;
    let cluster = server
        .admin
        .post("/v2/clusters", &body)
        .await
        .expect(200)
        .json();
    (dir, server, cluster)
}

async fn stop(mut running: Running) {
    let _ = running.child.start_kill();
    let _ = running.child.wait().await;
}

#[tokio::test]
async fn the_docker_run_commands_worker_part_registers_with_a_real_server() {
    // Tunnel mode (chosen below) and no metrics: the worker opens no fixed port here.
    let (dir, mut server, cluster) =
        server_with(json!({"name": "docker", "worker_config": {"disable_worker_metrics": true}}))
            .await;
    let admin = server.admin.clone();
    let id = cluster["id"].as_i64().unwrap();
    let join = admin
        .get(&format!(
            "/v2/clusters/{id}/join?vendor=nvidia&proxy_mode=tunnel&worker_ip=127.0.0.1&mounts=/data/models"
        ))
        .await
        .expect(200)
        .json();
    assert_eq!(join["image"], IMAGE);
    assert_eq!(join["server_url"], ADVERTISED);

    // The command as a shell reads it (a backslash-newline joins lines), from the image on.
    let run = join["run"].as_str().unwrap().replace("\\\n", " ");
    let words = shlex::split(&run).unwrap();
    assert_eq!(words[..2], ["docker", "run"]);
    // The image's entrypoint is `faden`: what follows the image is its subcommand.
    let at = words.iter().position(|w| w == IMAGE).unwrap();
    assert_eq!(words[at + 1], "worker");
    let mut args: Vec<String> = words[at + 1..].to_vec();
    let data = point_at(&mut args, &server, dir.path());
    let token = &args[args.iter().position(|a| a == "--token").unwrap() + 1];
    assert_eq!(token, cluster["registration_token"].as_str().unwrap());

    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (worker, worker_id) = start(bin(), &refs, &[], "faden worker ready", "worker_id").await;
    let w = tunnel_up(&admin, &worker_id).await;
    assert_eq!(w["cluster_id"], id);
    assert_eq!(w["proxy_mode"], "tunnel");
    assert_eq!(w["ip"], "127.0.0.1");
    // The token landed in the data directory the command names.
    assert!(data.join("worker.token").is_file());

    stop(worker).await;
    server.kill().await;
}

#[tokio::test]
async fn the_daemonsets_container_registers_with_a_real_server() {
    let (dir, mut server, cluster) = server_with(json!({"name": "k8s", "provider": "kubernetes",
        "worker_config": {"proxy_mode": "tunnel", "disable_worker_metrics": true}}))
    .await;
    let admin = server.admin.clone();
    let id = cluster["id"].as_i64().unwrap();
    let text = admin
        .get(&format!("/v2/clusters/{id}/manifests?vendors=nvidia"))
        .await
        .expect(200)
        .text();
    let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let kind = |k: &str| {
        docs.iter()
            .find(|d| d["kind"] == k)
            .unwrap_or_else(|| panic!("no {k} in\n{text}"))
    };
    let secret = kind("Secret");
    let ds = kind("DaemonSet");
    assert_eq!(ds["metadata"]["name"], "faden-worker-nvidia");
    let container = &ds["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"], IMAGE);
    assert_eq!(container["command"], json!(["faden"]));

    let mut args: Vec<String> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(args[0], "worker");
    let data = point_at(&mut args, &server, dir.path());

    // The environment as the kubelet fills it: the token from the Secret, the node's name and
    // address from the pod's fields.
    let mut env: Vec<(String, String)> = Vec::new();
    for var in container["env"].as_array().unwrap() {
        let name = var["name"].as_str().unwrap().to_owned();
        let value = if let Some(v) = var["value"].as_str() {
            v.to_owned()
        } else if let Some(key) = var["valueFrom"]["secretKeyRef"].as_object() {
            assert_eq!(key["name"], secret["metadata"]["name"]);
            secret["stringData"][key["key"].as_str().unwrap()]
                .as_str()
                .unwrap()
                .to_owned()
        } else {
            match var["valueFrom"]["fieldRef"]["fieldPath"].as_str().unwrap() {
                "spec.nodeName" => "node-1".to_owned(),
                "status.hostIP" => "127.0.0.1".to_owned(),
                other => panic!("unexpected field {other}"),
            }
        };
        env.push((name, value));
    }
    assert_eq!(
        env.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        [
            "FADEN_TOKEN",
            "FADEN_WORKER_NAME",
            "FADEN_WORKER_IP",
            "NVIDIA_VISIBLE_DEVICES"
        ]
    );
    assert_eq!(env[0].1, cluster["registration_token"].as_str().unwrap());

    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let envs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (worker, worker_id) = start(bin(), &refs, &envs, "faden worker ready", "worker_id").await;
    let w = tunnel_up(&admin, &worker_id).await;
    assert_eq!(w["cluster_id"], id);
    assert_eq!(w["name"], "node-1");
    assert_eq!(w["ip"], "127.0.0.1");
    assert_eq!(w["proxy_mode"], "tunnel");
    assert!(data.join("worker.token").is_file());

    stop(worker).await;
    server.kill().await;
}
