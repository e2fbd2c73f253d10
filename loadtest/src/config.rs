//! What a run does: the target, the load model, the workloads and the bounds.

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use serde::{Deserialize, Serialize};

use crate::scenario::Scenario;

/// No run lasts longer than this, whatever the flags say.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);
/// No run sends more requests than this.
pub const MAX_REQUESTS: u64 = 100_000_000;
/// Most connections (closed loop) or outstanding requests (open loop) a run may use.
pub const MAX_CONNECTIONS: usize = 100_000;
/// Highest open-loop arrival rate.
pub const MAX_RATE: f64 = 10_000_000.0;
/// Duration of a run bounded by nothing else.
pub const DEFAULT_DURATION: Duration = Duration::from_secs(10);

/// How requests are offered to the target.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "model")]
pub enum LoadModel {
    /// `concurrency` workers, each with its own connection, each sending its next request as
    /// soon as the previous one finished. The target sets the pace.
    Closed {
        /// Workers (and connections).
        concurrency: usize,
    },
    /// Requests arrive at `rate` per second whatever the target does; latency is measured from
    /// the time each request was due. At most `max_outstanding` requests are in flight: a
    /// request due while that many are still running is dropped and counted as an error.
    Open {
        /// Arrivals per second.
        rate: f64,
        /// Bound on requests in flight (and connections).
        max_outstanding: usize,
    },
}

impl std::fmt::Display for LoadModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Closed { concurrency } => write!(f, "closed loop, concurrency {concurrency}"),
            Self::Open {
                rate,
                max_outstanding,
            } => write!(
                f,
                "open loop, {rate} req/s, at most {max_outstanding} outstanding"
            ),
        }
    }
}

/// The API a workload calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadKind {
    /// `POST {base}/chat/completions`
    Chat,
    /// `POST {base}/completions`
    Completions,
    /// `POST {base}/embeddings`
    Embeddings,
}

impl WorkloadKind {
    /// The path under the base URL.
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/chat/completions",
            Self::Completions => "/completions",
            Self::Embeddings => "/embeddings",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::Completions => "completions",
            Self::Embeddings => "embeddings",
        }
    }
}

/// One kind of request. A mix is a list of them with weights.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// The API to call.
    #[serde(rename = "workload")]
    pub kind: WorkloadKind,
    /// Relative share of requests (in a mix).
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Ask for a streamed (SSE) answer.
    #[serde(default)]
    pub stream: bool,
    /// Size of the request body in bytes (the prompt is padded to reach it).
    #[serde(default = "default_prompt_bytes")]
    pub prompt_bytes: usize,
    /// `max_tokens` of each request (not sent for embeddings).
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
}

fn default_weight() -> u32 {
    1
}
fn default_prompt_bytes() -> usize {
    256
}
fn default_max_tokens() -> u32 {
    16
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            kind: WorkloadKind::Chat,
            weight: 1,
            stream: false,
            prompt_bytes: default_prompt_bytes(),
            max_tokens: default_max_tokens(),
        }
    }
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.kind.name())?;
        if self.stream {
            write!(f, " stream")?;
        }
        write!(f, " body={}B", self.prompt_bytes)?;
        if self.kind != WorkloadKind::Embeddings {
            write!(f, " max_tokens={}", self.max_tokens)?;
        }
        if self.weight != 1 {
            write!(f, " weight={}", self.weight)?;
        }
        Ok(())
    }
}

/// Reads a weighted mix: a YAML or JSON list of [`Workload`]s, e.g.
/// `[{workload: chat, stream: true, weight: 3}, {workload: embeddings}]`.
pub fn parse_mix(text: &str) -> anyhow::Result<Vec<Workload>> {
    let mix: Vec<Workload> = serde_yaml_ng::from_str(text).context("invalid mix")?;
    ensure!(!mix.is_empty(), "the mix lists no workload");
    ensure!(
        mix.iter().any(|w| w.weight > 0),
        "every workload of the mix has weight 0"
    );
    Ok(mix)
}

/// Reaching the target through an HTTP proxy's `CONNECT` tunnel: each connection first sends
/// `CONNECT <target>` to the proxy, expects 200, then carries its keep-alive requests to the
/// target through the tunnel (`--url` still gives the path prefix and `Host`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectProxy {
    /// `host:port` of the proxy.
    pub addr: String,
    /// The `CONNECT` target (`None`: the `--url`'s `host:port`).
    pub target: Option<String>,
    /// Sent to the proxy as `Proxy-Authorization: Bearer <key>`.
    pub auth: Option<String>,
}

/// How the client spreads requests over several base URLs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ClientRoute {
    /// Each URL in turn.
    #[default]
    RoundRobin,
    /// A scenario's tenant always to the same URL, chosen by a fixed hash of the tenant (the
    /// upper bound of prefix-cache affinity; a popular tenant loads its URL alone).
    Affinity,
}

/// When the requests of an open loop are due.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Arrivals {
    /// Evenly spaced, `1 / rate` apart.
    #[default]
    Uniform,
    /// A Poisson process: exponential gaps of mean `1 / rate`, drawn from the seed.
    Poisson,
}

/// Everything a run needs. Build it with [`RunConfig::new`] and change the fields.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// OpenAI-compatible base URL, e.g. `http://127.0.0.1:8080/v1` (plain HTTP only).
    pub url: String,
    /// More base URLs: each request goes to one of `url` and these, chosen by `route`.
    pub more_urls: Vec<String>,
    /// How requests are spread over several URLs.
    pub route: ClientRoute,
    /// Open loop: when requests are due.
    pub arrivals: Arrivals,
    /// A generated workload instead of `workloads`.
    pub scenario: Option<Scenario>,
    /// Sent as `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// The `model` of every request.
    pub model: String,
    /// Closed or open loop.
    pub load: LoadModel,
    /// Length of the measured phase (`None`: bounded by `requests` and [`MAX_DURATION`]).
    pub duration: Option<Duration>,
    /// Requests of the measured phase (`None`: bounded by `duration`).
    pub requests: Option<u64>,
    /// Unrecorded load before the measured phase (connections stay open).
    pub warmup: Duration,
    /// Bound on one request, from sending it to the end of its answer.
    pub timeout: Duration,
    /// What to send; several make a weighted mix.
    pub workloads: Vec<Workload>,
    /// Print a live progress line to stderr.
    pub progress: bool,
    /// Seed of the mix choices.
    pub seed: u64,
    /// Go through an HTTP `CONNECT` proxy.
    pub connect_proxy: Option<ConnectProxy>,
    /// Close each connection once its request is answered: every request opens its own (and
    /// sends its own `CONNECT` through a proxy).
    pub connection_per_request: bool,
}

impl RunConfig {
    /// A closed loop of 1 against `url` for [`DEFAULT_DURATION`], non-streamed chat.
    pub fn new(url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            more_urls: Vec::new(),
            route: ClientRoute::RoundRobin,
            arrivals: Arrivals::Uniform,
            scenario: None,
            api_key: None,
            model: model.into(),
            load: LoadModel::Closed { concurrency: 1 },
            duration: None,
            requests: None,
            warmup: Duration::ZERO,
            timeout: Duration::from_secs(60),
            workloads: vec![Workload::default()],
            progress: false,
            seed: 0,
            connect_proxy: None,
            connection_per_request: false,
        }
    }

    /// The bounds of the measured phase: a duration (always) and maybe a request count.
    pub fn limits(&self) -> (Duration, Option<u64>) {
        match (self.duration, self.requests) {
            (Some(d), n) => (d, n),
            (None, Some(n)) => (MAX_DURATION, Some(n)),
            (None, None) => (DEFAULT_DURATION, None),
        }
    }

    /// Every base URL: `url`, then `more_urls`.
    pub fn urls(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.url.as_str()).chain(self.more_urls.iter().map(String::as_str))
    }

    /// Checks every bound; the error says which flag is wrong.
    pub fn validate(&self) -> anyhow::Result<()> {
        if let Some(s) = &self.scenario {
            s.validate()?;
        }
        ensure!(
            self.route != ClientRoute::Affinity || self.scenario.is_some(),
            "--route affinity needs a --scenario (it routes by tenant)"
        );
        ensure!(
            self.more_urls.is_empty() || self.connect_proxy.is_none(),
            "--connect-proxy takes one --url"
        );
        if let Some(d) = self.duration {
            ensure!(!d.is_zero(), "--duration must be greater than zero");
            ensure!(
                d <= MAX_DURATION,
                "--duration {} is above the safety cap of {}",
                humantime::format_duration(d),
                humantime::format_duration(MAX_DURATION)
            );
        }
        if let Some(n) = self.requests {
            ensure!(n > 0, "--requests must be greater than zero");
            ensure!(
                n <= MAX_REQUESTS,
                "--requests {n} is above the safety cap of {MAX_REQUESTS}"
            );
        }
        ensure!(
            self.warmup <= MAX_DURATION,
            "--warmup is above the safety cap"
        );
        ensure!(
            !self.timeout.is_zero(),
            "--timeout must be greater than zero"
        );
        match self.load {
            LoadModel::Closed { concurrency } => {
                ensure!(concurrency > 0, "--concurrency must be greater than zero");
                ensure!(
                    concurrency <= MAX_CONNECTIONS,
                    "--concurrency {concurrency} is above the cap of {MAX_CONNECTIONS}"
                );
            }
            LoadModel::Open {
                rate,
                max_outstanding,
            } => {
                ensure!(
                    rate.is_finite() && rate > 0.0,
                    "--rate must be a number greater than zero"
                );
                ensure!(
                    rate <= MAX_RATE,
                    "--rate {rate} is above the cap of {MAX_RATE}"
                );
                ensure!(
                    max_outstanding > 0 && max_outstanding <= MAX_CONNECTIONS,
                    "--max-outstanding must be between 1 and {MAX_CONNECTIONS}"
                );
            }
        }
        ensure!(!self.workloads.is_empty(), "no workload");
        ensure!(
            self.workloads.iter().any(|w| w.weight > 0),
            "every workload has weight 0"
        );
        for w in &self.workloads {
            if w.kind == WorkloadKind::Embeddings && w.stream {
                bail!("embeddings cannot be streamed (drop --stream or stream: true)");
            }
        }
        Ok(())
    }
}
