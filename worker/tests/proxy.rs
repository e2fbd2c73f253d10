//! The worker's reverse proxy on its own port: credentials, instance names and methods, what
//! reaches the engine, request smuggling and slow clients, targets that are not registered
//! instances (never an open proxy), the trace context passed on, and the instance relay
//! (`CONNECT model-<m>-<i>.static:0`). The gateway in front of it: `faden/tests/worker_path.rs`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle};
use net::admission::{AuthLimits, PendingLimits};
use net::config::ListenerConfig;
use testkit::Client;
use testkit::raw::{
    assert_refused_alone, closed_by_server, connect_from, exchange_from, header, json_body,
    read_answer, read_to_close, slow_clients, smuggling_cases, source, status,
};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use worker::proxy::{LocalInstances, WorkerProxy, WorkerProxyConfig};

const WORKER_SECRET: &str = "worker-secret";
/// A bound that only a hung test reaches.
const T: Duration = Duration::from_secs(10);

async fn engine(config: MockEngineConfig) -> MockEngineHandle {
    MockEngine::start(config).await.unwrap()
}

fn tokens(tokens: usize) -> MockEngineConfig {
    MockEngineConfig {
        tokens,
        ..Default::default()
    }
}

/// A worker proxy serving on 127.0.0.1:0 until [`WorkerSetup::stop`].
struct WorkerSetup {
    addr: SocketAddr,
    instances: LocalInstances,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl WorkerSetup {
    async fn start(config: WorkerProxyConfig) -> Self {
        let instances = LocalInstances::new();
        let proxy = WorkerProxy::new(config, instances.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let s = stop.clone();
        let task = tokio::spawn(async move { proxy.serve(listener, s).await });
        Self {
            addr,
            instances,
            stop,
            task,
        }
    }

    /// A proxy accepting [`WORKER_SECRET`], with default limits.
    async fn with_secret() -> Self {
        Self::start(WorkerProxyConfig {
            credentials: vec![WORKER_SECRET.into()],
            ..Default::default()
        })
        .await
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(T, self.task).await.unwrap().unwrap();
    }
}

/// A request to the proxy for `instance`, with `auth` (a header and its value) when given.
fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    auth: Option<(&str, &str)>,
    instance: &str,
    body: &str,
) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("x-gpustack-model-instance", instance)
        .header("content-type", "application/json");
    if let Some((k, v)) = auth {
        b = b.header(k, v);
    }
    b.body(Full::new(Bytes::from(body.to_owned()))).unwrap()
}

#[tokio::test]
async fn serves_registered_instances_to_holders_of_a_credential() {
    let e = engine(MockEngineConfig {
        tokens: 4,
        inter_token_delay: Duration::from_millis(5),
        ..Default::default()
    })
    .await;
    let w = WorkerSetup::with_secret().await;
    w.instances.insert(1, e.port());
    let client = Client::new(format!("http://{}", w.addr));
    let bearer = ("authorization", "Bearer worker-secret");
    // Sequential chats, streamed (chunked) and not (Content-Length), on one kept-alive client
    // connection: the proxy keeps its one connection to the engine.
    for i in 0..10 {
        let stream = i % 2 == 0;
        let body = format!(
            r#"{{"model":"mock-model","messages":[{{"role":"user","content":"hi"}}],"stream":{stream}}}"#
        );
        let reply = client
            .send_request(request(
                w.addr,
                "POST",
                "/v1/chat/completions",
                Some(bearer),
                "model-1-1.static",
                &body,
            ))
            .await
            .expect(200);
        if stream {
            assert!(reply.body.ends_with(b"data: [DONE]\n\n"));
        } else {
            assert!(reply.body.starts_with(b"{"));
        }
    }
    assert_eq!(e.stats.requests(), 10);
    assert_eq!(
        e.stats.connections(),
        1,
        "the worker proxy did not reuse its connection"
    );
    // The credential and the instance header stay on the worker.
    let seen = e.stats.last_request().unwrap();
    assert!(!seen.headers.contains_key("authorization"));
    assert!(!seen.headers.contains_key("x-gpustack-model-instance"));
    assert_eq!(seen.uri, "/v1/chat/completions");

    // 401 without or with a wrong credential, 404 for an unknown instance with the marker, 405
    // for other methods; X-API-Key accepted.
    let get = |auth, instance| request(w.addr, "GET", "/v1/models", auth, instance, "");
    for auth in [None, Some(("authorization", "Bearer nope"))] {
        let reply = client.send_request(get(auth, "model-1-1.static")).await;
        assert_eq!(reply.expect(401).json()["error"]["code"], "invalid_api_key");
    }
    let key = Some(("x-api-key", WORKER_SECRET));
    let reply = client.send_request(get(key, "model-1-7.static")).await;
    assert_eq!(reply.headers["x-faden-no-such-instance"], "1");
    assert_eq!(
        reply.expect(404).json()["error"]["code"],
        "model_instance_not_found"
    );
    client
        .send_request(get(key, "model-1-1.static"))
        .await
        .expect(200);
    let delete = request(
        w.addr,
        "DELETE",
        "/v1/models",
        Some(bearer),
        "model-1-1.static",
        "",
    );
    client.send_request(delete).await.expect(405);
    assert_eq!(e.stats.requests(), 11);
    w.stop().await;
}

#[tokio::test]
async fn passes_the_trace_context_on_unchanged() {
    let e = engine(tokens(2)).await;
    let w = WorkerSetup::with_secret().await;
    w.instances.insert(1, e.port());
    let client = Client::new(format!("http://{}", w.addr));
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let body = r#"{"model":"mock-model","messages":[{"role":"user","content":"hi"}]}"#;
    let mut req = request(
        w.addr,
        "POST",
        "/v1/chat/completions",
        Some(("authorization", "Bearer worker-secret")),
        "model-1-1.static",
        body,
    );
    req.headers_mut()
        .insert("traceparent", parent.parse().unwrap());
    req.headers_mut()
        .insert("tracestate", "vendor=v1".parse().unwrap());
    client.send_request(req).await.expect(200);
    let seen = e.stats.last_request().unwrap();
    let all: Vec<_> = seen.headers.get_all("traceparent").iter().collect();
    assert_eq!(all, [parent]);
    assert_eq!(seen.headers["tracestate"], "vendor=v1");
    w.stop().await;
}

/// A complete chat request with `auth` (whole header lines), closing the connection.
fn chat(auth: &str) -> Vec<u8> {
    let body = r#"{"model":"mock-model","messages":[{"role":"user","content":"hi"}]}"#;
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[tokio::test]
async fn smuggling_and_malformed_heads_get_400() {
    let e = engine(tokens(3)).await;
    let w = WorkerSetup::with_secret().await;
    w.instances.insert(1, e.port());
    let auth = format!(
        "authorization: Bearer {WORKER_SECRET}\r\nx-gpustack-model-instance: model-1-1.static\r\n"
    );
    assert_refused_alone(w.addr, &smuggling_cases(&auth)).await;
    assert_eq!(e.stats.requests(), 0, "nothing reached the engine");
    let out = exchange_from(source(1), w.addr, &chat(&auth)).await;
    assert_eq!(status(&out), 200, "{out}");
    w.stop().await;
}

#[tokio::test]
async fn forwards_only_to_registered_instances_and_limits_failures() {
    let e = engine(tokens(3)).await;
    // A canary on a loopback port: nothing may ever connect to it.
    let canary = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let canary_port = canary.local_addr().unwrap().port();
    let w = WorkerSetup::start(WorkerProxyConfig {
        credentials: vec![WORKER_SECRET.into()],
        listener: ListenerConfig {
            auth: AuthLimits {
                max_failures: 3,
                ..AuthLimits::default()
            },
            ..Default::default()
        },
        ..Default::default()
    })
    .await;
    w.instances.insert(1, e.port());
    let auth = format!("authorization: Bearer {WORKER_SECRET}\r\n");
    let get = |target: &str, extra: &str| {
        format!("GET {target} HTTP/1.1\r\nhost: x\r\n{auth}{extra}connection: close\r\n\r\n")
    };
    // Instance names that are not a registered instance: 404 marked as such, or 400.
    for instance in [
        format!("127.0.0.1:{canary_port}"),
        "169.254.169.254".to_owned(),
        "model-1-2.static".to_owned(),
        format!("model-1-{canary_port}.static"),
        "model-1-1".to_owned(),
        "model-1-%31.static".to_owned(),
        "[::1]".to_owned(),
    ] {
        let out = exchange_from(
            source(1),
            w.addr,
            get(
                "/v1/models",
                &format!("x-gpustack-model-instance: {instance}\r\n"),
            )
            .as_bytes(),
        )
        .await;
        assert_eq!(status(&out), 404, "{instance}: {out}");
        assert_eq!(header(&out, "x-faden-no-such-instance"), Some("1"));
    }
    // Absolute-form targets anywhere (even with a registered instance header) and CONNECT.
    let registered = "x-gpustack-model-instance: model-1-1.static\r\n";
    for target in [
        format!("http://127.0.0.1:{canary_port}/v1/models"),
        "http://169.254.169.254/latest/meta-data/".to_owned(),
        "http://[::1]:10150/".to_owned(),
        "http://[::ffff:127.0.0.1]:10150/".to_owned(),
        "http://[fe80::1]:10150/".to_owned(),
        "http://2130706433:10150/".to_owned(),
        "http://0177.0.0.1:10150/".to_owned(),
        "http://localhost:10150/".to_owned(),
        "http://a@127.0.0.1/".to_owned(),
    ] {
        let out = exchange_from(source(1), w.addr, get(&target, registered).as_bytes()).await;
        assert_eq!(status(&out), 400, "{target}: {out}");
        assert_eq!(json_body(&out)["error"]["code"], "invalid_target");
    }
    // A percent-encoded authority is not even a valid request target: hyper refuses it.
    let out = exchange_from(
        source(1),
        w.addr,
        get("http://%31%32%37.0.0.1/", registered).as_bytes(),
    )
    .await;
    assert_eq!(status(&out), 400, "{out}");
    let connect = format!(
        "CONNECT 127.0.0.1:{canary_port} HTTP/1.1\r\nhost: 127.0.0.1:{canary_port}\r\n{auth}{registered}connection: close\r\n\r\n"
    );
    let out = exchange_from(source(1), w.addr, connect.as_bytes()).await;
    assert_eq!(status(&out), 405, "{out}");
    assert!(
        tokio::time::timeout(Duration::from_millis(100), canary.accept())
            .await
            .is_err(),
        "something dialled the canary"
    );
    assert_eq!(e.stats.requests(), 0);

    // Wrong credentials: 401 three times, then 429; the right one is served from there too.
    let with = |credential: &str| {
        format!(
            "GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {credential}\r\n{registered}connection: close\r\n\r\n"
        )
    };
    for _ in 0..3 {
        let out = exchange_from(source(7), w.addr, with("guess").as_bytes()).await;
        assert_eq!(status(&out), 401, "{out}");
    }
    let out = exchange_from(source(7), w.addr, with("guess").as_bytes()).await;
    assert_eq!(status(&out), 429, "{out}");
    assert!(header(&out, "retry-after").is_some());
    assert_eq!(json_body(&out)["error"]["code"], "too_many_auth_failures");
    let out = exchange_from(source(7), w.addr, with(WORKER_SECRET).as_bytes()).await;
    assert_eq!(status(&out), 200, "{out}");
    // Another caller still reaches the registered instance.
    let out = exchange_from(source(1), w.addr, with(WORKER_SECRET).as_bytes()).await;
    assert_eq!(status(&out), 200, "{out}");
    assert_eq!(e.stats.requests(), 2);
    w.stop().await;
}

#[tokio::test]
async fn slow_clients_are_capped_and_closed_at_the_deadline() {
    let e = engine(tokens(3)).await;
    let w = WorkerSetup::start(WorkerProxyConfig {
        credentials: vec![WORKER_SECRET.into()],
        listener: ListenerConfig {
            header_read_timeout: Duration::from_millis(600),
            pending: PendingLimits {
                max_pending: 16,
                max_pending_per_source: 2,
            },
            ..Default::default()
        },
        ..Default::default()
    })
    .await;
    w.instances.insert(1, e.port());
    // Admitted in accept order: the two hold their slots before the third is accepted.
    let mut slow = slow_clients(source(1), w.addr, 2, b"GET /v1/models HTTP/1.1\r\n").await;
    let out = exchange_from(source(1), w.addr, b"").await;
    assert_eq!(status(&out), 429, "{out}");
    let good = format!(
        "GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {WORKER_SECRET}\r\nx-gpustack-model-instance: model-1-1.static\r\nconnection: close\r\n\r\n"
    );
    let out = exchange_from(source(2), w.addr, good.as_bytes()).await;
    assert_eq!(status(&out), 200, "{out}");
    // Closed by the 600 ms deadline: `closed_by_server` fails after 10 s, and the default
    // deadline is 30 s.
    closed_by_server(&mut slow).await;
    let mut s = connect_from(source(1), w.addr).await;
    s.write_all(good.as_bytes()).await.unwrap();
    assert_eq!(status(&read_to_close(&mut s).await), 200);
    w.stop().await;
}

/// The instance the relay tests ask for, and its model.
const INSTANCE: i64 = 7;
const MODEL_ID: i64 = 1;

/// Sends `request` on a new connection and reads one answer: its status and its text.
async fn raw(addr: SocketAddr, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let text = read_answer(&mut s).await;
    (status(&text), text)
}

fn connect(target: &str, auth: &str) -> String {
    format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n")
}

fn completion(extra: &str) -> String {
    let body = r#"{"model":"mock-model","prompt":"hi"}"#;
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: engine\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test]
async fn relays_only_to_registered_instances() {
    let engine = engine(MockEngineConfig::default()).await;
    let w = WorkerSetup::with_secret().await;
    w.instances.insert(INSTANCE, engine.port());
    let addr = w.addr;
    let canary = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let canary_port = canary.local_addr().unwrap().port();
    let auth = format!("Authorization: Bearer {WORKER_SECRET}\r\n");
    let good = format!("model-{MODEL_ID}-{INSTANCE}.static:0");

    // The same credential check as every other request.
    for wrong in ["", "Authorization: Bearer nope\r\n"] {
        let (status, text) = raw(addr, &connect(&good, wrong)).await;
        assert_eq!(status, 401, "{wrong:?}: {text}");
    }
    // Anything but a relay target: refused as CONNECT always was.
    for target in [
        format!("127.0.0.1:{canary_port}"),
        format!("localhost:{canary_port}"),
        format!("[::1]:{canary_port}"),
        "10.0.0.5:10150".to_owned(),
        "192.168.1.10:80".to_owned(),
        "169.254.169.254:80".to_owned(),
        format!("model-{MODEL_ID}-{INSTANCE}.static:{canary_port}"),
        format!("model-{MODEL_ID}-{INSTANCE}.static:80"),
        format!("model-{MODEL_ID}-{INSTANCE}.static"),
        format!("Model-{MODEL_ID}-{INSTANCE}.static:0"),
    ] {
        let (status, text) = raw(addr, &connect(&target, &auth)).await;
        assert_eq!(status, 405, "{target}: {text}");
    }
    // Absolute-form stays refused.
    let (status, _) = raw(
        addr,
        &format!("GET http://127.0.0.1:{canary_port}/ HTTP/1.1\r\nHost: x\r\n{auth}X-GPUStack-Model-Instance: model-1-7.static\r\n\r\n"),
    )
    .await;
    assert_eq!(status, 400);
    // A well-formed name of an instance this worker does not host: the marked 404.
    let (status, text) = raw(addr, &connect("model-1-99.static:0", &auth)).await;
    assert_eq!(status, 404, "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("x-faden-no-such-instance: 1")
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(100), canary.accept())
            .await
            .is_err(),
        "something dialled the canary"
    );
    assert_eq!(engine.stats.connections(), 0);

    // The relay: 200, then HTTP/1.1 to the engine, kept alive.
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(connect(&good, "X-API-Key: worker-secret\r\n").as_bytes())
        .await
        .unwrap();
    let head = read_answer(&mut c).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    for _ in 0..2 {
        c.write_all(completion("").as_bytes()).await.unwrap();
        let answer = read_answer(&mut c).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("text_completion"), "{answer}");
    }
    assert_eq!(engine.stats.requests(), 2);
    assert_eq!(engine.stats.connections(), 1);
    drop(c);
    w.stop().await;
}
