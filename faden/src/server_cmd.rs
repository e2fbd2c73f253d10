//! `faden server`: the management API and the gateway beside it.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use control::api::ApiConfig;
use control::api::auth::{Principal, resolve};
use control::api::set_proxy_address;
use control::server::{ListenerLimits, Server, ServerConfig, load_or_create_key};
use control::store::{Kind, Store};
use control_client::model::{ProxyMode, Scope, Worker};
use control_client::sync::{self, SyncConfig, SyncHandle};
use tokio_util::sync::CancellationToken;
use tunnel::{
    ProxyPort, ProxyPortConfig, TunnelServer, TunnelServerConfig, WorkerAddress, WorkerIdentity,
};

use crate::gateway_cmd::{GatewayArgs, GatewayExtras, RunningGateway, start_gateway};

/// File (in the data directory) with the data-plane key of the server's own gateway.
const GATEWAY_KEY_FILE: &str = "gateway.key";

/// Options of `faden server`.
#[derive(Debug, Args, Clone)]
pub struct ServerArgs {
    /// Directory for the database and the generated keys (created with mode 0700).
    #[arg(long, env = "FADEN_DATA_DIR", default_value = "faden-data")]
    pub data_dir: PathBuf,
    /// Keep the state in this PostgreSQL database instead of SQLite in the data directory, so
    /// that several servers share it (`postgres://user:password@host:5432/db`; libpq's URL
    /// syntax, with `sslmode=disable|prefer|require`). Every server needs its own reachable
    /// --proxy-host for the tunnels that end on it: see docs/operations.md.
    #[arg(long, env = "FADEN_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Address to listen on (API and gateway).
    #[arg(long, env = "FADEN_HOST", default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// Port of the management API (GPUStack's `api_port`). 0 picks a free port.
    #[arg(long, env = "FADEN_API_PORT", default_value_t = 30080)]
    pub api_port: u16,
    #[command(flatten)]
    pub gateway: GatewayArgs,
    /// Port of the tunnel proxy that relays to tunnel-mode workers (for gateways in other
    /// processes). 0 picks a free port.
    #[arg(long, env = "FADEN_PROXY_PORT", default_value_t = tunnel::proxy_port::DEFAULT_PROXY_PORT)]
    pub proxy_port: u16,
    /// Address the tunnel proxy listens on: 127.0.0.1 while only this server's own gateway uses
    /// it; 0.0.0.0 (or an interface) for standalone gateways elsewhere.
    #[arg(long, env = "FADEN_PROXY_HOST", default_value = "127.0.0.1")]
    pub proxy_host: IpAddr,
    /// Admin API key to use instead of the generated `DATA_DIR/admin.key`
    /// (form `fdn_<16 hex>_<32 hex>`).
    #[arg(long, env = "FADEN_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// URL workers use to reach this server [default: http://HOST:API_PORT, with
    /// HOST 127.0.0.1 when listening on 0.0.0.0].
    #[arg(long, env = "FADEN_SERVER_URL")]
    pub server_url: Option<String>,
    /// Image of the workers that the join commands and manifests start,
    /// `[registry/]repository:tag`; a cluster's default container registry replaces the
    /// registry (`GET /v2/clusters/{id}/join`, `.../manifests`).
    #[arg(long, env = "FADEN_WORKER_IMAGE", default_value = control::join::DEFAULT_WORKER_IMAGE, value_parser = parse_worker_image)]
    pub worker_image: String,
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
    /// Streams open at once on one worker's tunnel, at most (each proxied request or pooled
    /// connection to the worker is one stream).
    #[arg(long, env = "FADEN_TUNNEL_MAX_STREAMS", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub tunnel_max_streams: u32,
    /// Time a client of the management API (and `/connect`) has to send its first request
    /// head, from the accept; also the keep-alive idle time.
    #[arg(long, env = "FADEN_API_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub api_header_read_timeout: Duration,
    /// Serve the management API port (registration, heartbeats, watches and the tunnel's
    /// `/connect`) over TLS with this certificate chain (PEM); needs --api-tls-key. Workers then
    /// use `--server-url https://...` (and `--server-ca` unless the platform roots trust it).
    #[arg(long, env = "FADEN_API_TLS_CERT", requires = "api_tls_key")]
    pub api_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --api-tls-cert.
    #[arg(long, env = "FADEN_API_TLS_KEY", requires = "api_tls_cert")]
    pub api_tls_key: Option<PathBuf>,
}

fn parse_worker_image(text: &str) -> Result<String, String> {
    control::join::ImageRef::parse(text).map(|_| text.trim().to_owned())
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
        if self.api_header_read_timeout.is_zero() {
            problems.push("--api-header-read-timeout must be more than 0".to_owned());
        }
        if let Some(url) = &self.server_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            problems.push(format!(
                "--server-url {url:?} must start with http:// or https://"
            ));
        }
        let tls = match (&self.api_tls_cert, &self.api_tls_key) {
            (Some(cert), Some(key)) => Some(
                net::tls::server_config(&net::config::ServerTlsConfig {
                    cert_chain: cert.clone(),
                    private_key: key.clone(),
                    client_ca: None,
                })
                .context("--api-tls-cert/--api-tls-key")?,
            ),
            _ => None,
        };
        let ports = [
            ("--api-port", self.api_port),
            ("--port", self.gateway.port),
            ("--proxy-port", self.proxy_port),
        ];
        for (i, (a, pa)) in ports.iter().enumerate() {
            for (b, pb) in &ports[i + 1..] {
                if *pa != 0 && pa == pb {
                    problems.push(format!("{a} and {b} are both {pa}"));
                }
            }
        }
        if let Some(url) = &self.database_url
            && !(url.starts_with("postgres://") || url.starts_with("postgresql://"))
        {
            // Not echoed: it may carry a password.
            problems.push("--database-url must start with postgres:// or postgresql://".to_owned());
        }
        if !problems.is_empty() {
            anyhow::bail!("invalid configuration:\n  {}", problems.join("\n  "));
        }
        Ok(ServerConfig {
            data_dir: self.data_dir.clone(),
            database_url: self.database_url.clone(),
            proxy_address: None,
            api_addr: SocketAddr::new(self.host, self.api_port),
            admin_key: self.admin_key.clone(),
            api: ApiConfig {
                heartbeat_timeout: self.worker_heartbeat_timeout,
                watch_heartbeat: self.watch_heartbeat,
                server_url: self.server_url.clone().unwrap_or_default(),
                worker_image: self.worker_image.clone(),
            },
            history: self.event_history,
            shutdown_grace: self.drain_timeout,
            limits: ListenerLimits {
                max_connections: self.max_connections,
                header_read_timeout: self.api_header_read_timeout,
                pending: self.gateway.limits.pending(),
                auth: self.gateway.limits.auth(),
                ..ListenerLimits::default()
            },
            tls,
        })
    }

    /// TLS settings of the server's own clients of its API (the gateway's sync client, the
    /// embedded worker of `faden up`): they trust exactly the API's certificate.
    fn local_api_tls(&self) -> anyhow::Result<Option<Arc<rustls::ClientConfig>>> {
        self.api_tls_cert
            .as_deref()
            .map(control_client::tls::pinned_client_config_for)
            .transpose()
            .context("--api-tls-cert")
    }
}

/// A running server: API, its own sync client and gateway.
pub struct Started {
    pub server: Server,
    pub gateway: RunningGateway,
    pub sync: SyncHandle,
    pub tunnels: TunnelServer,
    pub proxy_addr: SocketAddr,
    /// TLS settings for clients of the API on loopback (`Some` when the API port is TLS).
    pub local_api_tls: Option<Arc<rustls::ClientConfig>>,
    proxy_task: tokio::task::JoinHandle<()>,
    /// Ends the API (after the gateway drained).
    api_shutdown: CancellationToken,
    /// Drains the gateway.
    gateway_shutdown: CancellationToken,
    sync_cancel: CancellationToken,
    /// The longest wait for the tunnels to move at [`Started::stop`].
    move_within: Duration,
}

impl Started {
    /// The API URL on loopback (what in-process clients use, with [`Started::local_api_tls`]).
    pub fn local_api_url(&self) -> String {
        local_api_url(self.server.api_addr, self.local_api_tls.is_some())
    }

    /// Moves the tunnels away (several servers on one database), drains the gateway, then
    /// stops the API.
    pub async fn stop(self) {
        let move_within = self.move_within;
        if self.server.store.is_shared() && !self.tunnels.connected().is_empty() {
            // The proxy port and the gateway serve on meanwhile: requests for a moving worker
            // still reach it here until the gateways route to its new tunnel.
            self.tunnels.ask_to_move();
            let started = std::time::Instant::now();
            match tokio::time::timeout(move_within, self.tunnels.moved()).await {
                Ok(()) => {
                    tracing::info!(took = ?started.elapsed(), "every tunnel moved to another server")
                }
                Err(_) => tracing::warn!(
                    left = self.tunnels.connected().len(),
                    "tunnels not moved within {move_within:?} (a worker that lists no other \
                     server, or GPUStack's): closing them"
                ),
            }
        }
        self.gateway_shutdown.cancel();
        let _ = self.gateway.task.await;
        let _ = self.proxy_task.await;
        self.tunnels.shutdown().await;
        self.sync_cancel.cancel();
        self.api_shutdown.cancel();
        self.server.wait().await;
    }
}

fn local_api_url(addr: SocketAddr, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{}", loopback(addr))
}

/// `addr` with a loopback IP when it is the unspecified address.
pub fn loopback(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new(IpAddr::from([127, 0, 0, 1]), addr.port())
    } else {
        addr
    }
}

/// Starts the API (with the tunnel's `/connect`), then the gateway fed by a sync client of the
/// API itself (the same path a standalone gateway takes, over loopback), then the proxy port.
pub async fn start(args: &ServerArgs) -> anyhow::Result<Started> {
    let mut config = args.to_config()?;
    let local_api_tls = args.local_api_tls()?;
    let gateway_config = args.gateway.to_config(args.drain_timeout)?;
    // A socket of the proxy port per serving core.
    let proxy_listeners = net::cores::bind_reuseport(
        SocketAddr::new(args.proxy_host, args.proxy_port),
        crate::runtime::cores().len(),
    )
    .with_context(|| {
        format!(
            "proxy port: cannot listen on {}:{}",
            args.proxy_host, args.proxy_port
        )
    })?;
    let proxy_addr = proxy_listeners
        .first()
        .context("no proxy port socket")?
        .local_addr()?;

    // The tunnel registry needs the store, which the server opens: hand it over once open.
    let store_cell: Arc<OnceLock<Store>> = Arc::default();
    let proxy_url = advertised_proxy_url(args, proxy_addr);
    config.proxy_address = Some(proxy_url.clone());
    let tunnels = tunnel_server(
        store_cell.clone(),
        proxy_url.clone(),
        args.tunnel_max_streams as usize,
    );
    let api_shutdown = CancellationToken::new();
    let server = Server::start_with_routes(config, connect_route(&tunnels), api_shutdown.clone())
        .await
        .context("starting the server")?;
    let _ = store_cell.set(server.store.clone());
    tunnels.set_ready();

    let (gateway_key, _) = load_or_create_key(
        &server.store,
        &args.data_dir,
        GATEWAY_KEY_FILE,
        "faden gateway (built in)",
        Scope::DataPlane,
    )
    .await?;
    let sync_cancel = CancellationToken::new();
    let api_url = local_api_url(server.api_addr, local_api_tls.is_some());
    let mut sync_config = SyncConfig::new(&api_url, gateway_key.clone());
    sync_config.tls = local_api_tls.clone();
    let sync = sync::spawn(sync_config.clone(), sync_cancel.clone())?;
    let gateway_shutdown = CancellationToken::new();
    let extras = GatewayExtras {
        // The server's own table, written by its workers' report streams: no loopback hop.
        engine_loads: Some(server.engine_loads.clone()),
        worker_credentials: cluster_credentials(args, &server, &sync_config, &sync, &sync_cancel)?,
        telemetry: args.gateway.telemetry()?,
        ..GatewayExtras::default()
    };
    // Tunnels that end on another server (same database) are reached through its proxy port.
    // Each core pools its own streams and connections.
    let owners = gateway::ProxyPortUpstream::new(&gateway_key, &gateway_config)
        .context("the gateway key is not a valid header value")?;
    let tunnel_upstream: gateway::TunnelFactory = {
        let (tunnels, config, proxy_url) =
            (tunnels.clone(), gateway_config.clone(), proxy_url.clone());
        Arc::new(move || {
            Arc::new(
                gateway::TunnelUpstream::new(tunnels.clone())
                    .with_owners(owners.with_own_pool(&config), &proxy_url),
            ) as Arc<dyn gateway::Upstream>
        })
    };
    let gateway = start_gateway(
        gateway_config,
        SocketAddr::new(args.host, args.gateway.port),
        sync.clone(),
        tunnel_upstream,
        extras,
        gateway_shutdown.clone(),
    )
    .await?;
    let proxy = ProxyPort::new(tunnels.clone(), proxy_port_config(args, &sync)?);
    let proxy_task = {
        let shutdown = gateway_shutdown.clone();
        // Ends at `shutdown`, once every core drained; awaited at shutdown.
        crate::runtime::serve_on_cores(proxy_listeners, move |listener| {
            let (proxy, shutdown) = (proxy.clone(), shutdown.clone());
            async move { proxy.serve(listener, shutdown).await }
        })
    };
    Ok(Started {
        server,
        gateway,
        sync,
        tunnels,
        proxy_addr,
        local_api_tls,
        proxy_task,
        api_shutdown,
        gateway_shutdown,
        sync_cancel,
        move_within: args.drain_timeout.min(MOVE_WITHIN),
    })
}

/// Without `--worker-credential`, `worker`-mode workers are sent their cluster's registration
/// token: GPUStack's worker proxy accepts it (or the worker's own token, which the server keeps
/// only as a digest), and so does faden's. Read through the API with the admin key.
fn cluster_credentials(
    args: &ServerArgs,
    server: &Server,
    sync_config: &SyncConfig,
    sync: &SyncHandle,
    cancel: &CancellationToken,
) -> anyhow::Result<Option<gateway::WorkerCredentials>> {
    if args.gateway.worker_credential.is_some() {
        return Ok(None);
    }
    let mut config = sync_config.clone();
    config.token = server.admin_key.clone();
    let tokens = control_client::cluster_tokens::spawn(
        &config,
        sync.clone(),
        Arc::new(|| control_client::cluster_tokens::ClusterSecret::RegistrationToken),
        cancel.clone(),
    )
    .context("cluster registration tokens")?;
    Ok(Some(Arc::new(
        move |endpoint: &control_client::routing::Endpoint| {
            (endpoint.proxy_mode == ProxyMode::Worker)
                .then(|| tokens.authorization(endpoint.cluster_id))
                .flatten()
        },
    )))
}

/// The tunnel registry: worker tokens checked against the store, each worker's address looked
/// up when its tunnel comes up, and its `proxy_address` set while the tunnel is up.
fn tunnel_server(
    store: Arc<OnceLock<Store>>,
    proxy_url: String,
    max_streams: usize,
) -> TunnelServer {
    let (auth_store, lookup_store, change_store) = (store.clone(), store.clone(), store);
    let mut config = TunnelServerConfig::default();
    config.mux.max_streams = max_streams;
    // Failed `/connect` authentications count in the API port's table (the server passes it in
    // every request), shared with the management API.
    TunnelServer::builder(config, move |token: String| {
        let store = auth_store.get().cloned();
        async move {
            let store = store?;
            match store
                .read(async move |sql| resolve(sql, &token).await)
                .await
            {
                Ok(Some(Principal::Worker {
                    worker_id,
                    cluster_id,
                })) => Some(WorkerIdentity {
                    worker_id,
                    cluster_id,
                }),
                _ => None,
            }
        }
    })
    .address_lookup(move |worker_id| {
        let store = lookup_store.get().cloned();
        async move {
            let store = store?;
            let worker = store
                .read(async move |sql| {
                    control::store::get::<Worker>(sql, Kind::Workers, worker_id).await
                })
                .await
                .ok()
                .flatten()?;
            Some(WorkerAddress::new(worker.address(), worker.port))
        }
    })
    .on_change(move |worker_id, up| {
        let store = change_store.get().cloned();
        let (owner, up) = (proxy_url.clone(), up.is_some());
        async move {
            let Some(store) = store else { return };
            if let Err(e) = set_proxy_address(&store, worker_id, owner, up).await {
                tracing::warn!(worker_id, error = %e, "cannot record the tunnel state");
            }
            tracing::info!(worker_id, up, "worker tunnel");
        }
    })
    // `/connect` is served before the store is handed over: until then, 503.
    .starting()
    .build()
}

/// `GET /connect` of `tunnels`, merged into the management API's router (which serves upgrades
/// and puts the source address in each request, for the per-source handshake limit).
fn connect_route(tunnels: &TunnelServer) -> axum::Router {
    let tunnels = tunnels.clone();
    axum::Router::new().route(
        tunnel::protocol::CONNECT_PATH,
        axum::routing::get(move |req: http::Request<axum::body::Body>| {
            let tunnels = tunnels.clone();
            async move {
                let peer = req
                    .extensions()
                    .get::<axum::extract::ConnectInfo<SocketAddr>>()
                    .map(|c| c.0);
                tunnels.handle_connect(req, peer).await
            }
        }),
    )
}

/// `http://<server host>:<proxy port>`: what remote gateways dial for tunnel workers.
fn advertised_proxy_url(args: &ServerArgs, proxy: SocketAddr) -> String {
    let host = args
        .server_url
        .as_deref()
        .and_then(|u| u.split("://").nth(1))
        .and_then(|rest| rest.split('/').next())
        .and_then(|authority| {
            authority
                .rsplit_once(':')
                .map_or(Some(authority), |(h, _)| Some(h))
        })
        .map(str::to_owned)
        .unwrap_or_else(|| loopback(SocketAddr::new(args.host, 0)).ip().to_string());
    let host = if proxy.ip().is_loopback() {
        "127.0.0.1".to_owned()
    } else {
        host
    };
    format!("http://{host}:{}", proxy.port())
}

/// The proxy port accepts data-plane (or admin) keys and relays to tunnel workers with the
/// worker credential, if one is configured.
fn proxy_port_config(args: &ServerArgs, sync: &SyncHandle) -> anyhow::Result<ProxyPortConfig> {
    let (keys, instances) = (sync.clone(), sync.clone());
    let authorize = Arc::new(move |key: &str| {
        keys.current()
            .verify_key_lazily(key, chrono::Utc::now)
            .is_ok_and(|scope| scope == Scope::DataPlane || scope.is_admin())
    });
    let instance_worker = Arc::new(move |instance_id: i64| {
        instances.current().models.values().find_map(|route| {
            route
                .endpoints
                .iter()
                .find(|e| e.instance_id == instance_id)
                .map(|e| (e.worker_id, e.instance_port))
        })
    });
    let ports = sync.clone();
    let instance_on_port = Arc::new(move |worker_id: i64, port: u16| {
        ports.current().models.values().any(|route| {
            route
                .endpoints
                .iter()
                .any(|e| e.worker_id == worker_id && e.instance_port == port)
        })
    });
    let mut config = ProxyPortConfig::new(authorize, instance_worker);
    config.instance_on_port = instance_on_port;
    config.listener.drain_timeout = args.drain_timeout;
    config.listener.header_read_timeout = args.gateway.header_read_timeout;
    config.listener.write_stall_timeout = Some(args.gateway.client_write_timeout);
    config.listener.pending = args.gateway.limits.pending();
    config.listener.auth = args.gateway.limits.auth();
    if let Some(credential) = &args.gateway.worker_credential {
        let mut value = http::HeaderValue::from_str(&format!("Bearer {credential}"))
            .context("--worker-credential is not a valid header value")?;
        value.set_sensitive(true);
        config.worker_authorization = Some(value);
    }
    Ok(config)
}

/// The longest a stopping server waits for its tunnels to move to the other servers.
const MOVE_WITHIN: Duration = Duration::from_secs(10);

pub async fn run(args: ServerArgs) -> anyhow::Result<()> {
    let started = start(&args).await?;
    // Tests and scripts read the bound addresses from this line.
    tracing::info!(
        api = %started.server.api_addr,
        gateway = %started.gateway.addr,
        proxy = %started.proxy_addr,
        "faden server ready"
    );
    crate::shutdown::shutdown_signal().await;
    tracing::info!(drain = ?args.drain_timeout, "shutting down: draining the gateway");
    started.stop().await;
    Ok(())
}
