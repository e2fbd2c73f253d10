//! `faden server`'s management part: opens the store, bootstraps the admin key, serves the API,
//! runs the heartbeat monitor, and drains on shutdown.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::service::TowerToHyperService;
use net::config::ListenerConfig;
use net::listener::ServeOptions;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::api::{self, ApiConfig, AppState, LoadHub};
use crate::store::{Role, Store, StoreError};
use control_client::engine_load::EngineLoads;
use control_client::model::Scope;
use control_client::tokens;
use net::admission::{AuthLimiter, AuthLimits, PendingLimits};

/// Name of the file holding the bootstrap admin key inside the data directory.
pub const ADMIN_KEY_FILE: &str = "admin.key";
/// Name of the database file inside the data directory.
pub const DB_FILE: &str = "faden.db";

/// Settings of the management server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Directory for the generated keys, and for the SQLite database without `database_url`.
    pub data_dir: PathBuf,
    /// A PostgreSQL database shared with other servers (`postgres://…`); `None`: SQLite in
    /// `data_dir`.
    pub database_url: Option<String>,
    /// The proxy port address this server records as the owner of the tunnels that end on it
    /// (a worker's `proxy_address`); on a shared database only these are cleared at start.
    pub proxy_address: Option<String>,
    /// Address to bind the API on (`0.0.0.0:30080` by default; port 0 picks one).
    pub api_addr: SocketAddr,
    /// Use this admin key instead of the generated one (`FADEN_ADMIN_KEY`).
    pub admin_key: Option<String>,
    pub api: ApiConfig,
    /// Events kept for watch resumes.
    pub history: u64,
    /// How long in-flight requests may run after shutdown starts.
    pub shutdown_grace: Duration,
    pub limits: ListenerLimits,
    /// Serve the API (and the tunnel's `/connect`) over TLS with these settings; `None`: plain
    /// HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl ServerConfig {
    /// A server keeping its state in `data_dir` (SQLite) and serving its API on `api_addr`, with
    /// the defaults of `faden server` otherwise.
    pub fn new(data_dir: impl Into<PathBuf>, api_addr: SocketAddr) -> Self {
        Self {
            data_dir: data_dir.into(),
            database_url: None,
            proxy_address: None,
            api_addr,
            admin_key: None,
            api: ApiConfig::default(),
            history: crate::store::DEFAULT_HISTORY,
            shutdown_grace: Duration::from_secs(30),
            limits: ListenerLimits::default(),
            tls: None,
        }
    }
}

/// Limits applied to every accepted connection.
#[derive(Clone, Copy, Debug)]
pub struct ListenerLimits {
    pub max_connections: usize,
    /// Time a client has to send the whole request head, counted from the accept (and the
    /// keep-alive idle time between requests).
    pub header_read_timeout: Duration,
    /// Largest request head (bytes).
    pub max_header_bytes: usize,
    /// Connections that have not completed their first request head, in total and per source.
    pub pending: PendingLimits,
    /// Failed authentications per source (API keys, worker and registration tokens, and the
    /// tunnel's `/connect`, which shares this port's table).
    pub auth: AuthLimits,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 64 * 1024,
            pending: PendingLimits::default(),
            auth: AuthLimits::default(),
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("API key in {origin}: {reason}")]
    AdminKey { origin: String, reason: String },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A running management server.
#[derive(Debug)]
pub struct Server {
    /// The bound API address.
    pub api_addr: SocketAddr,
    /// The bootstrap admin key.
    pub admin_key: String,
    /// Where the admin key was written (absent when it came from the configuration).
    pub admin_key_path: Option<PathBuf>,
    pub store: Store,
    /// The engines' load as this server's workers report it: what its gateway routes by.
    pub engine_loads: Arc<EngineLoads>,
    tasks: Vec<JoinHandle<()>>,
}

impl Server {
    /// Opens the store, bootstraps the admin key and starts serving until `shutdown` fires.
    pub async fn start(
        config: ServerConfig,
        shutdown: CancellationToken,
    ) -> Result<Self, ServerError> {
        Self::start_with_routes(config, Router::new(), shutdown).await
    }

    /// Like [`Server::start`], serving `extra` routes (the tunnel's `/connect`) on the API port.
    /// Tunnels are never up before this starts, so stale `proxy_address` values are cleared.
    pub async fn start_with_routes(
        config: ServerConfig,
        extra: Router,
        shutdown: CancellationToken,
    ) -> Result<Self, ServerError> {
        create_private_dir(&config.data_dir)?;
        let store = match &config.database_url {
            Some(url) => Store::connect(url, config.history).await?,
            None => {
                Store::open_with_history(&config.data_dir.join(DB_FILE), config.history).await?
            }
        };
        let (admin_key, admin_key_path) =
            bootstrap_admin_key(&store, &config.data_dir, config.admin_key.as_deref()).await?;
        let listener =
            TcpListener::bind(config.api_addr)
                .await
                .map_err(|source| ServerError::Bind {
                    addr: config.api_addr,
                    source,
                })?;
        let api_addr = listener.local_addr().map_err(|source| ServerError::Bind {
            addr: config.api_addr,
            source,
        })?;
        let mut api_config = config.api.clone();
        if api_config.server_url.is_empty() {
            api_config.server_url = default_server_url(api_addr, config.tls.is_some());
        }
        let auth_limiter = Arc::new(AuthLimiter::new(config.limits.auth));
        let engine_loads = EngineLoads::new();
        let (loads, load_writer) = LoadHub::start(engine_loads.clone(), shutdown.clone());
        let state = AppState {
            loads,
            store: store.clone(),
            config: Arc::new(api_config),
            shutdown: shutdown.clone(),
            auth_limiter: auth_limiter.clone(),
        };
        let monitor = api::spawn_heartbeat_monitor(
            store.clone(),
            config.api.heartbeat_timeout,
            store.elect(Role::HeartbeatMonitor, shutdown.clone()),
            shutdown.clone(),
        );
        // No tunnel is up on this server yet. Other servers' tunnels are theirs to clear.
        let stale = if store.is_shared() {
            config.proxy_address.as_deref().map(Some)
        } else {
            Some(None)
        };
        if let Some(owner) = stale {
            api::clear_proxy_addresses(&store, owner).await?;
        }
        let router = api::router(state).merge(extra);
        // Ends at `shutdown` once drained; `Server` keeps the handle and awaits it.
        let serve = net::task::spawn(
            serve(
                listener,
                router,
                shutdown,
                config.shutdown_grace,
                config.limits,
                auth_limiter,
                config.tls.clone().map(tokio_rustls::TlsAcceptor::from),
            )
            .instrument(tracing::info_span!("api", addr = %api_addr)),
        );
        tracing::info!(
            addr = %api_addr,
            tls = config.tls.is_some(),
            data_dir = %config.data_dir.display(),
            database = if store.is_shared() { "postgres" } else { "sqlite" },
            "management API listening"
        );
        Ok(Self {
            api_addr,
            admin_key,
            admin_key_path,
            store,
            engine_loads,
            tasks: vec![serve, monitor, load_writer],
        })
    }

    /// Waits until every task has ended (after shutdown).
    pub async fn wait(self) {
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// `http(s)://<addr>` with a usable host when listening on the unspecified address.
fn default_server_url(addr: SocketAddr, tls: bool) -> String {
    let ip = match addr.ip() {
        ip if ip.is_unspecified() => std::net::IpAddr::from([127, 0, 0, 1]),
        ip => ip,
    };
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{}", SocketAddr::new(ip, addr.port()))
}

fn create_private_dir(dir: &Path) -> Result<(), ServerError> {
    let err = |source| ServerError::DataDir {
        path: dir.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(err)?;
    }
    Ok(())
}

/// Finds or creates the admin key: the configured one, else the one in `DIR/admin.key`, else a
/// new one written there with mode 0600.
async fn bootstrap_admin_key(
    store: &Store,
    dir: &Path,
    configured: Option<&str>,
) -> Result<(String, Option<PathBuf>), ServerError> {
    if let Some(key) = configured {
        let key = key.trim().to_owned();
        api::ensure_key(store, &key, "admin", Scope::All)
            .await
            .map_err(|e| ServerError::AdminKey {
                origin: "FADEN_ADMIN_KEY".to_owned(),
                reason: e.to_string(),
            })?;
        return Ok((key, None));
    }
    let (key, path) = load_or_create_key(store, dir, ADMIN_KEY_FILE, "admin", Scope::All).await?;
    tracing::info!(path = %path.display(), "admin API key: use it as `Authorization: Bearer <key>`");
    Ok((key, Some(path)))
}

/// Reads the API key kept in `dir/file`, or creates one there (mode 0600), and makes sure the
/// store knows it with `scope` (re-adding it if the database was replaced).
pub async fn load_or_create_key(
    store: &Store,
    dir: &Path,
    file: &str,
    name: &str,
    scope: Scope,
) -> Result<(String, PathBuf), ServerError> {
    let path = dir.join(file);
    let key = match std::fs::read_to_string(&path) {
        Ok(text) => text.trim().to_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = tokens::generate(tokens::API_KEY_PREFIX).value;
            write_secret_file(&path, &key).map_err(|source| ServerError::DataDir {
                path: path.clone(),
                source,
            })?;
            key
        }
        Err(source) => return Err(ServerError::DataDir { path, source }),
    };
    api::ensure_key(store, &key, name, scope)
        .await
        .map_err(|e| ServerError::AdminKey {
            origin: path.display().to_string(),
            reason: e.to_string(),
        })?;
    Ok((key, path))
}

fn write_secret_file(path: &Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    file.write_all(contents.as_bytes())?;
    file.write_all(b"\n")?;
    file.sync_all()
}

/// Serves `router` on `listener` until `shutdown`, then lets open requests finish for `grace`,
/// on `net`'s listener (the accept loop, admission and drain every faden port shares), with
/// upgrades for the tunnel's `/connect`.
///
/// Every request carries the peer address (`ConnectInfo<SocketAddr>`) and the port's
/// [`AuthLimiter`] (`Arc<AuthLimiter>`) as extensions, so routes merged in (the tunnel's
/// `/connect`) count failed authentications in the same table. A connection must complete its
/// TLS handshake (with `tls`) and its first request head within `header_read_timeout` of the
/// accept, and at most `limits.pending` connections may be that far behind (see
/// [`net::admission`]).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
    grace: Duration,
    limits: ListenerLimits,
    auth_limiter: Arc<AuthLimiter>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let config = ListenerConfig {
        header_read_timeout: limits.header_read_timeout,
        max_header_bytes: limits.max_header_bytes,
        max_connections: limits.max_connections,
        drain_timeout: grace,
        pending: limits.pending,
        auth: limits.auth,
        // Watch streams idle for long stretches; a stalled reader is the watcher's problem.
        write_stall_timeout: None,
    };
    let options = ServeOptions {
        tls,
        upgrades: true,
        ..ServeOptions::default()
    };
    let handler = move |mut req: http::Request<hyper::body::Incoming>, peer: SocketAddr| {
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(peer));
        req.extensions_mut().insert(auth_limiter.clone());
        let service = TowerToHyperService::new(router.clone());
        async move {
            match hyper::service::Service::call(&service, req).await {
                Ok(resp) => resp,
                Err(never) => match never {},
            }
        }
    };
    net::listener::serve_with(listener, &config, options, handler, shutdown, || {}).await;
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::disallowed_methods
    )]

    use axum::extract::Request;
    use axum::response::{IntoResponse, Response};
    use axum::routing::get;
    use bytes::Bytes;
    use http_body_util::{BodyExt as _, Empty};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpStream;

    use super::*;

    const T: Duration = Duration::from_secs(10);

    /// Takes the connection over and answers `taken` when it came out of `Upgraded` as the
    /// socket itself (what the tunnel's `/connect` relies on), `wrapd` when it did not.
    async fn take_over(mut req: Request) -> Response {
        let on_upgrade = req
            .extensions_mut()
            .remove::<hyper::upgrade::OnUpgrade>()
            .unwrap();
        tokio::spawn(async move {
            let upgraded = on_upgrade.await.unwrap();
            match net::relay::take_socket(upgraded) {
                Ok((mut socket, _)) => socket.write_all(b"taken").await.unwrap(),
                Err(upgraded) => {
                    let mut io = hyper_util::rt::TokioIo::new(upgraded);
                    io.write_all(b"wrapd").await.unwrap();
                }
            }
        });
        (
            http::StatusCode::SWITCHING_PROTOCOLS,
            [("connection", "upgrade"), ("upgrade", "test")],
        )
            .into_response()
    }

    /// HTTP/1 connections are served by hyper's HTTP/1 builder (an upgraded one comes back as
    /// the socket), HTTP/2 with prior knowledge still works, and at shutdown an idle HTTP/1
    /// keep-alive connection is closed and the server returns.
    #[tokio::test]
    async fn http1_upgrades_give_the_socket_back_and_h2c_still_works() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new()
            .route("/up", get(take_over))
            .route("/hello", get(|| async { "hello" }));
        let shutdown = CancellationToken::new();
        let limits = ListenerLimits::default();
        let auth = Arc::new(AuthLimiter::new(limits.auth));
        let served = tokio::spawn(serve(
            listener,
            router,
            shutdown.clone(),
            T,
            limits,
            auth,
            None,
        ));

        let mut tcp = TcpStream::connect(addr).await.unwrap();
        tcp.write_all(
            b"GET /up HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: test\r\n\r\n",
        )
        .await
        .unwrap();
        let head = testkit::raw::read_head(&mut tcp).await;
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        let mut answer = [0u8; 5];
        tokio::time::timeout(T, tcp.read_exact(&mut answer))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&answer, b"taken");

        let h2 = TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(h2))
                .await
                .unwrap();
        tokio::spawn(conn);
        let req = http::Request::get(format!("http://{addr}/hello"))
            .body(Empty::<Bytes>::new())
            .unwrap();
        let resp = tokio::time::timeout(T, sender.send_request(req))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(resp.version(), http::Version::HTTP_2);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"hello");
        drop(sender);

        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut first = [0u8; 256];
        let n = tokio::time::timeout(T, idle.read(&mut first))
            .await
            .unwrap()
            .unwrap();
        assert!(first[..n].ends_with(b"hello"));
        shutdown.cancel();
        let rest = testkit::raw::until_closed(&mut idle).await;
        assert_eq!(
            rest.as_deref(),
            Some(""),
            "idle connection not closed at shutdown"
        );
        tokio::time::timeout(T, served).await.unwrap().unwrap();
    }
}
