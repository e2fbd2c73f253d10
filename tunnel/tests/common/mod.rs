//! Test harness: a tunnel server (axum) on 127.0.0.1:0, a worker (tunnel client) serving a
//! stream handler (a small byte-level test handler here; a real worker proxy in front of a mock
//! engine from `worker/tests/behind_tunnel`), a proxy port, and a TCP relay that can stall.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod connect;
pub use connect::connect_router;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::HeaderValue;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tunnel::ws_io::Liveness;
use tunnel::{
    ProxyPort, ProxyPortConfig, TunnelClient, TunnelClientConfig, TunnelServer, TunnelServerConfig,
    TunnelStatus, TunnelUp, WorkerAddress, WorkerIdentity,
};

pub use testkit::raw::read_answer;

pub const T: Duration = Duration::from_secs(10);
/// A response-head deadline for `Upstream::send` that only a hung test reaches.
pub fn due() -> tokio::time::Instant {
    tokio::time::Instant::now() + T
}

/// The credential the worker proxy accepts.
pub const WORKER_CRED: &str = "worker-cred";
/// The instance the worker hosts, and its model.
pub const INSTANCE: i64 = 7;
pub const MODEL_ID: i64 = 1;
pub const WORKER: i64 = 1;
/// The address worker 1 registers (never dialled: the proxy port only matches it).
pub const WORKER_HOST: &str = "127.0.0.2";
pub const WORKER_PORT: u16 = 10150;

/// What a test token stands for.
#[derive(Clone, Copy, Debug)]
pub enum TokenState {
    Valid(WorkerIdentity),
    Expired(WorkerIdentity),
    Revoked(WorkerIdentity),
    /// Valid, but the check takes this long.
    Slow(WorkerIdentity, Duration),
}

pub type Tokens = Arc<Mutex<HashMap<String, TokenState>>>;

pub fn tokens_with(worker_tokens: &[(&str, i64)]) -> Tokens {
    Arc::new(Mutex::new(
        worker_tokens
            .iter()
            .map(|(t, w)| {
                (
                    (*t).to_owned(),
                    TokenState::Valid(WorkerIdentity {
                        worker_id: *w,
                        cluster_id: 1,
                    }),
                )
            })
            .collect(),
    ))
}

pub fn fast_liveness() -> Liveness {
    Liveness {
        ping_interval: Duration::from_millis(200),
        dead_after: Duration::from_millis(700),
    }
}

/// A tunnel server on an ephemeral (or given) port.
pub struct ServerHarness {
    pub addr: SocketAddr,
    pub server: TunnelServer,
    pub events: mpsc::UnboundedReceiver<(i64, Option<TunnelUp>)>,
    /// Token checks begun so far (the server holds a pending-handshake slot during each).
    auth_calls: watch::Receiver<u64>,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl ServerHarness {
    pub async fn start(tokens: Tokens, config: TunnelServerConfig) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::start_on(listener, tokens, config).await
    }

    pub async fn start_on(
        listener: TcpListener,
        tokens: Tokens,
        config: TunnelServerConfig,
    ) -> Self {
        let addr = listener.local_addr().unwrap();
        let (tx, events) = mpsc::unbounded_channel();
        let (auth_tx, auth_calls) = watch::channel(0u64);
        let server = TunnelServer::builder(config, move |token: String| {
            auth_tx.send_modify(|n| *n += 1);
            let state = tokens.lock().get(&token).copied();
            async move {
                match state {
                    Some(TokenState::Valid(id)) => Some(id),
                    Some(TokenState::Slow(id, delay)) => {
                        tokio::time::sleep(delay).await;
                        Some(id)
                    }
                    _ => None,
                }
            }
        })
        .address_lookup(|worker| async move {
            (worker == WORKER).then(|| WorkerAddress::new(WORKER_HOST, WORKER_PORT))
        })
        .on_change(move |worker, up| {
            let _ = tx.send((worker, up));
            async {}
        })
        .build();
        let router = connect_router(&server);
        let stop = CancellationToken::new();
        let s = stop.clone();
        let task = tokio::spawn(async move {
            axum::serve(
                listener,
                router.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(async move { s.cancelled().await })
            .await
            .unwrap();
        });
        Self {
            addr,
            server,
            events,
            auth_calls,
            stop,
            task: Some(task),
        }
    }

    /// Token checks begun so far.
    pub fn auth_calls(&self) -> u64 {
        *self.auth_calls.borrow()
    }

    /// Waits until `n` token checks have begun.
    pub async fn wait_auth_calls(&self, n: u64) {
        let mut rx = self.auth_calls.clone();
        tokio::time::timeout(T, rx.wait_for(|c| *c >= n))
            .await
            .expect("token checks did not begin in time")
            .unwrap();
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting and closes every tunnel.
    pub async fn stop(mut self) {
        self.stop.cancel();
        tokio::time::timeout(T, self.server.shutdown())
            .await
            .unwrap();
        if let Some(t) = self.task.take() {
            tokio::time::timeout(T, t).await.unwrap().unwrap();
        }
    }

    /// The next up/down change.
    pub async fn next_event(&mut self) -> (i64, Option<TunnelUp>) {
        tokio::time::timeout(T, self.events.recv())
            .await
            .expect("no tunnel event in time")
            .unwrap()
    }
}

/// A running worker-side tunnel client.
pub struct Worker {
    pub status: tokio::sync::watch::Receiver<TunnelStatus>,
    pub stop: CancellationToken,
    pub task: Option<JoinHandle<()>>,
}

impl Worker {
    pub fn client_config(url: &str, token: &str) -> TunnelClientConfig {
        let mut c = TunnelClientConfig::new(url, token);
        c.backoff_min = Duration::from_millis(50);
        c.backoff_max = Duration::from_millis(500);
        c.stable_after = Duration::from_millis(300);
        c
    }

    pub fn start<H: tunnel::http::StreamHandler>(config: TunnelClientConfig, handler: H) -> Self {
        let client = TunnelClient::new(config).unwrap();
        let status = client.status();
        let stop = CancellationToken::new();
        let s = stop.clone();
        let task = tokio::spawn(async move { client.run(s, handler).await });
        Self {
            status,
            stop,
            task: Some(task),
        }
    }

    /// Waits until at least `n` tunnels have been established and one is up.
    pub async fn connected(&mut self, n: u64) {
        tokio::time::timeout(T, self.status.wait_for(|s| s.connected && s.connects >= n))
            .await
            .expect("tunnel not up in time")
            .unwrap();
    }

    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            tokio::time::timeout(T, t).await.unwrap().unwrap();
        }
    }
}

/// The key the test proxy port accepts.
pub const KEY: &str = "dp-key";

/// A tunnel server, worker 1 connected with `handler`, and a proxy port in front (key [`KEY`],
/// worker credential [`WORKER_CRED`]; instance 7 is on worker 1, instance 8 on worker 2 which
/// has no tunnel, instance 10 on worker 1 too (which does not host it), others unknown).
pub struct ProxySetup {
    pub srv: ServerHarness,
    pub worker: Worker,
    pub proxy: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl ProxySetup {
    pub async fn start(handler: impl tunnel::http::StreamHandler) -> Self {
        Self::start_with(handler, |_| {}).await
    }

    pub async fn start_with(
        handler: impl tunnel::http::StreamHandler,
        tweak: impl FnOnce(&mut ProxyPortConfig),
    ) -> Self {
        let srv = ServerHarness::start(tokens_with(&[("tok-1", WORKER)]), Default::default()).await;
        let mut worker = Worker::start(Worker::client_config(&srv.url(), "tok-1"), handler);
        worker.connected(1).await;
        let mut config = ProxyPortConfig::new(
            Arc::new(|key: &str| key == KEY),
            Arc::new(|instance| match instance {
                7 | 10 => Some((WORKER, 40000)),
                8 => Some((2, 40000)),
                _ => None,
            }),
        );
        config.worker_authorization =
            Some(HeaderValue::from_str(&format!("Bearer {WORKER_CRED}")).unwrap());
        config.listener.drain_timeout = Duration::from_secs(1);
        tweak(&mut config);
        let proxy = ProxyPort::new(srv.server.clone(), config);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let s = stop.clone();
        let task = tokio::spawn(async move { proxy.serve(listener, s).await });
        Self {
            srv,
            worker,
            proxy: addr,
            stop,
            task,
        }
    }

    pub async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(T, self.task).await.unwrap().unwrap();
        self.worker.stop().await;
        self.srv.stop().await;
    }
}

/// Sends raw bytes, reads until the peer closes or a whole answer (head and a
/// `Content-Length` body) came; returns the status and the whole answer.
pub async fn raw(addr: SocketAddr, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let text = read_answer(&mut s).await;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    (status, text)
}

/// A byte-level test handler: the first byte chooses `e` (echo until EOF, then close) or `s`
/// followed by a big-endian u64 `n` (send `n` bytes, then close).
pub async fn test_handler(mut stream: tunnel::TunnelStream) {
    let mut cmd = [0u8; 1];
    if stream.read_exact(&mut cmd).await.is_err() {
        return;
    }
    match cmd[0] {
        b'e' => {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if stream.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                }
            }
            let _ = stream.shutdown().await;
        }
        b's' => {
            let mut len = [0u8; 8];
            if stream.read_exact(&mut len).await.is_err() {
                return;
            }
            let mut left = u64::from_be_bytes(len);
            let chunk = vec![0x5au8; 64 * 1024];
            while left > 0 {
                let n = left.min(chunk.len() as u64) as usize;
                if stream.write_all(&chunk[..n]).await.is_err() {
                    return;
                }
                left -= n as u64;
            }
            let _ = stream.shutdown().await;
        }
        _ => {}
    }
}

/// A TCP relay in front of `target` whose open connections can be frozen (nothing forwarded,
/// nothing closed), as a stalled middlebox would.
pub struct Relay {
    pub addr: SocketAddr,
    conns: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
    stop: CancellationToken,
}

impl Relay {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns: Arc<Mutex<Vec<Arc<AtomicBool>>>> = Arc::default();
        let stop = CancellationToken::new();
        let (c, s) = (conns.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let (client, _) = tokio::select! {
                    () = s.cancelled() => break,
                    a = listener.accept() => a.unwrap(),
                };
                let Ok(upstream) = TcpStream::connect(target).await else {
                    continue;
                };
                let frozen = Arc::new(AtomicBool::new(false));
                c.lock().push(frozen.clone());
                let (cr, cw) = client.into_split();
                let (ur, uw) = upstream.into_split();
                tokio::spawn(pump(cr, uw, frozen.clone(), s.clone()));
                tokio::spawn(pump(ur, cw, frozen, s.clone()));
            }
        });
        Self { addr, conns, stop }
    }

    /// Freezes every connection open now; later connections are forwarded normally.
    pub fn stall_existing(&self) {
        for c in self.conns.lock().iter() {
            c.store(true, Ordering::SeqCst);
        }
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
    stop: CancellationToken,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            () = stop.cancelled() => return,
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => { let _ = to.shutdown().await; return; }
                Ok(n) => n,
            },
        };
        if frozen.load(Ordering::SeqCst) {
            // Hold both sockets open, forwarding nothing, until the test ends.
            stop.cancelled().await;
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
