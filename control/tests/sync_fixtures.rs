//! `control_client::sync` against fake management APIs on `127.0.0.1` (ephemeral ports), including
//! byte-exact replays of watch streams recorded from a real GPUStack 2.3.0 server
//! (`tests/fixtures/gpustack/`, copied from `shared/gpustack-samples/`).
//!
//! The fake server speaks raw HTTP/1.1 over a `TcpListener`, so a test controls every byte,
//! every chunk boundary and when a connection closes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use control_client::model::{InstanceState, ListResponse, Model, ModelInstance, Scope, Worker};
use control_client::routing::RoutingSnapshot;
use control_client::sync::{self, SyncConfig, SyncHandle};
use control_client::tokens;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep, timeout};
use tokio_util::sync::{CancellationToken, DropGuard};

const TOKEN: &str = "fdn_0123456789abcdef_test";
/// Upper bound of every wait: generous for a loaded 2-core machine, short enough to fail fast.
const WAIT: Duration = Duration::from_secs(10);

// ----------------------------------------------------------------------------------------------
// Fixtures
// ----------------------------------------------------------------------------------------------

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gpustack")
        .join(name)
}

/// `response.body` of a recorded JSON exchange, as JSON text.
fn recorded_body(name: &str) -> String {
    let text = std::fs::read_to_string(fixture(name)).unwrap();
    let exchange: Value = serde_json::from_str(&text).unwrap();
    exchange["response"]["body"].to_string()
}

/// The items of a recorded list answer, read as faden's wire type.
fn recorded_items<T: serde::de::DeserializeOwned>(name: &str) -> Vec<T> {
    let list: ListResponse<T> = serde_json::from_str(&recorded_body(name)).unwrap();
    list.items
}

fn recorded_raw(name: &str) -> Vec<u8> {
    std::fs::read(fixture(name)).unwrap()
}

// ----------------------------------------------------------------------------------------------
// Fake management API
// ----------------------------------------------------------------------------------------------

/// A request as the fake server saw it.
#[derive(Clone, Debug)]
struct Req {
    at: Instant,
    path: String,
    query: HashMap<String, String>,
    headers: HashMap<String, String>,
}

impl Req {
    /// `workers`, `model-instances`, ...
    fn resource(&self) -> &str {
        self.path.strip_prefix("/v2/").unwrap_or(&self.path)
    }

    fn is_watch(&self) -> bool {
        self.query.get("watch").map(String::as_str) == Some("true")
    }

    fn since(&self) -> Option<u64> {
        self.query.get("since").map(|s| s.parse().unwrap())
    }
}

/// What the fake server answers.
enum Reply {
    /// A complete answer; the connection closes after it.
    Json {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: String,
    },
    /// Bytes written as they are, in small pieces (a recorded response); then the connection is
    /// held open (until the client hangs up) or closed.
    Raw { bytes: Vec<u8>, close: bool },
    /// A chunked event stream fed by the test: each message is one chunk. When the sender is
    /// dropped the stream ends cleanly (final chunk) and the connection closes.
    Stream {
        headers: Vec<(&'static str, String)>,
        events: mpsc::Receiver<Vec<u8>>,
    },
}

impl Reply {
    fn json(body: impl Into<String>) -> Self {
        Reply::Json {
            status: 200,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    fn list(items: Value) -> Self {
        Reply::json(list_body(items))
    }

    fn list_at(items: Value, revision: u64) -> Self {
        Reply::Json {
            status: 200,
            headers: vec![("x-faden-revision", revision.to_string())],
            body: list_body(items),
        }
    }

    fn status(status: u16, body: &str) -> Self {
        Reply::Json {
            status,
            headers: Vec::new(),
            body: body.to_owned(),
        }
    }

    /// A watch that sends its head and then nothing, held open.
    fn silent_watch() -> Self {
        Reply::Raw {
            bytes: stream_head(&[]).into_bytes(),
            close: false,
        }
    }
}

fn list_body(items: Value) -> String {
    let total = items.as_array().map_or(0, Vec::len);
    json!({
        "items": items,
        "pagination": {"page": -1, "perPage": 100, "total": total, "totalPage": 1},
    })
    .to_string()
}

fn stream_head(headers: &[(&'static str, String)]) -> String {
    let mut head = String::from(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n\
         transfer-encoding: chunked\r\n",
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    head
}

/// One GPUStack-framed event: JSON, then a blank line.
fn event(kind: u8, data: Value) -> Vec<u8> {
    event_at(kind, data, None)
}

fn event_at(kind: u8, data: Value, revision: Option<u64>) -> Vec<u8> {
    let mut e = json!({"type": kind, "data": data, "changed_fields": {}, "id": data["id"]});
    if let Some(revision) = revision {
        e["revision"] = json!(revision);
    }
    format!("{e}\n\n").into_bytes()
}

type Handler = Arc<dyn Fn(&Req) -> Reply + Send + Sync>;

/// A raw HTTP/1.1 server on an ephemeral port that logs every request.
struct FakeServer {
    addr: SocketAddr,
    log: Arc<Mutex<Vec<Req>>>,
    /// Connections currently held open (streams and silent watches).
    open: Arc<AtomicUsize>,
}

impl FakeServer {
    async fn start(handler: impl Fn(&Req) -> Reply + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(listener, Arc::new(handler))
    }

    fn serve(listener: TcpListener, handler: Handler) -> Self {
        let addr = listener.local_addr().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let open = Arc::new(AtomicUsize::new(0));
        let (log2, open2) = (Arc::clone(&log), Arc::clone(&open));
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (handler, log, open) = (handler.clone(), log2.clone(), open2.clone());
                tokio::spawn(connection(socket, handler, log, open));
            }
        });
        Self { addr, log, open }
    }

    fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn requests(&self) -> Vec<Req> {
        self.log.lock().clone()
    }

    fn count(&self, resource: &str, watch: bool) -> usize {
        self.log
            .lock()
            .iter()
            .filter(|r| r.resource() == resource && r.is_watch() == watch)
            .count()
    }

    fn open_connections(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }
}

async fn connection(
    mut socket: TcpStream,
    handler: Handler,
    log: Arc<Mutex<Vec<Req>>>,
    open: Arc<AtomicUsize>,
) {
    let Some(req) = read_request(&mut socket).await else {
        return;
    };
    log.lock().push(req.clone());
    match handler(&req) {
        Reply::Json {
            status,
            headers,
            body,
        } => {
            let mut head = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n",
                body.len()
            );
            for (name, value) in headers {
                head.push_str(&format!("{name}: {value}\r\n"));
            }
            head.push_str("\r\n");
            let _ = socket.write_all(head.as_bytes()).await;
            let _ = socket.write_all(body.as_bytes()).await;
            let _ = socket.shutdown().await;
        }
        Reply::Raw { bytes, close } => {
            open.fetch_add(1, Ordering::SeqCst);
            // Odd-sized pieces with pauses: the client sees events split at arbitrary points.
            for piece in bytes.chunks(97) {
                if socket.write_all(piece).await.is_err() {
                    break;
                }
                let _ = socket.flush().await;
                sleep(Duration::from_millis(1)).await;
            }
            if !close {
                hold(&mut socket).await;
            }
            open.fetch_sub(1, Ordering::SeqCst);
        }
        Reply::Stream {
            headers,
            mut events,
        } => {
            open.fetch_add(1, Ordering::SeqCst);
            if socket
                .write_all(stream_head(&headers).as_bytes())
                .await
                .is_ok()
            {
                while let Some(data) = events.recv().await {
                    let mut chunk = format!("{:x}\r\n", data.len()).into_bytes();
                    chunk.extend_from_slice(&data);
                    chunk.extend_from_slice(b"\r\n");
                    if socket.write_all(&chunk).await.is_err() {
                        break;
                    }
                }
                let _ = socket.write_all(b"0\r\n\r\n").await;
            }
            open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Keeps a connection open until the client closes it.
async fn hold(socket: &mut TcpStream) {
    let mut sink = [0u8; 256];
    while matches!(socket.read(&mut sink).await, Ok(n) if n > 0) {}
}

async fn read_request(socket: &mut TcpStream) -> Option<Req> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    let end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 || buf.len() > 64 * 1024 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let text = String::from_utf8(buf[..end].to_vec()).ok()?;
    let mut lines = text.split("\r\n");
    let target = lines.next()?.split(' ').nth(1)?.to_owned();
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let query = query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Some(Req {
        at: Instant::now(),
        path: path.to_owned(),
        query,
        headers,
    })
}

/// Watch streams opened by the client, fed by the test.
#[derive(Clone, Default)]
struct Streams {
    senders: Arc<Mutex<HashMap<String, mpsc::Sender<Vec<u8>>>>>,
}

impl Streams {
    /// Answers a watch with a stream the test can feed through [`sender`](Self::sender).
    fn open(&self, req: &Req, headers: Vec<(&'static str, String)>) -> Reply {
        let (tx, events) = mpsc::channel(64);
        self.senders.lock().insert(req.resource().to_owned(), tx);
        Reply::Stream { headers, events }
    }

    /// The sender of the latest stream of `resource`, once the client has opened it.
    async fn sender(&self, resource: &str) -> mpsc::Sender<Vec<u8>> {
        let wait = async {
            loop {
                if let Some(tx) = self
                    .senders
                    .lock()
                    .get(resource)
                    .filter(|tx| !tx.is_closed())
                {
                    return tx.clone();
                }
                sleep(Duration::from_millis(5)).await;
            }
        };
        timeout(WAIT, wait)
            .await
            .expect("the client never opened the stream")
    }

    /// Ends the current stream of `resource` (final chunk, then close) once every sender
    /// handed out by [`sender`](Self::sender) is dropped too.
    fn close(&self, resource: &str) {
        self.senders.lock().remove(resource);
    }
}

// ----------------------------------------------------------------------------------------------
// Client helpers
// ----------------------------------------------------------------------------------------------

/// Test defaults: fast backoff, a generous idle timeout.
fn config(server: &FakeServer) -> SyncConfig {
    let mut config = SyncConfig::new(server.base_url(), TOKEN);
    config.backoff_min = Duration::from_millis(20);
    config.backoff_max = Duration::from_millis(200);
    config.idle_timeout = Duration::from_secs(30);
    config.request_timeout = Duration::from_secs(2);
    config
}

/// Starts a client that is cancelled when the returned guard drops (at the end of the test).
fn start(config: SyncConfig) -> (SyncHandle, DropGuard) {
    let cancel = CancellationToken::new();
    let handle = sync::spawn(config, cancel.clone()).unwrap();
    (handle, cancel.drop_guard())
}

async fn synced(handle: &SyncHandle) {
    timeout(WAIT, handle.wait_synced())
        .await
        .expect("not synced in time");
    assert!(handle.is_synced());
}

/// Polls `check` until it holds.
async fn eventually(what: &str, check: impl FnMut() -> bool) {
    testkit::wait_until(WAIT, what, check).await;
}

/// The current snapshot if it satisfies `check`, else the first published one that does
/// (waiting through `changed()`).
async fn snapshot_where(
    rx: &mut watch::Receiver<Arc<RoutingSnapshot>>,
    check: impl Fn(&RoutingSnapshot) -> bool,
) -> Arc<RoutingSnapshot> {
    let wait = async {
        loop {
            let snapshot = rx.borrow_and_update().clone();
            if check(&snapshot) {
                return snapshot;
            }
            rx.changed().await.expect("sync stopped");
        }
    };
    timeout(WAIT, wait).await.expect("no such snapshot in time")
}

fn worker_json(id: i64, ip: &str) -> Value {
    json!({"id": id, "name": format!("worker-{id}"), "cluster_id": 1, "hostname": "h", "ip": ip,
           "port": 10150, "state": "ready", "proxy_mode": "direct", "status": {"cpu": {}}})
}

fn model_json(id: i64, name: &str) -> Value {
    json!({"id": id, "name": name, "replicas": 1, "cluster_id": 1})
}

fn instance_json(id: i64, state: &str, port: u16) -> Value {
    json!({"id": id, "name": format!("m-{id}"), "model_id": 1, "model_name": "m", "worker_id": 1,
           "port": port, "state": state, "cluster_id": 1})
}

fn instance_ids(handle: &SyncHandle) -> Vec<i64> {
    handle.objects().instances.keys().copied().collect()
}

// ----------------------------------------------------------------------------------------------
// Tests
// ----------------------------------------------------------------------------------------------

/// The recorded GPUStack lists and raw watch bytes (chunked, heartbeats, no final chunk) end in
/// exactly the state GPUStack listed after the recording; `/v2/credentials` is a 404 there.
#[tokio::test]
async fn gpustack_recordings_replay_to_the_recorded_final_state() {
    let server = FakeServer::start(|req| match (req.resource(), req.is_watch()) {
        ("workers", false) => Reply::json(recorded_body("workers-list.json")),
        ("model-instances", false) => Reply::json(recorded_body("model-instances-list.json")),
        ("models", false) => Reply::json(recorded_body("models-list.json")),
        ("workers", true) => Reply::Raw {
            bytes: recorded_raw("watch-workers.raw"),
            close: false,
        },
        ("model-instances", true) => Reply::Raw {
            bytes: recorded_raw("watch-model-instances.raw"),
            close: false,
        },
        ("models", true) => Reply::silent_watch(),
        _ => Reply::status(404, r#"{"detail":"Not Found"}"#),
    })
    .await;
    let (handle, _cancel) = start(config(&server));
    synced(&handle).await;

    let workers_after: Vec<Worker> = recorded_items("workers-list-after.json");
    let instances_after: Vec<ModelInstance> = recorded_items("model-instances-list-after.json");
    let models: Vec<Model> = recorded_items("models-list.json");
    eventually("the recorded streams to be applied", || {
        let o = handle.objects();
        o.workers.values().cloned().collect::<Vec<_>>() == workers_after
            && o.instances.values().cloned().collect::<Vec<_>>() == instances_after
    })
    .await;

    let objects = handle.objects();
    // The type-3 event deleted instance 1; instance 2 went pending → analyzing → pending.
    assert_eq!(instance_ids(&handle), [2]);
    assert_eq!(objects.instances[&2].state, InstanceState::Pending);
    // The type-2 events added a label and moved the heartbeat.
    assert_eq!(objects.workers[&1].labels["gpu-class"], "none");
    assert_eq!(objects.models.values().cloned().collect::<Vec<_>>(), models);
    assert!(objects.credentials.is_empty());
    assert_eq!(objects.revision, None);
    assert_eq!(handle.skipped_events(), 0);

    // Nothing runs in the recording, so nothing routes; the snapshot is still complete.
    let snapshot = handle.current();
    assert!(snapshot.models.values().all(|r| r.endpoints.is_empty()));
    assert!(snapshot.credentials.is_empty());
    assert!(handle.staleness().is_some());

    assert_eq!(
        handle.offers_credentials(),
        Some(false),
        "a GPUStack server"
    );
    // Credentials: asked once (the next try is 60 s away), never watched.
    assert_eq!(server.count("credentials", false), 1);
    assert_eq!(server.count("credentials", true), 0);
    // The streams stay up: one list and one watch per resource.
    for resource in ["workers", "model-instances", "models"] {
        assert_eq!(server.count(resource, false), 1, "{resource} lists");
        assert_eq!(server.count(resource, true), 1, "{resource} watches");
    }
    for req in server.requests() {
        assert_eq!(req.headers["authorization"], format!("Bearer {TOKEN}"));
        assert_eq!(req.headers["accept"], "application/json");
        if !req.is_watch() {
            assert_eq!(req.query["page"], "-1");
            assert!(
                !req.query.contains_key("perPage"),
                "GPUStack 2.3 answers perPage=-1 with 500"
            );
        }
    }
}

/// Events that complete a route publish it; a delete event withdraws it.
#[tokio::test]
async fn events_make_an_instance_routable_and_a_delete_removes_it() {
    let key = tokens::generate(tokens::API_KEY_PREFIX);
    let credential = json!({"id": 3, "access_id": key.access_id,
                            "secret_digest": hex::encode(key.digest), "scope": "inference"});
    let streams = Streams::default();
    let s = streams.clone();
    let server = FakeServer::start(move |req| match (req.resource(), req.is_watch()) {
        (_, true) => s.open(req, Vec::new()),
        ("models", false) => Reply::list(json!([model_json(1, "m")])),
        ("credentials", false) => Reply::list(json!([credential])),
        _ => Reply::list(json!([])),
    })
    .await;
    let (handle, _cancel) = start(config(&server));
    synced(&handle).await;
    assert_eq!(handle.offers_credentials(), Some(true), "a faden server");
    let mut snapshots = handle.snapshots();
    assert!(handle.current().routable("m").is_none());
    assert_eq!(
        handle.current().verify_key(&key.value, chrono::Utc::now()),
        Ok(Scope::Inference)
    );

    let workers = streams.sender("workers").await;
    let instances = streams.sender("model-instances").await;
    workers
        .send(event(1, worker_json(1, "10.1.2.3")))
        .await
        .unwrap();
    instances
        .send(event(1, instance_json(11, "starting", 40001)))
        .await
        .unwrap();
    instances
        .send(event(2, instance_json(11, "running", 40001)))
        .await
        .unwrap();

    let snapshot = snapshot_where(&mut snapshots, |s| s.routable("m").is_some()).await;
    let route = snapshot.route("m").unwrap();
    assert_eq!(route.model_id, 1);
    let [endpoint] = &route.endpoints[..] else {
        panic!("expected one endpoint: {route:?}");
    };
    assert_eq!(endpoint.instance_id, 11);
    assert_eq!(endpoint.worker_id, 1);
    assert_eq!(endpoint.address, "10.1.2.3");
    assert_eq!(endpoint.instance_port, 40001);
    assert_eq!(endpoint.worker_port, 10150);

    instances
        .send(event(3, instance_json(11, "running", 40001)))
        .await
        .unwrap();
    let snapshot = snapshot_where(&mut snapshots, |s| s.routable("m").is_none()).await;
    assert!(snapshot.models.values().all(|r| r.endpoints.is_empty()));
    assert!(handle.objects().instances.is_empty());
    assert_eq!(server.count("model-instances", false), 1, "no re-list");
}

/// The server closes the stream; the client lists again and converges to the new state.
#[tokio::test]
async fn a_closed_stream_is_followed_by_a_fresh_list() {
    let phase = Arc::new(AtomicUsize::new(0));
    let p = Arc::clone(&phase);
    let server = FakeServer::start(move |req| match (req.resource(), req.is_watch()) {
        ("workers", false) => Reply::list(json!([worker_json(1, "10.0.0.1")])),
        ("models", false) => Reply::list(json!([model_json(1, "m")])),
        ("model-instances", false) => match p.load(Ordering::SeqCst) {
            0 => Reply::list(json!([instance_json(1, "running", 40001)])),
            _ => Reply::list(json!([instance_json(2, "running", 40002)])),
        },
        ("model-instances", true) if p.fetch_add(1, Ordering::SeqCst) == 0 => {
            // One event, then the connection drops mid-stream (no final chunk).
            let mut bytes = stream_head(&[]).into_bytes();
            let e = event(2, instance_json(1, "running", 40001));
            bytes.extend_from_slice(format!("{:x}\r\n", e.len()).as_bytes());
            bytes.extend_from_slice(&e);
            bytes.extend_from_slice(b"\r\n");
            Reply::Raw { bytes, close: true }
        }
        (_, true) => Reply::silent_watch(),
        _ => Reply::status(404, "{}"),
    })
    .await;
    let started = Instant::now();
    let (handle, _cancel) = start(config(&server));
    synced(&handle).await;

    let mut snapshots = handle.snapshots();
    let snapshot = snapshot_where(&mut snapshots, |s| {
        s.route("m")
            .is_some_and(|r| r.endpoints.iter().map(|e| e.instance_id).eq([2]))
    })
    .await;
    assert_eq!(
        snapshot.route("m").unwrap().endpoints[0].instance_port,
        40002
    );
    assert_eq!(
        instance_ids(&handle),
        [2],
        "the old instance is gone with the re-list"
    );
    assert_eq!(server.count("model-instances", false), 2);
    eventually("the second watch", || {
        server.count("model-instances", true) == 2
    })
    .await;
    // One reconnect with backoff_max = 200 ms: within one wait bound from the start.
    assert!(started.elapsed() < WAIT, "{:?}", started.elapsed());
}

/// A stream that sends its head and then nothing is dropped after `idle_timeout`.
#[tokio::test]
async fn a_silent_stream_is_dropped_after_the_idle_timeout() {
    let server = FakeServer::start(|req| match (req.resource(), req.is_watch()) {
        ("credentials", false) => Reply::status(404, "{}"),
        (_, false) => Reply::list(json!([])),
        (_, true) => Reply::silent_watch(),
    })
    .await;
    let mut config = config(&server);
    config.idle_timeout = Duration::from_millis(300);
    let (handle, _cancel) = start(config);
    synced(&handle).await;

    eventually("a second workers watch", || {
        server.count("workers", true) >= 2
    })
    .await;
    let watches: Vec<Instant> = server
        .requests()
        .iter()
        .filter(|r| r.resource() == "workers" && r.is_watch())
        .map(|r| r.at)
        .collect();
    let gap = watches[1] - watches[0];
    // 300 ms of silence, then a jittered delay of at most backoff_min (first retry) + re-list.
    assert!(
        gap >= Duration::from_millis(290),
        "reconnected too early: {gap:?}"
    );
    // Not later than `eventually`'s bound: a stream without the idle timeout is never dropped.
    // Without a revision (GPUStack), every reconnect lists again.
    eventually("a second workers list", || {
        server.count("workers", false) >= 2
    })
    .await;
    let staleness = handle.staleness().unwrap();
    assert!(staleness < WAIT, "{staleness:?}");
}

/// With faden's revisions the client resumes a broken stream with `since` instead of listing;
/// when the server answers `x-faden-watch: snapshot` (history gone) it lists again.
#[tokio::test]
async fn faden_streams_resume_from_the_last_revision() {
    let streams = Streams::default();
    let s = streams.clone();
    let instance_lists = Arc::new(AtomicUsize::new(0));
    let lists = Arc::clone(&instance_lists);
    let server = FakeServer::start(move |req| match (req.resource(), req.is_watch()) {
        ("models", false) => Reply::list_at(json!([model_json(1, "m")]), 7),
        ("workers", false) => Reply::list_at(json!([worker_json(1, "10.0.0.1")]), 7),
        ("model-instances", false) => match lists.fetch_add(1, Ordering::SeqCst) {
            0 => Reply::list_at(json!([instance_json(1, "running", 40001)]), 7),
            _ => Reply::list_at(json!([instance_json(1, "draining", 40001)]), 12),
        },
        (_, false) => Reply::list_at(json!([]), 7),
        ("model-instances", true) if req.since() == Some(9) => {
            let headers = vec![("x-faden-watch", "snapshot".to_owned())];
            s.open(req, headers)
        }
        (_, true) => s.open(req, vec![("x-faden-watch", "resumed".to_owned())]),
    })
    .await;
    let (handle, _cancel) = start(config(&server));
    synced(&handle).await;
    assert_eq!(handle.current().revision, Some(7));

    let instances = streams.sender("model-instances").await;
    instances
        .send(event_at(2, instance_json(2, "running", 40002), Some(9)))
        .await
        .unwrap();
    eventually("revision 9", || handle.objects().revision == Some(9)).await;
    assert_eq!(instance_ids(&handle), [1, 2]);
    drop(instances);
    streams.close("model-instances");

    // Resume at 9 → "snapshot" → list (revision 12) → watch since 12.
    eventually("a watch since 12", || {
        server
            .requests()
            .iter()
            .any(|r| r.resource() == "model-instances" && r.since() == Some(12))
    })
    .await;
    let trail: Vec<String> = server
        .requests()
        .iter()
        .filter(|r| r.resource() == "model-instances")
        .map(|r| match (r.is_watch(), r.since()) {
            (false, _) => "list".to_owned(),
            (true, since) => format!("watch since {since:?}"),
        })
        .collect();
    assert_eq!(
        trail,
        [
            "list",
            "watch since Some(7)",
            "watch since Some(9)",
            "list",
            "watch since Some(12)"
        ]
    );
    // The re-list replaced the state: instance 2 is gone, instance 1 drains.
    eventually("the re-listed state", || instance_ids(&handle) == [1]).await;
    assert_eq!(
        handle.objects().instances[&1].state,
        InstanceState::Draining
    );
    eventually("the revision of the re-list", || {
        handle.current().revision == Some(12)
    })
    .await;
    assert!(handle.current().routable("m").is_none());
    for resource in ["workers", "models", "credentials"] {
        assert_eq!(server.count(resource, false), 1, "{resource} lists");
    }
}

/// Events faden cannot read are skipped and counted; text that is not an event breaks the stream
/// and forces a fresh list.
#[tokio::test]
async fn unreadable_events_are_skipped_and_broken_ones_force_a_relist() {
    let streams = Streams::default();
    let s = streams.clone();
    let server = FakeServer::start(move |req| match (req.resource(), req.is_watch()) {
        (_, true) => s.open(req, Vec::new()),
        ("credentials", false) => Reply::status(404, "{}"),
        _ => Reply::list(json!([])),
    })
    .await;
    let (handle, _cancel) = start(config(&server));
    synced(&handle).await;

    let instances = streams.sender("model-instances").await;
    let mut no_model_id = instance_json(5, "running", 40005);
    no_model_id.as_object_mut().unwrap().remove("model_id");
    instances
        .send(event(1, instance_json(4, "running", 40004)))
        .await
        .unwrap();
    instances.send(event(1, no_model_id)).await.unwrap();
    instances
        .send(event(4, instance_json(4, "error", 40004)))
        .await
        .unwrap();
    // A heartbeat and an SSE comment are not events.
    instances
        .send(b"\n\n: keep-alive\n\n".to_vec())
        .await
        .unwrap();
    instances
        .send(event(2, instance_json(6, "running", 40006)))
        .await
        .unwrap();

    eventually("instances 4 and 6", || instance_ids(&handle) == [4, 6]).await;
    assert_eq!(handle.skipped_events(), 2);
    assert_eq!(handle.objects().instances[&4].state, InstanceState::Running);
    assert_eq!(server.count("model-instances", false), 1);

    instances
        .send(b"<html>oops</html>\n\n".to_vec())
        .await
        .unwrap();
    eventually("a re-list", || server.count("model-instances", false) == 2).await;
    eventually("the listed (empty) state", || {
        instance_ids(&handle).is_empty()
    })
    .await;
}

/// A refused token is retried with backoff (never synced), not hammered.
#[tokio::test]
async fn refused_tokens_are_retried_with_backoff() {
    let server = FakeServer::start(|_| {
        Reply::status(
            401,
            r#"{"code":401,"reason":"Unauthorized","message":"Invalid authentication credentials"}"#,
        )
    })
    .await;
    let mut config = config(&server);
    config.backoff_min = Duration::from_millis(50);
    config.backoff_max = Duration::from_millis(100);
    let (handle, _cancel) = start(config);

    // Enough refusals that a hot loop would have made them all at once (see the bound below).
    eventually("retries", || server.count("workers", false) >= 13).await;
    assert!(!handle.is_synced());
    assert_eq!(handle.staleness(), None);
    let attempts = server.count("workers", false);
    let elapsed = server.requests().last().unwrap().at - server.requests()[0].at;
    // With delays up to 100 ms a hot loop would make thousands of attempts.
    assert!(
        attempts < 10 + (elapsed.as_millis() / 10) as usize,
        "{attempts} attempts in {elapsed:?}"
    );
}

/// A server that comes up after the client is picked up within the backoff cap.
#[tokio::test]
async fn a_late_server_is_picked_up() {
    // Reserve an ephemeral port: bound but not listening, connections to it are refused,
    // and no other test can take it meanwhile.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    let mut config = SyncConfig::new(format!("http://{addr}"), TOKEN);
    config.backoff_min = Duration::from_millis(20);
    config.backoff_max = Duration::from_millis(200);
    let (handle, _cancel) = start(config);
    // Fifteen failures per resource: an uncapped backoff would now draw its delays from up to
    // 20 ms × 2¹⁵ ≈ 11 min, a capped one from up to 200 ms.
    testkit::wait_until(
        Duration::from_secs(30),
        "fifteen failed sessions per resource",
        || handle.failed_sessions() >= 60,
    )
    .await;
    assert!(!handle.is_synced());

    let listener = socket.listen(1024).unwrap();
    let up = Instant::now();
    let _server = FakeServer::serve(
        listener,
        Arc::new(|req: &Req| match (req.resource(), req.is_watch()) {
            (_, true) => Reply::silent_watch(),
            _ => Reply::list(json!([])),
        }),
    );
    synced(&handle).await;
    // Capped at 200 ms per resource, plus the lists; an uncapped backoff would take minutes.
    assert!(up.elapsed() < WAIT, "{:?}", up.elapsed());
}

/// Cancelling ends every task: the held watch connections are closed.
#[tokio::test]
async fn cancelling_closes_every_stream() {
    let server = FakeServer::start(|req| {
        if req.is_watch() {
            Reply::silent_watch()
        } else {
            Reply::list(json!([]))
        }
    })
    .await;
    let cancel = CancellationToken::new();
    let handle = sync::spawn(config(&server), cancel.clone()).unwrap();
    synced(&handle).await;
    eventually("four open watches", || server.open_connections() == 4).await;

    let mut snapshots = handle.snapshots();
    cancel.cancel();
    eventually("every watch closed", || server.open_connections() == 0).await;
    let closed = timeout(WAIT, snapshots.changed()).await.unwrap();
    assert!(closed.is_err(), "the merger is gone");
    assert!(handle.is_synced(), "the last state stays readable");
}
