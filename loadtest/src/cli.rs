//! The command line of `faden-loadtest` (also usable as a `faden` subcommand).

use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{ArgGroup, Parser};

use crate::config::{
    Arrivals, ClientRoute, ConnectProxy, LoadModel, MAX_CONNECTIONS, RunConfig, Workload,
    WorkloadKind, parse_mix,
};
use crate::scenario::parse_scenario;

/// Runs longer than this show a progress line when stderr is a terminal.
const PROGRESS_AFTER: Duration = Duration::from_secs(3);

/// Load generator for OpenAI-compatible inference APIs (faden, vLLM, SGLang, ...).
///
/// Two load models: a closed loop (--concurrency N: N connections, each sending its next
/// request when the previous one is answered) and an open loop (--rate R: R requests per second
/// whatever the target does, latency measured from when each request was due, so a slow target
/// cannot hide its queueing; see docs/loadtest.md). Every run is bounded by --duration and/or
/// --requests.
#[derive(Debug, Parser)]
#[command(name = "faden-loadtest", version, about, long_about)]
#[command(group(ArgGroup::new("load").required(true).args(["concurrency", "rate"])))]
pub struct Cli {
    /// OpenAI-compatible base URL (plain HTTP), e.g. http://127.0.0.1:8080/v1. Repeat it (or
    /// separate with commas) to spread the requests over several targets (see --route).
    #[arg(
        long = "url",
        value_name = "URL",
        required = true,
        value_delimiter = ','
    )]
    pub urls: Vec<String>,

    /// With several --url: round-robin (each in turn) or affinity (a --scenario's tenant
    /// always to the same URL, by a fixed hash).
    #[arg(long, value_enum, default_value_t = ClientRoute::RoundRobin)]
    pub route: ClientRoute,

    /// API key, sent as `Authorization: Bearer KEY`.
    #[arg(
        long,
        env = "FADEN_API_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    pub api_key: Option<String>,

    /// The `model` field of every request.
    #[arg(long)]
    pub model: String,

    /// Closed loop: this many connections, each with one request in flight at a time.
    #[arg(long, short = 'c', value_name = "N", value_parser = clap::value_parser!(u64).range(1..=MAX_CONNECTIONS as u64))]
    pub concurrency: Option<u64>,

    /// Open loop: this many requests per second, on schedule, whatever the target does.
    #[arg(long, short = 'r', value_name = "PER_SEC", value_parser = parse_rate)]
    pub rate: Option<f64>,

    /// Open loop: when requests are due: uniform (evenly spaced) or poisson (exponential gaps
    /// drawn from --seed). [default: uniform]
    #[arg(long, value_enum, conflicts_with = "concurrency")]
    pub arrivals: Option<Arrivals>,

    /// Open loop: most requests in flight; a request due beyond it is dropped (an error).
    /// [default: 1024]
    #[arg(long, value_name = "N", conflicts_with = "concurrency", value_parser = clap::value_parser!(u64).range(1..=MAX_CONNECTIONS as u64))]
    pub max_outstanding: Option<u64>,

    /// Length of the measured phase, e.g. 10s, 2m [default: 10s, or unbounded up to 1h with
    /// --requests]. Requests still running at the end are cancelled ("unfinished").
    #[arg(long, short = 'd', value_parser = parse_positive_duration)]
    pub duration: Option<Duration>,

    /// Stop after exactly this many requests (closed loop: answered; open loop: due).
    #[arg(long, short = 'n', value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,

    /// Load sent before the measured phase and not recorded (opens connections, warms caches).
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub warmup: Duration,

    /// Bound on one request, from sending it to the end of its answer.
    #[arg(long, default_value = "60s", value_parser = parse_positive_duration)]
    pub timeout: Duration,

    /// The API to call.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Chat)]
    pub workload: WorkloadKind,

    /// Ask for streamed answers (SSE) and measure time to first token and inter-token latency.
    #[arg(long)]
    pub stream: bool,

    /// Size of each request body in bytes (the prompt is padded to reach it).
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub prompt_bytes: usize,

    /// `max_tokens` of each generation request.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub max_tokens: u32,

    /// A weighted mix of workloads instead of --workload/--stream/--prompt-bytes/--max-tokens:
    /// a YAML or JSON list like
    /// `[{workload: chat, stream: true, weight: 3, max_tokens: 128}, {workload: embeddings}]`.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["workload", "stream", "prompt_bytes", "max_tokens"])]
    pub mix: Option<PathBuf>,

    /// A generated workload instead of fixed requests: a YAML or JSON file such as
    /// `prefix: {tenants: 64, system_tokens_min: 1000, system_tokens_max: 6000, zipf_s: 1.0,
    /// turns: 4}` (multi-tenant shared prefixes, multi-turn conversations; see
    /// docs/loadtest.md). Unknown keys are errors.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["workload", "stream", "prompt_bytes", "max_tokens", "mix"])]
    pub scenario: Option<PathBuf>,

    /// Also write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Show the progress line on stderr even if it is not a terminal or the run is short.
    #[arg(long)]
    pub progress: bool,

    /// Never show the progress line.
    #[arg(long, conflicts_with = "progress")]
    pub no_progress: bool,

    /// Compare with a second base URL: the same load, alternating between the two in slices
    /// (--slice), then the ratio B/A of every figure. --duration is the total.
    #[arg(long, value_name = "URL2")]
    pub compare: Option<String>,

    /// API key of the --compare target [default: --api-key].
    #[arg(long, value_name = "KEY", requires = "compare", hide_env_values = true)]
    pub compare_api_key: Option<String>,

    /// Length of one --compare slice.
    #[arg(long, default_value = "1s", value_parser = parse_positive_duration, requires = "compare")]
    pub slice: Duration,

    /// Seed of the random choices: the --mix, the --scenario, Poisson arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Go through an HTTP proxy: each connection first sends `CONNECT` to HOST:PORT, expects
    /// 200, then carries its keep-alive requests to the target through that tunnel.
    #[arg(long, value_name = "HOST:PORT", conflicts_with = "compare")]
    pub connect_proxy: Option<String>,

    /// The `CONNECT` target [default: the --url's host:port], e.g. model-1-7.static:0 for a
    /// faden proxy port that relays to that model instance.
    #[arg(long, value_name = "AUTHORITY", requires = "connect_proxy")]
    pub connect_target: Option<String>,

    /// Key sent to the --connect-proxy as `Proxy-Authorization: Bearer KEY`.
    #[arg(
        long,
        env = "FADEN_PROXY_AUTH",
        hide_env_values = true,
        value_name = "KEY",
        requires = "connect_proxy"
    )]
    pub proxy_auth: Option<String>,

    /// Close each connection once its request is answered and open a new one for the next
    /// (through --connect-proxy, with its own CONNECT): what callers that keep no connection
    /// alive pay.
    #[arg(long)]
    pub connection_per_request: bool,
}

/// What the command line asks for.
#[derive(Clone, Debug)]
pub enum Plan {
    /// One target.
    Run(RunConfig),
    /// Two targets in alternating slices.
    Compare {
        a: RunConfig,
        b: Box<RunConfig>,
        slice: Duration,
    },
}

impl Cli {
    /// Builds and checks the run. `stderr_is_terminal` decides the default progress line.
    pub fn plan(&self, stderr_is_terminal: bool) -> anyhow::Result<Plan> {
        let load = match (self.concurrency, self.rate) {
            (Some(c), None) => LoadModel::Closed {
                concurrency: usize::try_from(c)?,
            },
            (None, Some(rate)) => LoadModel::Open {
                rate,
                max_outstanding: usize::try_from(self.max_outstanding.unwrap_or(1024))?,
            },
            _ => anyhow::bail!("give exactly one of --concurrency and --rate"),
        };
        let workloads = match &self.mix {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read --mix {}", path.display()))?;
                parse_mix(&text).with_context(|| format!("--mix {}", path.display()))?
            }
            None => vec![Workload {
                kind: self.workload,
                weight: 1,
                stream: self.stream,
                prompt_bytes: self.prompt_bytes,
                max_tokens: self.max_tokens,
            }],
        };
        let scenario = match &self.scenario {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read --scenario {}", path.display()))?;
                Some(
                    parse_scenario(&text)
                        .with_context(|| format!("--scenario {}", path.display()))?,
                )
            }
            None => None,
        };
        let (url, more_urls) = self.urls.split_first().context("give at least one --url")?;
        let mut config = RunConfig::new(url.clone(), self.model.clone());
        config.more_urls = more_urls.to_vec();
        config.route = self.route;
        config.arrivals = self.arrivals.unwrap_or_default();
        config.scenario = scenario;
        config.api_key.clone_from(&self.api_key);
        config.load = load;
        config.duration = self.duration;
        config.requests = self.requests;
        config.warmup = self.warmup;
        config.timeout = self.timeout;
        config.workloads = workloads;
        config.seed = self.seed;
        config.connect_proxy = self.connect_proxy.as_ref().map(|addr| ConnectProxy {
            addr: addr.clone(),
            target: self.connect_target.clone(),
            auth: self.proxy_auth.clone(),
        });
        config.connection_per_request = self.connection_per_request;
        let long = self.requests.is_some() && self.duration.is_none()
            || config.limits().0 > PROGRESS_AFTER;
        config.progress = self.progress || (!self.no_progress && stderr_is_terminal && long);
        crate::run::check(&config)?;
        let Some(url2) = &self.compare else {
            return Ok(Plan::Run(config));
        };
        anyhow::ensure!(config.more_urls.is_empty(), "--compare takes one --url");
        let mut b = config.clone();
        b.url.clone_from(url2);
        if self.compare_api_key.is_some() {
            b.api_key.clone_from(&self.compare_api_key);
        }
        crate::run::check(&b).context("--compare")?;
        anyhow::ensure!(
            self.requests.is_none(),
            "--compare runs for a --duration; drop --requests"
        );
        Ok(Plan::Compare {
            a: config,
            b: Box::new(b),
            slice: self.slice,
        })
    }
}

/// Runs what the command line asks for, prints the report to stdout and writes the JSON.
pub async fn execute(cli: Cli) -> anyhow::Result<()> {
    let plan = cli.plan(std::io::stderr().is_terminal())?;
    let (text, json) = match plan {
        Plan::Run(config) => {
            let report = crate::run(config).await?;
            (report.to_text(), serde_json::to_vec_pretty(&report)?)
        }
        Plan::Compare { a, b, slice } => {
            let report = crate::compare(a, *b, slice).await?;
            (report.to_text(), serde_json::to_vec_pretty(&report)?)
        }
    };
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    if let Some(path) = &cli.json {
        std::fs::write(path, json).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 500ms, 10s, 2m)"))
}

fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be greater than zero".to_owned());
    }
    Ok(d)
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let r: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if !r.is_finite() || r <= 0.0 {
        return Err("must be a number greater than zero".to_owned());
    }
    Ok(r)
}
