//! `faden mock-engine`: the mock OpenAI-compatible engine as a process.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use mock_engine::{MockEngine, MockEngineConfig, PerfModelArgs};
use tokio::net::TcpListener;

/// Options of `faden mock-engine`.
#[derive(Debug, Args, Clone)]
pub struct MockArgs {
    /// Address to listen on.
    #[arg(long, env = "FADEN_MOCK_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on. 0 picks a free port.
    #[arg(long, env = "FADEN_MOCK_PORT", default_value_t = 0)]
    pub port: u16,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// How the mock engine answers.
#[derive(Debug, Args, Clone)]
pub struct EngineArgs {
    /// Model name it serves.
    #[arg(long, env = "FADEN_MOCK_MODEL", default_value = "demo")]
    pub model: String,
    /// Tokens per answer (when the request sets no max_tokens).
    #[arg(long, env = "FADEN_MOCK_TOKENS", default_value_t = 16)]
    pub tokens: usize,
    /// Time to first token (with --kv-blocks: the fixed part of each prefill).
    #[arg(long, env = "FADEN_MOCK_TTFT", default_value = "0ms", value_parser = humantime::parse_duration)]
    pub ttft: Duration,
    /// Delay between tokens (with --kv-blocks: the base of each decode step).
    #[arg(long, env = "FADEN_MOCK_ITL", default_value = "0ms", value_parser = humantime::parse_duration)]
    pub itl: Duration,
    /// The performance model (prefix cache, queue, serialized prefill): see docs/loadtest.md.
    #[command(flatten)]
    pub perf: PerfModelArgs,
}

impl EngineArgs {
    pub fn config(&self) -> MockEngineConfig {
        MockEngineConfig {
            model: self.model.clone(),
            tokens: self.tokens,
            time_to_first_token: self.ttft,
            inter_token_delay: self.itl,
            perf: self.perf.model(),
            // A long-running process keeps no request log.
            record_limit: 0,
            ..MockEngineConfig::default()
        }
    }
}

pub async fn run(args: MockArgs) -> anyhow::Result<()> {
    let addr = SocketAddr::new(args.host, args.port);
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let engine = MockEngine::start_on(listener, args.engine.config())?;
    tracing::info!(addr = %engine.addr, model = %args.engine.model, "mock engine listening");
    crate::shutdown::shutdown_signal().await;
    engine.stop().await;
    Ok(())
}
