//! Command-line interface. Every flag can also be set through a `FADEN_*` environment variable.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use control::api::ApiConfig;
use control::server::{ListenerLimits, Server, ServerConfig};
use tokio_util::sync::CancellationToken;

/// faden: the data plane for GPU inference clusters.
#[derive(Debug, Parser)]
#[command(name = "faden", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub log: LogArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Logging options.
#[derive(Debug, Args)]
pub struct LogArgs {
    /// Log filter, e.g. `info`, `faden=debug,control=debug` (tracing's env-filter syntax).
    #[arg(long = "log", env = "FADEN_LOG", default_value = "info", global = true)]
    pub filter: String,
    /// Log as JSON lines instead of text.
    #[arg(long = "log-json", env = "FADEN_LOG_JSON", global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server: the management API (clusters, workers, models, instances, API keys) with
    /// its embedded store and watch streams.
    Server(ServerArgs),
}

/// Options of `faden server`.
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// Directory for the database and the generated admin key (created with mode 0700).
    #[arg(long, env = "FADEN_DATA_DIR", default_value = "faden-data")]
    pub data_dir: PathBuf,
    /// Address to listen on.
    #[arg(long, env = "FADEN_HOST", default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// Port of the management API (GPUStack's `api_port`). 0 picks a free port.
    #[arg(long, env = "FADEN_API_PORT", default_value_t = 30080)]
    pub api_port: u16,
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
    /// On SIGTERM/SIGINT, how long open requests may still run.
    #[arg(long, env = "FADEN_DRAIN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// Most client connections served at once.
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
        if !problems.is_empty() {
            anyhow::bail!("invalid configuration:\n  {}", problems.join("\n  "));
        }
        let api_addr = SocketAddr::new(self.host, self.api_port);
        Ok(ServerConfig {
            data_dir: self.data_dir.clone(),
            api_addr,
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

pub fn init_tracing(log: &LogArgs) {
    let filter = tracing_subscriber::EnvFilter::try_new(&log.filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if log.json {
        builder.json().init();
    } else {
        builder.init();
    }
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Server(args) => run_server(args).await,
    }
}

async fn run_server(args: ServerArgs) -> anyhow::Result<()> {
    let config = args.to_config()?;
    let shutdown = CancellationToken::new();
    let server = Server::start(config, shutdown.clone())
        .await
        .context("starting the server")?;
    // Tests and scripts read the bound address from this line.
    tracing::info!(api = %server.api_addr, "faden server ready");
    shutdown_signal().await;
    tracing::info!(grace = ?args.drain_timeout, "shutting down");
    shutdown.cancel();
    server.wait().await;
    Ok(())
}

/// Resolves on the first SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
