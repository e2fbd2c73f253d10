//! Command-line interface. Every flag can also be set through a `FADEN_*` environment variable.

use clap::{Args, Parser, Subcommand};

use crate::{gateway_cmd, mock_cmd, probe_cmd, server_cmd, up_cmd, worker_cmd};

/// faden: the data plane for GPU inference clusters.
///
/// Quick start: `faden up` runs everything on one machine (management API, gateway, an embedded
/// worker and a mock engine serving model `demo`) and prints a curl command to try.
#[derive(Debug, Parser)]
#[command(name = "faden", version, about, long_about, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub log: LogArgs,
    /// Serving cores (default: one per available core): each a thread with its own event loop
    /// and its own listening socket of the gateway and proxy ports, serving the requests of
    /// the connections it accepted start to end. The management API, tunnels, sync and
    /// background work run on a separate runtime of up to this many threads (one: tokio's
    /// current-thread scheduler).
    #[arg(long, env = "FADEN_WORKER_THREADS", global = true, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,
    #[command(subcommand)]
    pub command: Command,
}

/// Logging options.
#[derive(Debug, Args)]
pub struct LogArgs {
    /// Log filter, e.g. `info` or `info,gateway=debug` (tracing's env-filter syntax).
    #[arg(long = "log", env = "FADEN_LOG", default_value = "info", global = true)]
    pub filter: String,
    /// Log as JSON lines instead of text.
    #[arg(long = "log-json", env = "FADEN_LOG_JSON", global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Everything on one machine: `faden server` plus an embedded worker (direct mode) and a
    /// mock inference engine serving model `demo`; prints an API key and a curl command.
    Up(up_cmd::UpArgs),
    /// The server: management API (clusters, workers, models, instances, API keys, watch
    /// streams) with its embedded store, and the OpenAI-compatible gateway beside it.
    Server(server_cmd::ServerArgs),
    /// A standalone gateway that syncs its routing from a remote management API (scale out
    /// behind a load balancer).
    ///
    /// In front of a GPUStack 2.3 server, with an admin user's GPUStack API key:
    /// `faden gateway --server-url http://gpustack:30080 --token gpustack_…`; clients then call
    /// `http://<this host>:8080/v1` with their own GPUStack keys (docs/gpustack.md).
    #[command(verbatim_doc_comment)]
    Gateway(gateway_cmd::GatewayCmdArgs),
    /// A worker: registers with a server, heartbeats, reports its local inference servers and
    /// serves them through the worker reverse proxy.
    Worker(worker_cmd::WorkerArgs),
    /// A mock OpenAI-compatible inference engine (for trials, tests and benchmarks).
    MockEngine(mock_cmd::MockArgs),
    /// GET a URL and exit 0 on a 2xx answer: the health check of the image, which has no shell
    /// and no curl (e.g. `faden probe http://127.0.0.1:8080/readyz`).
    Probe(probe_cmd::ProbeArgs),
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
        Command::Up(args) => up_cmd::run(args).await,
        Command::Server(args) => server_cmd::run(args).await,
        Command::Gateway(args) => gateway_cmd::run(args).await,
        Command::Worker(args) => worker_cmd::run(args).await,
        Command::MockEngine(args) => mock_cmd::run(args).await,
        Command::Probe(args) => probe_cmd::run(args).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        super::Cli::command().debug_assert();
    }

    #[test]
    fn every_flag_is_explained() {
        let mut cmd = super::Cli::command();
        cmd.build();
        for sub in cmd.get_subcommands() {
            assert!(sub.get_about().is_some(), "{} has no help", sub.get_name());
            for arg in sub.get_arguments() {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                assert!(
                    arg.get_help().is_some(),
                    "{} --{id} has no help",
                    sub.get_name()
                );
            }
        }
    }
}
