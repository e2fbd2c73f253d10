//! Test harness: snapshots from control types, a gateway on 127.0.0.1:0, raw HTTP clients.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use control_client::model::{
    Credential, InstanceState, Model, ModelInstance, ProxyMode, Scope, Timestamp, Worker,
    WorkerState,
};
use control_client::routing::RoutingSnapshot;
use control_client::tokens::{self, NewKey};
use gateway::{Gateway, GatewayConfig};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const MODEL: &str = "mock-model";
pub const T: Duration = Duration::from_secs(10);

/// One routable instance of [`MODEL`].
#[derive(Clone, Debug)]
pub struct Inst {
    pub id: i64,
    pub port: u16,
    pub mode: ProxyMode,
    pub worker_port: u16,
}

impl Inst {
    pub fn direct(id: i64, port: u16) -> Self {
        Self {
            id,
            port,
            mode: ProxyMode::Direct,
            worker_port: 1,
        }
    }
    pub fn worker(id: i64, port: u16, worker_port: u16) -> Self {
        Self {
            id,
            port,
            mode: ProxyMode::Worker,
            worker_port,
        }
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn credential(
    id: i64,
    key: &NewKey,
    scope: Scope,
    expires_at: Option<Timestamp>,
) -> Credential {
    Credential {
        id,
        access_id: key.access_id.clone(),
        secret_digest: hex(&key.digest),
        scope,
        expires_at,
    }
}

pub fn snapshot(instances: &[Inst], credentials: &[Credential]) -> RoutingSnapshot {
    let workers: Vec<Worker> = instances
        .iter()
        .map(|i| Worker {
            id: i.id,
            name: format!("w{}", i.id),
            labels: Default::default(),
            cluster_id: 1,
            hostname: "localhost".into(),
            ip: "127.0.0.1".into(),
            ifname: None,
            advertise_address: None,
            port: i.worker_port,
            metrics_port: control_client::model::MetricsPort::Port(10151),
            worker_uuid: String::new(),
            state: WorkerState::Ready,
            state_message: None,
            heartbeat_time: None,
            proxy_mode: i.mode,
            proxy_address: (i.mode == ProxyMode::Tunnel).then(|| "127.0.0.1:9".to_owned()),
            maintenance: None,
            created_at: None,
            updated_at: None,
        })
        .collect();
    let insts: Vec<ModelInstance> = instances
        .iter()
        .map(|i| ModelInstance {
            id: i.id,
            name: format!("{MODEL}-{}", i.id),
            model_id: 1,
            model_name: Some(MODEL.into()),
            worker_id: Some(i.id),
            port: Some(i.port),
            state: InstanceState::Running,
            state_message: None,
            cluster_id: Some(1),
            created_at: None,
            updated_at: None,
        })
        .collect();
    let models = [Model {
        id: 1,
        name: MODEL.into(),
        cluster_id: Some(1),
        description: None,
        replicas: None,
        ready_replicas: None,
        route_policy: None,
        created_at: None,
        updated_at: None,
    }];
    RoutingSnapshot::build(&workers, &insts, &models, credentials, Some(1))
}

/// A gateway serving on an ephemeral port, with one valid inference key.
pub struct Harness {
    pub addr: SocketAddr,
    pub gateway: Gateway,
    pub shutdown: CancellationToken,
    pub task: Option<JoinHandle<()>>,
    pub snapshots: watch::Sender<Arc<RoutingSnapshot>>,
    pub key: NewKey,
    pub cred: Credential,
}

impl Harness {
    pub async fn start(config: GatewayConfig, instances: &[Inst]) -> Self {
        let key = tokens::generate(tokens::API_KEY_PREFIX);
        let cred = credential(1, &key, Scope::Inference, None);
        let snap = snapshot(instances, std::slice::from_ref(&cred));
        Self::start_with(config, snap, key, cred).await
    }

    pub async fn start_with(
        config: GatewayConfig,
        snap: RoutingSnapshot,
        key: NewKey,
        cred: Credential,
    ) -> Self {
        let (tx, rx) = watch::channel(Arc::new(snap));
        let gateway = Gateway::new(config, rx).unwrap();
        Self::serve(gateway, tx, key, cred).await
    }

    /// Serves `gateway` (built on `snapshots`' channel) on an ephemeral port.
    pub async fn serve(
        gateway: Gateway,
        snapshots: watch::Sender<Arc<RoutingSnapshot>>,
        key: NewKey,
        cred: Credential,
    ) -> Self {
        let tx = snapshots;
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let g = gateway.clone();
        let s = shutdown.clone();
        let task = tokio::spawn(async move { g.serve(listener, s).await });
        Self {
            addr,
            gateway,
            shutdown,
            task: Some(task),
            snapshots: tx,
            key,
            cred,
        }
    }

    pub fn publish(&self, instances: &[Inst], credentials: &[Credential]) {
        self.snapshots
            .send_replace(Arc::new(snapshot(instances, credentials)));
    }

    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.key.value)
    }

    /// A POST with the valid key.
    pub fn post(&self, path: &str, body: impl Into<Bytes>) -> Request<Full<Bytes>> {
        Request::post(format!("http://{}{path}", self.addr))
            .header("authorization", self.bearer())
            .header("content-type", "application/json")
            .body(Full::new(body.into()))
            .unwrap()
    }

    pub fn chat(&self, stream: bool) -> Request<Full<Bytes>> {
        self.post(
            "/v1/chat/completions",
            format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"stream":{stream}}}"#),
        )
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(t) = self.task.take() {
            tokio::time::timeout(T, t).await.unwrap().unwrap();
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Sends one request on a fresh HTTP/1.1 connection.
pub async fn send(addr: SocketAddr, req: Request<Full<Bytes>>) -> Response<Incoming> {
    tokio::time::timeout(T, async {
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    })
    .await
    .unwrap()
}

/// Sends one request on a fresh HTTP/2 prior-knowledge connection.
pub async fn send_h2(addr: SocketAddr, req: Request<Full<Bytes>>) -> Response<Incoming> {
    tokio::time::timeout(T, async {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    })
    .await
    .unwrap()
}

pub async fn body_bytes(resp: Response<Incoming>) -> Bytes {
    tokio::time::timeout(T, resp.into_body().collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes()
}

pub async fn json(resp: Response<Incoming>) -> serde_json::Value {
    serde_json::from_slice(&body_bytes(resp).await).unwrap()
}

/// Asserts an OpenAI-shaped error with the given status and code.
pub async fn assert_error(resp: Response<Incoming>, status: u16, code: &str) {
    assert_eq!(resp.status(), status);
    let v = json(resp).await;
    assert_eq!(v["error"]["code"], code, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
}

/// A port on which nothing listens.
pub async fn dead_port() -> u16 {
    let l = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    l.local_addr().unwrap().port()
}

/// Writes raw bytes and reads until the server closes (or `T`).
pub async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(T, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}
