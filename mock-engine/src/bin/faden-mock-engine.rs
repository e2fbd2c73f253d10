//! `faden-mock-engine`: the mock OpenAI-compatible engine as a process, for benchmarks and
//! manual tests. Prints `mock engine listening addr=HOST:PORT` to stderr once it accepts
//! connections; stops on Ctrl-C or SIGTERM and prints its counters.

use std::io::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use mock_engine::{Faults, Jitter, MockEngine, MockEngineConfig, PerfModelArgs};
use tokio::net::TcpListener;

/// A mock OpenAI-compatible inference engine with timed, deterministic output and injected
/// faults (chat and text completions, streamed or not, embeddings, /v1/models).
#[derive(Debug, Parser)]
#[command(name = "faden-mock-engine", version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the bound address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The served model name.
    #[arg(long, default_value = "mock-model")]
    model: String,
    /// Tokens per answer when the request sets no max_tokens.
    #[arg(long, default_value_t = 16)]
    tokens: usize,
    /// Time to first token, e.g. 50ms (with --kv-blocks: the fixed part of each prefill).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    ttft: Duration,
    /// Delay between tokens, e.g. 10ms (with --kv-blocks: the base of each decode step).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    itl: Duration,
    /// Jitter on the time to first token (the spread or the standard deviation, see --jitter).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    ttft_jitter: Duration,
    /// Jitter on each inter-token delay.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    itl_jitter: Duration,
    /// Distribution of the jitter.
    #[arg(long, value_enum, default_value_t = JitterKind::Uniform)]
    jitter: JitterKind,
    /// Bytes of each token's text (0: the natural "tok{i} ").
    #[arg(long, default_value_t = 0)]
    bytes_per_token: usize,
    /// Seed of the jitter and the faults.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Share of inference requests answered with --error-status (0 to 1).
    #[arg(long, default_value_t = 0.0, value_parser = parse_share)]
    error_rate: f64,
    /// Status of the injected errors.
    #[arg(long, default_value_t = 500)]
    error_status: u16,
    /// Share of requests answered 429.
    #[arg(long, default_value_t = 0.0, value_parser = parse_share)]
    rate_limit_rate: f64,
    /// Share of requests that stall (--stall) before their first token.
    #[arg(long, default_value_t = 0.0, value_parser = parse_share)]
    stall_before_first_rate: f64,
    /// Share of requests that stall (--stall) after their first token.
    #[arg(long, default_value_t = 0.0, value_parser = parse_share)]
    stall_after_first_rate: f64,
    /// Length of a stall.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    stall: Duration,
    /// Share of streams aborted mid-stream (connection reset without `[DONE]`).
    #[arg(long, default_value_t = 0.0, value_parser = parse_share)]
    abort_rate: f64,
    /// Tokens sent before an injected abort [default: half of the answer].
    #[arg(long)]
    abort_after_tokens: Option<usize>,
    /// Share of requests whose body is read slowly (--slow-read-bytes-per-sec).
    #[arg(long, default_value_t = 0.0, value_parser = parse_share)]
    slow_read_rate: f64,
    /// Reading speed of a slow read.
    #[arg(long, default_value_t = 16 * 1024)]
    slow_read_bytes_per_sec: u64,
    #[command(flatten)]
    perf: PerfModelArgs,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum JitterKind {
    /// Uniform in [delay - jitter, delay + jitter].
    Uniform,
    /// Normal with the jitter as standard deviation.
    Normal,
}

fn jitter(kind: JitterKind, d: Duration) -> Jitter {
    match (d.is_zero(), kind) {
        (true, _) => Jitter::None,
        (false, JitterKind::Uniform) => Jitter::Uniform(d),
        (false, JitterKind::Normal) => Jitter::Normal(d),
    }
}

fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a share between 0 and 1")),
    }
}

/// Ctrl-C, or SIGTERM on Unix.
async fn shutdown_signal() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let config = MockEngineConfig {
        model: a.model,
        tokens: a.tokens,
        time_to_first_token: a.ttft,
        inter_token_delay: a.itl,
        ttft_jitter: jitter(a.jitter, a.ttft_jitter),
        itl_jitter: jitter(a.jitter, a.itl_jitter),
        bytes_per_token: a.bytes_per_token,
        seed: a.seed,
        // A long-running process must not keep every request it saw.
        record_limit: 0,
        faults: Faults {
            error_rate: a.error_rate,
            error_status: a.error_status,
            rate_limit_rate: a.rate_limit_rate,
            stall_before_first_rate: a.stall_before_first_rate,
            stall_after_first_rate: a.stall_after_first_rate,
            stall: a.stall,
            abort_rate: a.abort_rate,
            abort_after_tokens: a.abort_after_tokens,
            slow_read_rate: a.slow_read_rate,
            slow_read_bytes_per_sec: a.slow_read_bytes_per_sec,
        },
        perf: a.perf.model(),
        ..MockEngineConfig::default()
    };
    let listener = TcpListener::bind((a.host.as_str(), a.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", a.host, a.port))?;
    let engine = MockEngine::start_on(listener, config)?;
    {
        let mut err = std::io::stderr().lock();
        writeln!(err, "mock engine listening addr={}", engine.addr)?;
        err.flush()?;
    }
    shutdown_signal().await?;
    let stats = &engine.stats;
    let mut err = std::io::stderr().lock();
    writeln!(
        err,
        "mock engine stopping requests={} completed={} disconnects={} errors={} rate_limited={} stalls={} aborted={}",
        stats.requests(),
        stats.completed(),
        stats.disconnects(),
        stats.injected_errors(),
        stats.rate_limited(),
        stats.stalls(),
        stats.aborted()
    )?;
    drop(err);
    engine.stop().await;
    Ok(())
}
