//! `faden server`: the management API and the gateway beside it.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use control::api::ApiConfig;
use control::model::Scope;
use control::server::{ListenerLimits, Server, ServerConfig, load_or_create_key};
use control::sync::{self, SyncConfig, SyncHandle};
use tokio_util::sync::CancellationToken;

use crate::gateway_cmd::{GatewayArgs, RunningGateway, start_gateway};

/// File (in the data directory) with the data-plane key of the server's own gateway.
const GATEWAY_KEY_FILE: &str = "gateway.key";

/// Options of `faden server`.
#[derive(Debug, Args, Clone)]
pub struct ServerArgs {
    /// Directory for the database and the generated keys (created with mode 0700).
    #[arg(long, env = "FADEN_DATA_DIR", default_value = "faden-data")]
    pub data_dir: PathBuf,
    /// Address to listen on (API and gateway).
    #[arg(long, env = "FADEN_HOST", default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// Port of the management API (GPUStack's `api_port`). 0 picks a free port.
    #[arg(long, env = "FADEN_API_PORT", default_value_t = 30080)]
    pub api_port: u16,
    #[command(flatten)]
    pub gateway: GatewayArgs,
    /// Admin API key to use instead of the generated `DATA_DIR/admin.key`
    /// (form `fdn_<16 hex>_<32 hex>`).
    #[arg(long, env = "FADEN_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// URL workers use to reach this server [default: http://<host>:<api-port>, with
    /// 127.0.0.1 as the host when listening on 0.0.0.0].
    #[arg(long, env = "FADEN_SERVER_URL")]
    pub server_url: Option<String>,
    /// A worker without a heartbeat for this long becomes `not_ready`.
    #[arg(long, env = "FADEN_WORKER_HEARTBEAT_TIMEOUT", default_value = "150s", value_parser = humantime::parse_duration)]
    pub worker_heartbeat_timeout: Duration,
    /// Interval of the blank-line heartbeat on idle watch streams.
    #[arg(long, env = "FADEN_WATCH_HEARTBEAT", default_value = "15s", value_parser = humantime::parse_duration)]
    pub watch_heartbeat: Duration,
    /// Number of change events kept so that watchers can resume with `?since=`.
    #[arg(long, env = "FADEN_EVENT_HISTORY", default_value_t = control::store::DEFAULT_HISTORY)]
    pub event_history: u64,
    /// On SIGTERM/SIGINT, how long in-flight requests and streams may still run.
    #[arg(long, env = "FADEN_DRAIN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// Most client connections to the management API at once.
    #[arg(long, env = "FADEN_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,
}

impl ServerArgs {
    fn to_config(&self) -> anyhow::Result<ServerConfig> {
        let mut problems = Vec::new();
        if self.worker_heartbeat_timeout < Duration::from_millis(100) {
            problems.push("--worker-heartbeat-timeout must be at least 100ms".to_owned());
        }
        if self.watch_heartbeat < Duration::from_millis(10) {
            problems.push("--watch-heartbeat must be at least 10ms".to_owned());
        }
        if self.event_history == 0 {
            problems.push("--event-history must be at least 1".to_owned());
        }
        if self.max_connections == 0 {
            problems.push("--max-connections must be at least 1".to_owned());
        }
        if let Some(url) = &self.server_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                problems.push(format!(
                    "--server-url {url:?} must start with http:// or https://"
                ));
            }
        }
        if self.api_port != 0 && self.api_port == self.gateway.port {
            problems.push(format!("--api-port and --port are both {}", self.api_port));
        }
        if !problems.is_empty() {
            anyhow::bail!("invalid configuration:\n  {}", problems.join("\n  "));
        }
        Ok(ServerConfig {
            data_dir: self.data_dir.clone(),
            api_addr: SocketAddr::new(self.host, self.api_port),
            admin_key: self.admin_key.clone(),
            api: ApiConfig {
                heartbeat_timeout: self.worker_heartbeat_timeout,
                watch_heartbeat: self.watch_heartbeat,
                server_url: self.server_url.clone().unwrap_or_default(),
            },
            history: self.event_history,
            shutdown_grace: self.drain_timeout,
            limits: ListenerLimits {
                max_connections: self.max_connections,
                ..ListenerLimits::default()
            },
        })
    }
}

/// A running server: API, its own sync client and gateway.
pub struct Started {
    pub server: Server,
    pub gateway: RunningGateway,
    pub sync: SyncHandle,
    /// Ends the API (after the gateway drained).
    api_shutdown: CancellationToken,
    /// Drains the gateway.
    gateway_shutdown: CancellationToken,
    sync_cancel: CancellationToken,
}

impl Started {
    /// The API URL on loopback (what in-process clients use).
    pub fn local_api_url(&self) -> String {
        format!("http://{}", loopback(self.server.api_addr))
    }

    /// Drains the gateway, then stops the API.
    pub async fn stop(self) {
        self.gateway_shutdown.cancel();
        let _ = self.gateway.task.await;
        self.sync_cancel.cancel();
        self.api_shutdown.cancel();
        self.server.wait().await;
    }
}

/// `addr` with a loopback IP when it is the unspecified address.
pub fn loopback(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new(IpAddr::from([127, 0, 0, 1]), addr.port())
    } else {
        addr
    }
}

/// Starts the API, then the gateway fed by a sync client of the API itself (the same path a
/// standalone gateway takes, over loopback).
pub async fn start(args: &ServerArgs) -> anyhow::Result<Started> {
    let config = args.to_config()?;
    let gateway_config = args.gateway.to_config(args.drain_timeout)?;
    let api_shutdown = CancellationToken::new();
    let server = Server::start(config, api_shutdown.clone())
        .await
        .context("starting the server")?;
    let (gateway_key, _) = load_or_create_key(
        &server.store,
        &args.data_dir,
        GATEWAY_KEY_FILE,
        "faden gateway (built in)",
        Scope::DataPlane,
    )
    .await?;
    let sync_cancel = CancellationToken::new();
    let api_url = format!("http://{}", loopback(server.api_addr));
    let sync = sync::spawn(SyncConfig::new(&api_url, gateway_key), sync_cancel.clone())?;
    let gateway_shutdown = CancellationToken::new();
    let gateway = start_gateway(
        gateway_config,
        SocketAddr::new(args.host, args.gateway.port),
        sync.clone(),
        gateway_shutdown.clone(),
    )
    .await?;
    Ok(Started {
        server,
        gateway,
        sync,
        api_shutdown,
        gateway_shutdown,
        sync_cancel,
    })
}

pub async fn run(args: ServerArgs) -> anyhow::Result<()> {
    let started = start(&args).await?;
    // Tests and scripts read the bound addresses from this line.
    tracing::info!(api = %started.server.api_addr, gateway = %started.gateway.addr, "faden server ready");
    crate::cli::shutdown_signal().await;
    tracing::info!(drain = ?args.drain_timeout, "shutting down: draining the gateway");
    started.stop().await;
    Ok(())
}
