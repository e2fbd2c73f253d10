//! `faden worker`: registers with a server, heartbeats, reports its local instances with their
//! health, and serves them through the worker reverse proxy on the worker port.
//!
//! Configuration precedence (highest first): flags (and their `FADEN_*` variables) > the local
//! `--config-file` > the cluster's `worker_config` received at registration > built-in defaults.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use control::worker_config::{self, WorkerConfig};
use control_client::client::ApiClient;
use control_client::model::{MetricsPort, ProxyMode};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tunnel::{TunnelClient, TunnelClientConfig};
use worker::agent::{Agent, LocalInstance, Registration};
use worker::proxy::{LocalInstances, WorkerProxy, WorkerProxyConfig};

/// Options of `faden worker`.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// The server's management API, e.g. http://server:30080 or https://server:30080 (then
    /// registration and API calls use HTTPS and the tunnel `wss://`). Several servers sharing
    /// one database: a comma-separated list, tried in turn (registration, heartbeats and the
    /// tunnel move to the next one when a server cannot be reached). One URL behind a load
    /// balancer works too.
    #[arg(long = "server-url", env = "FADEN_SERVER_URL", value_name = "URL", required = true, value_delimiter = ',', value_parser = crate::server_tls::parse_server_url)]
    pub server_urls: Vec<String>,
    /// CA bundle (PEM) that the servers' certificates must chain to, for https --server-url
    /// URLs [default: the platform's root certificates].
    #[arg(long, env = "FADEN_SERVER_CA")]
    pub server_ca: Option<PathBuf>,
    /// The cluster registration token (`GET /v2/clusters/{id}/registration-token`).
    #[arg(long, env = "FADEN_TOKEN", hide_env_values = true)]
    pub token: String,
    /// Worker configuration YAML (the documented options; unknown keys are errors).
    #[arg(long, env = "FADEN_CONFIG_FILE")]
    pub config_file: Option<PathBuf>,
    /// How the data plane reaches this worker: direct, worker or tunnel [default: worker].
    #[arg(long, env = "FADEN_PROXY_MODE", value_parser = parse_proxy_mode)]
    pub proxy_mode: Option<ProxyMode>,
    /// Port of the worker reverse proxy [default: 10150]. 0 picks a free port.
    #[arg(long, env = "FADEN_WORKER_PORT")]
    pub worker_port: Option<u16>,
    /// Port of the metrics endpoint [default: 10151]. 0 picks a free port.
    #[arg(long, env = "FADEN_WORKER_METRICS_PORT")]
    pub worker_metrics_port: Option<u16>,
    /// Turn the metrics endpoint off.
    #[arg(long, env = "FADEN_DISABLE_WORKER_METRICS")]
    pub disable_worker_metrics: bool,
    /// Tunnel mode: streams open at once on the tunnel, at most (match the server's
    /// `--tunnel-max-streams`).
    #[arg(long, env = "FADEN_TUNNEL_MAX_STREAMS", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub tunnel_max_streams: u32,
    /// IP the worker reports [default: the local address used to reach the server].
    #[arg(long, env = "FADEN_WORKER_IP")]
    pub worker_ip: Option<IpAddr>,
    /// Address the data plane dials instead of the IP (host name or IP).
    #[arg(long, env = "FADEN_ADVERTISE_ADDRESS")]
    pub advertise_address: Option<String>,
    /// Worker name, unique in its cluster [default: the host name].
    #[arg(long, env = "FADEN_WORKER_NAME")]
    pub name: Option<String>,
    /// A local inference server to serve, as MODEL=PORT (on 127.0.0.1); repeatable.
    #[arg(long = "instance", env = "FADEN_INSTANCES", value_delimiter = ',', value_parser = parse_instance)]
    pub instances: Vec<LocalInstance>,
    /// Directory for the worker token (kept with mode 0600 and reused after a restart).
    #[arg(long, env = "FADEN_DATA_DIR", default_value = "faden-worker-data")]
    pub data_dir: PathBuf,
    /// Extra credential the worker proxy accepts (the gateways' `--worker-credential`).
    #[arg(long, env = "FADEN_WORKER_CREDENTIAL", hide_env_values = true)]
    pub worker_credential: Option<String>,
    /// Interval between heartbeats.
    #[arg(long, env = "FADEN_HEARTBEAT_INTERVAL", default_value = "30s", value_parser = humantime::parse_duration)]
    pub heartbeat_interval: Duration,
    /// Interval between health probes of the local instances.
    #[arg(long, env = "FADEN_PROBE_INTERVAL", default_value = "5s", value_parser = humantime::parse_duration)]
    pub probe_interval: Duration,
    /// How often the local engines' own metrics (`GET /metrics` on each instance's port: vLLM's
    /// or SGLang's queue, running requests and KV-cache use) are read and sent to every
    /// server, whose gateways route by them; 0 turns it off. An engine without such a page is
    /// served all the same and read every 10 s only.
    #[arg(long, env = "FADEN_ENGINE_METRICS_INTERVAL", default_value = "100ms", value_parser = humantime::parse_duration)]
    pub engine_metrics_interval: Duration,
    /// On SIGTERM: how long in-flight requests may take to finish. The worker first drains
    /// itself through its server (gateways send its models' new requests to other workers
    /// that run them), closes its tunnel with a go-away, and exits when nothing is in flight
    /// or at this limit; a second signal stops it at once.
    #[arg(long, env = "FADEN_GRACE", default_value = "30s", value_parser = humantime::parse_duration)]
    pub grace: Duration,
    /// Time a client of the worker port (and the metrics port) has to send its first request
    /// head, from the accept; also the keep-alive idle time.
    #[arg(long, env = "FADEN_HEADER_READ_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub header_read_timeout: Duration,
    #[command(flatten)]
    pub limits: crate::limits::LimitArgs,
}

fn parse_proxy_mode(text: &str) -> Result<ProxyMode, String> {
    ProxyMode::parse(text).ok_or_else(|| format!("{text:?}: expected direct, worker or tunnel"))
}

fn parse_instance(text: &str) -> Result<LocalInstance, String> {
    let (model, port) = text
        .rsplit_once('=')
        .ok_or_else(|| format!("{text:?}: expected MODEL=PORT"))?;
    let port: u16 = port
        .trim()
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{text:?}: the port must be 1-65535"))?;
    if model.trim().is_empty() {
        return Err(format!("{text:?}: the model name is empty"));
    }
    Ok(LocalInstance {
        model: model.trim().to_owned(),
        port,
    })
}

impl WorkerArgs {
    /// The flags as a configuration layer.
    fn flag_layer(&self) -> WorkerConfig {
        WorkerConfig {
            proxy_mode: self.proxy_mode,
            worker_port: self.worker_port,
            worker_metrics_port: self.worker_metrics_port,
            disable_worker_metrics: self.disable_worker_metrics.then_some(true),
            ..WorkerConfig::default()
        }
    }
}

/// Built-in defaults of a standalone worker (`worker` proxy mode; the server's embedded worker
/// uses `direct`).
fn defaults() -> WorkerConfig {
    WorkerConfig {
        proxy_mode: Some(ProxyMode::Worker),
        worker_port: Some(control_client::model::DEFAULT_WORKER_PORT),
        worker_metrics_port: Some(control_client::model::DEFAULT_WORKER_METRICS_PORT),
        disable_worker_metrics: Some(false),
        ..WorkerConfig::default()
    }
}

fn read_config_file(path: &Path) -> anyhow::Result<WorkerConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the worker configuration {}", path.display()))?;
    worker_config::parse_yaml(&text).map_err(|e| {
        let lines: Vec<String> = e
            .issues
            .iter()
            .map(|i| match (i.line, i.column) {
                (Some(l), Some(c)) => {
                    format!("{}:{l}:{c}: {}: {}", path.display(), i.key, i.message)
                }
                _ => format!("{}: {}: {}", path.display(), i.key, i.message),
            })
            .collect();
        anyhow::anyhow!("invalid worker configuration:\n  {}", lines.join("\n  "))
    })
}

/// The local IP that routes to the server (no packet is sent).
fn detect_ip(server_url: &str) -> Option<IpAddr> {
    let uri: http::Uri = server_url.trim().parse().ok()?;
    let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
        Some("https") => 443,
        _ => 80,
    });
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .ok()?
        .next()?;
    let socket = std::net::UdpSocket::bind(if addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    })
    .ok()?;
    socket.connect(addr).ok()?;
    Some(socket.local_addr().ok()?.ip())
}

fn host_name() -> String {
    std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "worker".to_owned())
}

#[derive(PartialEq, Eq)]
struct Effective {
    proxy_mode: ProxyMode,
    worker_port: u16,
    metrics_port: u16,
    metrics: bool,
}

fn effective(config: &WorkerConfig) -> Effective {
    Effective {
        proxy_mode: config.proxy_mode.unwrap_or(ProxyMode::Worker),
        worker_port: config
            .worker_port
            .unwrap_or(control_client::model::DEFAULT_WORKER_PORT),
        metrics_port: config
            .worker_metrics_port
            .unwrap_or(control_client::model::DEFAULT_WORKER_METRICS_PORT),
        metrics: !config.disable_worker_metrics.unwrap_or(false),
    }
}

pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    if args.heartbeat_interval < Duration::from_millis(100)
        || args.probe_interval < Duration::from_millis(100)
    {
        anyhow::bail!("--heartbeat-interval and --probe-interval must be at least 100ms");
    }
    let mut problems = args.limits.problems();
    let interval = args.engine_metrics_interval;
    if !interval.is_zero() && interval < Duration::from_millis(10) {
        problems.push("--engine-metrics-interval must be 0 (off) or at least 10ms".to_owned());
    }
    if args.header_read_timeout.is_zero() {
        problems.push("--header-read-timeout must be more than 0".to_owned());
    }
    if !problems.is_empty() {
        anyhow::bail!("invalid configuration:\n  {}", problems.join("\n  "));
    }
    let listener = gateway::ListenerConfig {
        header_read_timeout: args.header_read_timeout,
        drain_timeout: args.grace,
        pending: args.limits.pending(),
        auth: args.limits.auth(),
        ..gateway::ListenerConfig::default()
    };
    let file = match &args.config_file {
        Some(path) => read_config_file(path)?,
        None => WorkerConfig::default(),
    };
    let local = file.overlay(&args.flag_layer());
    let tls = crate::server_tls::server_tls(&args.server_urls, args.server_ca.as_deref())?;
    let api = ApiClient::with_urls(&args.server_urls, tls.clone())?;
    let detected = || args.server_urls.iter().find_map(|url| detect_ip(url));
    let ip = match args.worker_ip.or_else(detected) {
        Some(ip) => ip,
        None => anyhow::bail!("cannot tell this worker's IP; pass --worker-ip"),
    };
    let name = args.name.clone().unwrap_or_else(host_name);

    // Register with what we know locally, then apply the cluster's configuration under it
    // (once: flags and the local file still win).
    let mut config = defaults().overlay(&local);
    let (agent, listeners) = loop {
        let eff = effective(&config);
        let listeners = Listeners::bind(&eff).await?;
        let registration = Registration {
            name: name.clone(),
            hostname: host_name(),
            ip: ip.to_string(),
            advertise_address: args.advertise_address.clone(),
            port: listeners.worker_port(&eff),
            metrics_port: listeners.metrics_port(&eff),
            proxy_mode: eff.proxy_mode,
            labels: Default::default(),
        };
        let agent = register(&api, &args.token, &registration, &args.data_dir).await?;
        let cluster = match agent.worker_config() {
            serde_json::Value::Null => WorkerConfig::default(),
            v => worker_config::from_json(v).context("the cluster's worker_config")?,
        };
        let wanted = defaults().overlay(&cluster).overlay(&local);
        if effective(&wanted) == eff {
            break (agent, listeners);
        }
        tracing::info!("applying the cluster's worker configuration");
        config = wanted;
    };
    let eff = effective(&config);

    let shutdown = CancellationToken::new();
    if let Err(e) = agent.end_own_drain().await {
        tracing::warn!(error = %e, "cannot end the drain of the last stop");
    }
    // Before anything is served: a restarted worker's proxy must know the instances the server
    // still routes to it from its first request.
    agent.prune(&args.instances).await?;
    let instances = LocalInstances::new();
    instances.replace(agent.instances());
    // The worker token, the registration token, the cluster's worker proxy credential (what
    // gateways read with a data-plane key), and the operator's own.
    let mut credentials = vec![
        agent.token().to_owned(),
        args.token.clone(),
        control_client::tokens::worker_proxy_credential(&args.token),
    ];
    credentials.extend(args.worker_credential.clone());
    let proxy = WorkerProxy::new(
        WorkerProxyConfig {
            credentials,
            // Tunnel streams come only from the server this worker authenticated with.
            require_credential: eff.proxy_mode != ProxyMode::Tunnel,
            listener: listener.clone(),
            relay_take_over: Some(tunnel::http::take_stream),
            ..WorkerProxyConfig::default()
        },
        instances.clone(),
    );
    let mut tasks = tokio::task::JoinSet::new();
    if !args.engine_metrics_interval.is_zero() {
        worker::engine_load::start(
            &mut tasks,
            agent.instance_updates(),
            api.urls(),
            agent.token(),
            tls.clone(),
            args.engine_metrics_interval,
            &shutdown,
        );
    }
    // Fires when the tunnel's serving ended (tunnel mode).
    let tunnel_done = CancellationToken::new();
    let mut leaving = None;
    let mut tunnel_status = None;
    let serving = match listeners.worker {
        Some(listeners) => {
            let addr = listeners
                .first()
                .context("no worker port socket")?
                .local_addr()?
                .to_string();
            let (proxy, shutdown) = (proxy.clone(), shutdown.clone());
            // Ends once every core's proxy drained at `shutdown`.
            let serving = crate::runtime::serve_on_cores(listeners, move |listener| {
                let (proxy, shutdown) = (proxy.clone(), shutdown.clone());
                async move { proxy.serve(listener, shutdown).await }
            });
            tasks.spawn(async move {
                let _ = serving.await;
            });
            addr
        }
        None => {
            // The first dial goes to the server that answered the registration.
            let mut urls = api.urls().to_vec();
            if let Some(at) = urls.iter().position(|url| url == api.base()) {
                urls.rotate_left(at);
            }
            let mut config = TunnelClientConfig::with_urls(urls, agent.token());
            config.mux.max_streams = args.tunnel_max_streams as usize;
            config.tls = tls;
            let client = TunnelClient::new(config).context("tunnel settings")?;
            tunnel_status = Some(client.status());
            let url = client.url().to_string();
            leaving = Some(client.leaving());
            let done = tunnel_done.clone().drop_guard();
            let serve = worker::tunnel::serve(client, proxy.clone(), shutdown.clone());
            tasks.spawn(async move {
                serve.await;
                drop(done);
            });
            format!("tunnel {url}")
        }
    };
    let mut updates = agent.instance_updates();
    {
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            loop {
                instances.replace(updates.borrow_and_update().clone());
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    changed = updates.changed() => if changed.is_err() { return },
                }
            }
        });
    }
    let metrics = match listeners.metrics {
        Some(l) => {
            let addr = l.local_addr()?.to_string();
            tasks.spawn(worker::metrics::serve(
                l,
                agent.worker().id,
                listener.clone(),
                shutdown.clone(),
            ));
            addr
        }
        None => "off".to_owned(),
    };
    let agent = Arc::new(agent);
    if let Some(mut status) = tunnel_status {
        let (agent, shutdown) = (agent.clone(), shutdown.clone());
        // Ends at `shutdown` or with the tunnel client.
        tasks.spawn(async move {
            let mut seen = status.borrow_and_update().connects;
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    changed = status.changed() => if changed.is_err() { return },
                }
                let connects = status.borrow_and_update().connects;
                // A tunnel up again (not the first one): the server may have marked this
                // worker away meanwhile.
                if connects > seen && seen > 0 {
                    agent.recheck();
                }
                seen = connects;
            }
        });
    }
    // A tunnel or worker-port worker sees every request it serves; a direct one sees none.
    let in_flight: Option<worker::agent::InFlight> = match (&leaving, eff.proxy_mode) {
        (Some(leaving), _) => {
            let (leaving, proxy) = (leaving.clone(), proxy.clone());
            Some(Arc::new(move || {
                (leaving.open_streams() + proxy.in_flight()) as u64
            }))
        }
        (None, ProxyMode::Worker) => {
            let proxy = proxy.clone();
            Some(Arc::new(move || proxy.in_flight() as u64))
        }
        (None, _) => None,
    };
    tasks.spawn(agent.clone().run(
        args.instances.clone(),
        args.heartbeat_interval,
        args.probe_interval,
        in_flight,
        shutdown.clone(),
    ));
    tracing::info!(
        worker_id = agent.worker().id,
        serving = %serving,
        metrics = %metrics,
        proxy_mode = %eff.proxy_mode,
        engine_metrics = ?args.engine_metrics_interval,
        "faden worker ready"
    );
    crate::shutdown::shutdown_signal().await;
    tracing::info!(grace = ?args.grace, "stopping: draining (a second signal stops at once)");
    let stop = Stop {
        agent: &agent,
        proxy: &proxy,
        leaving,
        tunnel_done,
        grace: args.grace,
    };
    tokio::select! {
        () = stop.drain() => {}
        () = crate::shutdown::shutdown_signal() => {
            tracing::warn!("second signal: stopping at once");
        }
    }
    shutdown.cancel();
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// How long gateways are given to see a drain before a worker that cannot count its requests
/// (the `worker` and `direct` modes) stops taking connections: a snapshot reaches the gateways
/// in milliseconds, and the worker port then finishes what is in flight within `--grace`.
const SETTLE: Duration = Duration::from_secs(2);

/// A worker's graceful stop.
struct Stop<'a> {
    agent: &'a Agent,
    proxy: &'a WorkerProxy,
    leaving: Option<tunnel::Leaving>,
    tunnel_done: CancellationToken,
    grace: Duration,
}

impl Stop<'_> {
    /// Drains through the server, then (tunnel mode) goes away and waits for the open streams
    /// and relays to end, within `grace`.
    async fn drain(self) {
        let started = tokio::time::Instant::now();
        let open = || {
            let streams = self.leaving.as_ref().map_or(0, |l| l.open_streams());
            (streams + self.proxy.in_flight()) as u64
        };
        match self.agent.drain(open()).await {
            Ok(routed) => tracing::info!(
                in_flight = open(),
                still_routed = routed,
                "draining: the server sends this worker's models to the other workers that run them"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "cannot tell the server that this worker drains; stopping anyway")
            }
        }
        let Some(leaving) = &self.leaving else {
            tokio::time::sleep(SETTLE.min(self.grace)).await;
            return;
        };
        // From here the server opens no new stream: a gateway that still picks this worker
        // retries on another instance. Pooled idle streams end with the gateways' idle timeout.
        leaving.go_away();
        let remaining = self.grace.saturating_sub(started.elapsed());
        // A count that only falls once the server opens nothing new: polled, not awaited.
        let emptied = async {
            while open() > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let ended = async {
            tokio::select! {
                () = emptied => "drained: no stream left",
                () = self.tunnel_done.cancelled() => "the tunnel ended while draining",
            }
        };
        match tokio::time::timeout(remaining, ended).await {
            Ok(what) => tracing::info!(took = ?started.elapsed(), "{what}"),
            Err(_) => tracing::warn!(
                open = open(),
                "grace period over: closing the streams still open"
            ),
        }
        if let Err(e) = self.agent.drain(open()).await {
            tracing::debug!(error = %e, "cannot report the end of the drain");
        }
    }
}

/// Registers, retrying with growing pauses and saying why. A refusal that retrying cannot
/// change (a wrong or revoked registration token, a deleted cluster) is logged once as such and
/// retried slowly, in case an operator fixes it; a signal meanwhile stops the worker.
async fn register(
    api: &ApiClient,
    token: &str,
    registration: &Registration,
    data_dir: &Path,
) -> anyhow::Result<Agent> {
    let mut unreachable = net::backoff::Backoff::new(REGISTER_RETRY_MIN, REGISTER_RETRY_MAX);
    let mut refused = net::backoff::Backoff::new(REFUSED_RETRY_MIN, REFUSED_RETRY_MAX);
    let mut said: Option<String> = None;
    loop {
        let error = match Agent::register(
            api.clone(),
            token,
            registration,
            Some(data_dir.to_owned()),
        )
        .await
        {
            Ok(agent) => {
                if said.is_some() {
                    tracing::info!("registered after retrying");
                }
                return Ok(agent);
            }
            // The token file: a local problem, not the server's.
            Err(e @ worker::agent::AgentError::TokenFile { .. }) => return Err(e.into()),
            // An untrusted server certificate is this worker's configuration (`--server-ca`):
            // said at once, as an exit.
            Err(e) if e.to_string().contains("invalid peer certificate") => {
                return Err(anyhow::Error::new(e)
                    .context("the server's certificate is not trusted (see --server-ca)"));
            }
            Err(e) => e,
        };
        let refusal = error.is_refusal();
        // Half the ceiling at least: a refusal is never retried in a tight loop.
        let delay = if refusal {
            unreachable.reset();
            refused.ceiling() / 2 + refused.next_delay() / 2
        } else {
            unreachable.next_delay()
        };
        let why = error.to_string();
        if said.as_deref() == Some(why.as_str()) {
            tracing::debug!(error = %error, retry_in = ?delay, "registration failed again");
        } else if refusal {
            tracing::error!(
                error = %error,
                retry_in = ?delay,
                "the server refused the registration token (wrong or revoked, or its cluster \
                 was deleted): retrying will not help; fix --token (retrying slowly meanwhile)"
            );
        } else {
            tracing::warn!(error = %error, retry_in = ?delay, "cannot register; retrying");
        }
        said = Some(why);
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = crate::shutdown::shutdown_signal() => anyhow::bail!("stopped before registering: {error}"),
        }
    }
}

/// Pauses between registration attempts while the server cannot be reached or fails.
const REGISTER_RETRY_MIN: Duration = Duration::from_millis(100);
const REGISTER_RETRY_MAX: Duration = Duration::from_secs(10);
/// Pauses between registration attempts the server refused.
const REFUSED_RETRY_MIN: Duration = Duration::from_secs(1);
const REFUSED_RETRY_MAX: Duration = Duration::from_secs(300);

/// The worker's listening sockets. A tunnel worker opens none for serving: everything arrives
/// through the tunnel it dials.
struct Listeners {
    /// A socket of the worker port per serving core ([`crate::runtime`]).
    worker: Option<Vec<std::net::TcpListener>>,
    metrics: Option<TcpListener>,
}

impl Listeners {
    async fn bind(eff: &Effective) -> anyhow::Result<Self> {
        let worker = if eff.proxy_mode == ProxyMode::Tunnel {
            None
        } else {
            let addr = SocketAddr::from(([0, 0, 0, 0], eff.worker_port));
            Some(
                net::cores::bind_reuseport(addr, crate::runtime::cores().len())
                    .with_context(|| format!("worker port: cannot listen on {addr}"))?,
            )
        };
        let metrics = if eff.metrics {
            Some(bind(eff.metrics_port, "metrics port").await?)
        } else {
            None
        };
        Ok(Self { worker, metrics })
    }

    /// The port to register: the bound one (port 0 picks one), else the configured one.
    fn worker_port(&self, eff: &Effective) -> u16 {
        let bound = self
            .worker
            .as_ref()
            .and_then(|l| l.first())
            .and_then(|l| l.local_addr().ok())
            .map(|a| a.port());
        bound.unwrap_or(match eff.worker_port {
            0 => control_client::model::DEFAULT_WORKER_PORT,
            p => p,
        })
    }

    fn metrics_port(&self, eff: &Effective) -> MetricsPort {
        if !eff.metrics {
            return MetricsPort::Disabled;
        }
        MetricsPort::Port(
            bound_port(self.metrics.as_ref()).unwrap_or(match eff.metrics_port {
                0 => control_client::model::DEFAULT_WORKER_METRICS_PORT,
                p => p,
            }),
        )
    }
}

fn bound_port(listener: Option<&TcpListener>) -> Option<u16> {
    listener.and_then(|l| l.local_addr().ok()).map(|a| a.port())
}

async fn bind(port: u16, what: &str) -> anyhow::Result<TcpListener> {
    let addr = SocketAddr::from(([0, 0, 0, 0], port));
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("{what}: cannot listen on {addr}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use clap::Parser as _;

    use super::*;

    /// The flags of `faden worker` alone.
    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: WorkerArgs,
    }

    fn parse(urls: &str) -> Result<WorkerArgs, clap::Error> {
        Cli::try_parse_from(["faden-worker", "--server-url", urls, "--token", "t"]).map(|c| c.args)
    }

    #[test]
    fn server_urls_are_a_checked_list() {
        let args = parse("http://a:30080, http://b:30080").unwrap();
        assert_eq!(args.server_urls, ["http://a:30080", "http://b:30080"]);
        assert_eq!(args.engine_metrics_interval, Duration::from_millis(100));
        // The bad entry is named; a trailing comma leaves an empty one.
        for (urls, named) in [
            ("http://ok:1,a:30080", "a:30080"),
            ("http://ok:1,ws://a:1", "ws://a:1"),
            ("http://ok:1,", ""),
        ] {
            let error = parse(urls).unwrap_err().to_string();
            assert!(
                error.contains(&format!("invalid value '{named}' for '--server-url <URL>'")),
                "{error}"
            );
        }
        assert!(Cli::try_parse_from(["faden-worker", "--token", "t"]).is_err());
    }
}
