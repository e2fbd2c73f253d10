//! `faden up`: one command for a complete local deployment: the server (API + gateway), an
//! embedded worker in `direct` mode, and a mock engine serving a model.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use control::server::load_or_create_key;
use control_client::client::ApiClient;
use control_client::model::{ProxyMode, Scope};
use http::Method;
use mock_engine::MockEngine;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use worker::agent::{Agent, LocalInstance, Registration};

use crate::mock_cmd::EngineArgs;
use crate::server_cmd::{self, ServerArgs};

/// File (in the data directory) with the inference key printed by `faden up`.
const INFERENCE_KEY_FILE: &str = "inference.key";

/// Options of `faden up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Mock engine options (`--model` is the model name clients send).
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub async fn run(mut args: UpArgs) -> anyhow::Result<()> {
    // A visible stream by default: 50 ms between tokens unless asked otherwise.
    if args.engine.itl.is_zero() && std::env::var_os("FADEN_MOCK_ITL").is_none() {
        args.engine.itl = Duration::from_millis(50);
    }
    let started = server_cmd::start(&args.server).await?;
    let api = ApiClient::with_tls(&started.local_api_url(), started.local_api_tls.clone())?;
    let admin = started.server.admin_key.clone();

    // The default cluster and the model.
    let clusters: Value = api
        .json(Method::GET, "/v2/clusters?page=-1", &admin, None)
        .await?;
    let cluster = match clusters["items"].as_array().and_then(|a| a.first()) {
        Some(c) => c.clone(),
        None => {
            api.json(
                Method::POST,
                "/v2/clusters",
                &admin,
                Some(&json!({"name": "default"})),
            )
            .await?
        }
    };
    let registration_token = cluster["registration_token"]
        .as_str()
        .context("the cluster has no registration token")?
        .to_owned();
    let (status, body) = api
        .call(
            Method::POST,
            "/v2/models",
            &admin,
            Some(&json!({"name": args.engine.model})),
        )
        .await?;
    if !status.is_success() && status != http::StatusCode::CONFLICT {
        anyhow::bail!(
            "creating model {}: {status} {}",
            args.engine.model,
            String::from_utf8_lossy(&body)
        );
    }

    // The mock engine and the embedded worker that reports it.
    let engine = MockEngine::start(args.engine.config())
        .await
        .context("starting the mock engine")?;
    let registration = Registration {
        name: "embedded".to_owned(),
        hostname: "embedded".to_owned(),
        ip: "127.0.0.1".to_owned(),
        advertise_address: None,
        port: control_client::model::DEFAULT_WORKER_PORT,
        metrics_port: control_client::model::MetricsPort::default(),
        proxy_mode: ProxyMode::Direct,
        labels: Default::default(),
    };
    let agent = Agent::register(
        api.clone(),
        &registration_token,
        &registration,
        Some(args.server.data_dir.join("worker")),
    )
    .await?;
    let locals = vec![LocalInstance {
        model: args.engine.model.clone(),
        port: engine.port(),
    }];
    agent.prune(&locals).await?;
    let worker_shutdown = CancellationToken::new();
    // The mock engine's load, read and reported as a standalone worker does.
    let mut engine_load = tokio::task::JoinSet::new();
    worker::engine_load::start(
        &mut engine_load,
        agent.instance_updates(),
        api.urls(),
        agent.token(),
        started.local_api_tls.clone(),
        worker::engine_load::DEFAULT_INTERVAL,
        &worker_shutdown,
    );
    let agent = Arc::new(agent);
    // Ends at `worker_shutdown`; awaited at shutdown.
    let worker_task = net::task::spawn(agent.clone().run(
        locals,
        Duration::from_secs(30),
        Duration::from_secs(5),
        None,
        worker_shutdown.clone(),
    ));

    let (key, key_path) = load_or_create_key(
        &started.server.store,
        &args.server.data_dir,
        INFERENCE_KEY_FILE,
        "faden up",
        Scope::Inference,
    )
    .await?;
    // Wait until the model is routable, so the printed command works right away.
    let routable = tokio::time::timeout(Duration::from_secs(10), async {
        let mut rx = started.sync.snapshots();
        while rx
            .borrow_and_update()
            .routable(&args.engine.model)
            .is_none()
        {
            if rx.changed().await.is_err() {
                break;
            }
        }
    })
    .await;
    if routable.is_err() {
        tracing::warn!(
            "model {} is not routable yet; check the logs",
            args.engine.model
        );
    }
    let gateway = server_cmd::loopback(started.gateway.addr);
    tracing::info!(
        api = %started.server.api_addr,
        gateway = %started.gateway.addr,
        model = %args.engine.model,
        key_file = %key_path.display(),
        "faden up ready"
    );
    eprintln!(
        "\nfaden is up. Try:\n\n  curl -N http://{gateway}/v1/chat/completions \\\n    -H 'Authorization: Bearer {key}' \\\n    -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{model}\", \"stream\": true, \"messages\": [{{\"role\": \"user\", \"content\": \"hello\"}}]}}'\n\nAPI key: {key} (also in {path})\nAdmin key for the management API (http://{api}): {admin_path}\n",
        model = args.engine.model,
        path = key_path.display(),
        api = server_cmd::loopback(started.server.api_addr),
        admin_path = started
            .server
            .admin_key_path
            .as_ref()
            .map_or("FADEN_ADMIN_KEY".to_owned(), |p| p.display().to_string()),
    );
    crate::shutdown::shutdown_signal().await;
    tracing::info!("shutting down");
    started.stop().await;
    worker_shutdown.cancel();
    let _ = worker_task.await;
    while engine_load.join_next().await.is_some() {}
    engine.stop().await;
    Ok(())
}
