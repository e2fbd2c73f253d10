//! Hostile clients on the gateway and worker proxy listeners: slow and junk connections against
//! the pending-connection caps and the head deadline, smuggling and malformed heads, failed-auth
//! rate limiting, and worker proxy targets that are not registered instances. After each, a good
//! client is still served.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use gateway::GatewayConfig;
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle};
use net::admission::{AuthLimits, PendingLimits};
use testkit::raw::{
    answers, closed_by_server, connect_from, exchange_from, header, json_body, read_to_close,
    slow_clients, source, status,
};
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;
use worker::proxy::{LocalInstances, WorkerProxy, WorkerProxyConfig};

async fn engine() -> MockEngineHandle {
    MockEngine::start(MockEngineConfig {
        tokens: 3,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// A complete chat request with `auth` (a whole header line or nothing), closing the connection.
fn chat(auth: &str) -> Vec<u8> {
    let body = format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn bearer_line(h: &Harness) -> String {
    format!("authorization: {}\r\n", h.bearer())
}

/// A good client from `from` gets a complete 200 answer.
async fn served(addr: SocketAddr, from: u8, request: &[u8]) {
    let out = exchange_from(source(from), addr, request).await;
    assert_eq!(status(&out), 200, "good client from 127.0.0.{from}: {out}");
}

fn metric(h: &Harness, line_start: &str) -> u64 {
    let text = h.gateway.metrics_text();
    text.lines()
        .find_map(|l| l.strip_prefix(line_start))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line_start} in {text}"))
}

const SLOW_HEAD: &[u8] = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: ";

#[tokio::test]
async fn slow_and_junk_connections_are_capped_and_closed_at_the_deadline() {
    let e = engine().await;
    let mut config = GatewayConfig::default();
    config.listener.header_read_timeout = Duration::from_millis(800);
    config.listener.pending = PendingLimits {
        max_pending: 6,
        max_pending_per_source: 3,
    };
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;
    let good = chat(&bearer_line(&h));

    // Three slowloris connections from 127.0.0.1 hold that address's pending slots.
    let started = tokio::time::Instant::now();
    let mut slow = slow_clients(source(1), h.addr, 3, SLOW_HEAD).await;
    // A fourth from the same address is refused at once, with a clear answer. The one accept
    // loop admits connections in the order they were established, so the three come first.
    let out = exchange_from(source(1), h.addr, b"").await;
    assert_eq!(status(&out), 429, "{out}");
    assert_eq!(header(&out, "retry-after"), Some("1"));
    assert_eq!(
        json_body(&out)["error"]["code"],
        "too_many_pending_connections"
    );
    // Another address is served meanwhile.
    served(h.addr, 2, &good).await;

    // The slow ones are closed at the deadline (counted from the accept), not later.
    let _ = closed_by_server(&mut slow).await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // And the address is served again.
    served(h.addr, 1, &good).await;

    // The total cap: slow clients from three addresses fill it, a fourth address gets 503.
    let mut slow = Vec::new();
    for from in [3, 4] {
        slow.extend(slow_clients(source(from), h.addr, 3, SLOW_HEAD).await);
    }
    let out = exchange_from(source(5), h.addr, b"").await;
    assert_eq!(status(&out), 503, "{out}");
    let _ = closed_by_server(&mut slow).await;
    served(h.addr, 5, &good).await;

    // Junk that is not HTTP, an HTTP/2 preface with no request, and a silent connection: all
    // closed by the deadline too.
    let mut junk = Vec::new();
    for bytes in [
        &b"\x16\x03\x01\x02\x00 not http"[..],
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"",
    ] {
        let mut s = connect_from(source(6), h.addr).await;
        s.write_all(bytes).await.unwrap();
        junk.push(s);
    }
    let took = closed_by_server(&mut junk).await;
    assert!(took < Duration::from_secs(3), "{took:?}");
    served(h.addr, 6, &good).await;

    assert!(
        metric(
            &h,
            "faden_gateway_connections_refused_total{reason=\"pending_per_source\"}"
        ) >= 1
    );
    assert!(
        metric(
            &h,
            "faden_gateway_connections_refused_total{reason=\"pending_total\"}"
        ) >= 1
    );
    // Slow heads mostly end by hyper's own header timer; the silent and HTTP/2 ones by ours.
    assert!(
        metric(
            &h,
            "faden_gateway_connections_refused_total{reason=\"head_timeout\"}"
        ) >= 2
    );
    h.stop().await;
}

/// Request heads that must never be framed: each gets 400, alone, and nothing after it is read.
fn smuggling_cases(auth: &str) -> Vec<(&'static str, Vec<u8>)> {
    let next = "GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n";
    let post = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n";
    let body = format!(r#"{{"model":"{MODEL}"}}"#);
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    [
        (
            "Content-Length and Transfer-Encoding",
            format!(
                "{post}{auth}content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n{chunked}{next}"
            ),
        ),
        (
            "two different Content-Length values",
            format!(
                "{post}{auth}content-length: {}\r\ncontent-length: 4\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "Content-Length list with different values",
            format!(
                "{post}{auth}content-length: {}, 4\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "Transfer-Encoding: chunked, identity",
            format!("{post}{auth}transfer-encoding: chunked, identity\r\n\r\n{chunked}{next}"),
        ),
        (
            "Transfer-Encoding: identity",
            format!("{post}{auth}transfer-encoding: identity\r\n\r\n{body}{next}"),
        ),
        (
            "obs-fold",
            format!(
                "{post}{auth}x-folded: a\r\n b\r\ncontent-length: {}\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "obs-fold of Transfer-Encoding",
            format!("{post}{auth}transfer-encoding:\r\n chunked\r\n\r\n{chunked}{next}"),
        ),
        (
            "space before the colon",
            format!(
                "{post}{auth}content-length : {}\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "CR inside a header value",
            format!(
                "{post}{auth}x-inject: a\rinjected: 1\r\ncontent-length: {}\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "NUL inside a header value",
            format!(
                "{post}{auth}x-inject: a\0b\r\ncontent-length: {}\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
    ]
    .into_iter()
    .map(|(name, text)| (name, text.into_bytes()))
    .collect()
}

async fn assert_refused_alone(addr: SocketAddr, cases: &[(&str, Vec<u8>)]) {
    for (name, bytes) in cases {
        let out = exchange_from(source(1), addr, bytes).await;
        assert_eq!(status(&out), 400, "{name}: {out}");
        assert_eq!(
            answers(&out),
            1,
            "{name}: a second request was answered: {out}"
        );
    }
}

struct WorkerSetup {
    addr: SocketAddr,
    instances: LocalInstances,
    stop: CancellationToken,
}

async fn worker_proxy(config: WorkerProxyConfig) -> WorkerSetup {
    let instances = LocalInstances::new();
    let proxy = WorkerProxy::new(config, instances.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move { proxy.serve(listener, s).await });
    WorkerSetup {
        addr,
        instances,
        stop,
    }
}

const WORKER_SECRET: &str = "worker-secret";

#[tokio::test]
async fn smuggling_and_malformed_heads_get_400_on_gateway_and_worker_proxy() {
    let e = engine().await;
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;
    assert_refused_alone(h.addr, &smuggling_cases(&bearer_line(&h))).await;
    assert_eq!(e.stats.requests(), 0, "nothing reached the engine");
    served(h.addr, 1, &chat(&bearer_line(&h))).await;

    let w = worker_proxy(WorkerProxyConfig {
        credentials: vec![WORKER_SECRET.into()],
        ..Default::default()
    })
    .await;
    w.instances.insert(1, e.port());
    let auth = format!(
        "authorization: Bearer {WORKER_SECRET}\r\nx-gpustack-model-instance: model-1-1.static\r\n"
    );
    assert_refused_alone(w.addr, &smuggling_cases(&auth)).await;
    assert_eq!(
        e.stats.requests(),
        1,
        "only the good request reached the engine"
    );
    served(w.addr, 1, &chat(&auth)).await;
    h.stop().await;
    w.stop.cancel();
}

#[tokio::test]
async fn failed_keys_are_rate_limited_per_source() {
    let e = engine().await;
    let mut config = GatewayConfig::default();
    config.listener.auth = AuthLimits {
        max_failures: 3,
        window: Duration::from_secs(60),
        ..AuthLimits::default()
    };
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;
    let wrong =
        chat("authorization: Bearer fdn_0123456789abcdef_0123456789abcdef0123456789abcdef\r\n");
    let good = chat(&bearer_line(&h));
    for i in 0..3 {
        let out = exchange_from(source(3), h.addr, &wrong).await;
        assert_eq!(status(&out), 401, "attempt {i}: {out}");
    }
    // Past the limit, a refused key is told to back off; up to 100 failures in all.
    for _ in 3..100 {
        let out = exchange_from(source(3), h.addr, &wrong).await;
        assert_eq!(status(&out), 429, "{out}");
        let v = json_body(&out);
        assert_eq!(v["error"]["code"], "too_many_auth_failures", "{v}");
        assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
        let retry: u64 = header(&out, "retry-after").unwrap().parse().unwrap();
        assert!((1..=60).contains(&retry), "{retry}");
    }
    // A valid key from that address is served all the same.
    served(h.addr, 3, &good).await;
    let models = format!(
        "GET /v1/models HTTP/1.1\r\nhost: x\r\n{}connection: close\r\n\r\n",
        bearer_line(&h)
    );
    assert_eq!(
        status(&exchange_from(source(3), h.addr, models.as_bytes()).await),
        200
    );
    // Another client is not affected; successes and requests without a key never count.
    for _ in 0..5 {
        served(h.addr, 4, &good).await;
        let out = exchange_from(source(5), h.addr, &chat("")).await;
        assert_eq!(status(&out), 401, "{out}");
    }
    served(h.addr, 5, &good).await;
    h.stop().await;
}

#[tokio::test]
async fn worker_proxy_forwards_only_to_registered_instances_and_limits_failures() {
    let e = engine().await;
    // A canary on a loopback port: nothing may ever connect to it.
    let canary = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let canary_port = canary.local_addr().unwrap().port();
    let w = worker_proxy(WorkerProxyConfig {
        credentials: vec![WORKER_SECRET.into()],
        listener: gateway::ListenerConfig {
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
    w.stop.cancel();
}

#[tokio::test]
async fn slow_clients_on_the_worker_proxy() {
    let e = engine().await;
    let w = worker_proxy(WorkerProxyConfig {
        credentials: vec![WORKER_SECRET.into()],
        listener: gateway::ListenerConfig {
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
    let took = closed_by_server(&mut slow).await;
    assert!(took < Duration::from_secs(3), "{took:?}");
    let mut s = connect_from(source(1), w.addr).await;
    s.write_all(good.as_bytes()).await.unwrap();
    assert_eq!(status(&read_to_close(&mut s).await), 200);
    w.stop.cancel();
}
