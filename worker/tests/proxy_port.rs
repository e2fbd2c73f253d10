//! The tunnel's proxy port in front of a worker proxy behind the tunnel: authentication, never
//! an open relay, and the three request shapes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

// The tunnel crate's harness (server, workers, proxy port), and a worker proxy behind it.
mod behind_tunnel;
#[path = "../../tunnel/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use behind_tunnel::*;
use bytes::Bytes;
use common::*;
use http::Request;
use http_body_util::{BodyExt as _, Full};
use mock_engine::{MockEngineConfig, MockEngineHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn completion_body() -> &'static str {
    r#"{"model":"mock-model","prompt":"hi"}"#
}

fn post(target: &str, auth: &str, extra: &str) -> String {
    let body = completion_body();
    format!(
        "POST {target} HTTP/1.1\r\nHost: proxy\r\n{auth}{extra}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

const PROXY_AUTH: &str = "Proxy-Authorization: Bearer dp-key\r\n";
const INSTANCE_HEADER: &str = "X-GPUStack-Model-Instance: model-1-7.static\r\n";

async fn engine_worker() -> (MockEngineHandle, ProxySetup) {
    let (engine, handler) = worker_proxy(MockEngineConfig {
        tokens: 5,
        inter_token_delay: Duration::from_millis(60),
        ..Default::default()
    })
    .await;
    (engine, ProxySetup::start(handler).await)
}

#[tokio::test]
async fn refuses_unauthenticated_callers() {
    let (engine, s) = engine_worker().await;
    for auth in [
        "",
        "Proxy-Authorization: Bearer wrong\r\n",
        "Proxy-Authorization: Basic ZHAta2V5\r\n",
        "Authorization: Bearer wrong\r\n",
    ] {
        let (status, text) = raw(s.proxy, &post("/v1/completions", auth, INSTANCE_HEADER)).await;
        assert_eq!(status, 407, "{auth:?}: {text}");
        assert!(
            text.to_ascii_lowercase()
                .contains("proxy-authenticate: bearer")
        );
        assert!(text.contains("invalid_api_key"));
    }
    let (status, _) = raw(
        s.proxy,
        "CONNECT 127.0.0.2:10150 HTTP/1.1\r\nHost: 127.0.0.2:10150\r\n\r\n",
    )
    .await;
    assert_eq!(status, 407);
    assert_eq!(engine.stats.requests(), 0);
    s.stop().await;
}

#[tokio::test]
async fn is_never_an_open_relay() {
    let (engine, s) = engine_worker().await;
    let engine_port = engine.port();
    let refused_connect = [
        format!("127.0.0.1:{engine_port}"),
        format!("127.0.0.1:{WORKER_PORT}"),
        "127.0.0.2:40000".into(),
        format!("127.0.0.2:{engine_port}"),
        "10.0.0.5:10150".into(),
        "192.168.1.10:10150".into(),
        "172.16.0.1:10150".into(),
        "169.254.169.254:80".into(),
        "localhost:10150".into(),
        "metadata.google.internal:80".into(),
        "[::1]:10150".into(),
        "[::ffff:127.0.0.2]:10150".into(),
        "0177.0.0.2:10150".into(),
        "0177.0.0.1:10150".into(),
        "2130706434:10150".into(),
        "2130706433:10150".into(),
        "0x7f000002:10150".into(),
        "127.1:10150".into(),
        "127.0.0.2.:10150".into(),
        "[::ffff:127.0.0.1]:10150".into(),
        "[::ffff:7f00:2]:10150".into(),
        "[fe80::1]:10150".into(),
        "[::]:10150".into(),
        "0.0.0.0:10150".into(),
        "[fd00::1]:10150".into(),
    ];
    for target in &refused_connect {
        let (status, text) = raw(
            s.proxy,
            &format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{PROXY_AUTH}\r\n"),
        )
        .await;
        assert_eq!(status, 403, "{target}: {text}");
        assert!(text.contains("target_not_allowed"), "{text}");
    }
    // Malformed or encoded targets never reach a lookup.
    for target in [
        "%31%32%37.0.0.2:10150",
        "127.0.0.2%3a10150",
        "user@127.0.0.2:10150",
        "127.0.0.2",
        "[::1%25lo]:10150",
        "[fe80::1%eth0]:10150",
    ] {
        let (status, text) = raw(
            s.proxy,
            &format!("CONNECT {target} HTTP/1.1\r\nHost: x\r\n{PROXY_AUTH}\r\n"),
        )
        .await;
        assert_eq!(status, 400, "{target}: {text}");
    }
    // Absolute-form to anything but a connected worker's registered address.
    for target in [
        "http://169.254.169.254/latest/meta-data/".to_owned(),
        format!("http://127.0.0.1:{engine_port}/v1/completions"),
        "http://127.0.0.1:10150/v1/completions".to_owned(),
        "http://10.0.0.5:10150/v1/completions".to_owned(),
        "http://[::1]:10150/v1/completions".to_owned(),
        "http://[::ffff:127.0.0.1]:10150/v1/completions".to_owned(),
        "http://[fe80::1]:10150/v1/completions".to_owned(),
        "http://2130706433:10150/v1/completions".to_owned(),
        "http://0177.0.0.1:10150/v1/completions".to_owned(),
        "http://localhost:10150/v1/completions".to_owned(),
        "http://metadata.google.internal/computeMetadata/v1/".to_owned(),
    ] {
        let (status, text) = raw(s.proxy, &post(&target, PROXY_AUTH, INSTANCE_HEADER)).await;
        assert_eq!(status, 403, "{target}: {text}");
    }
    // Userinfo and percent-encoding in an absolute-form authority: refused before any lookup.
    for target in [
        format!("http://a@{WORKER_HOST}:{WORKER_PORT}/v1/completions"),
        "http://a@127.0.0.1/".to_owned(),
        format!("http://%31%32%37.0.0.2:{WORKER_PORT}/v1/completions"),
    ] {
        let (status, text) = raw(s.proxy, &post(&target, PROXY_AUTH, INSTANCE_HEADER)).await;
        assert_eq!(status, 400, "{target}: {text}");
    }
    let (status, _) = raw(
        s.proxy,
        &post(
            "https://127.0.0.2:10150/v1/completions",
            PROXY_AUTH,
            INSTANCE_HEADER,
        ),
    )
    .await;
    assert_eq!(status, 400);
    // Origin-form: the instance must be known and its worker's tunnel up.
    let (status, text) = raw(
        s.proxy,
        &post(
            "/v1/completions",
            PROXY_AUTH,
            "X-GPUStack-Model-Instance: model-1-8.static\r\n",
        ),
    )
    .await;
    assert_eq!(status, 502, "{text}");
    assert!(text.contains("tunnel_unavailable"));
    let (status, _) = raw(
        s.proxy,
        &post(
            "/v1/completions",
            PROXY_AUTH,
            "X-GPUStack-Model-Instance: model-1-9.static\r\n",
        ),
    )
    .await;
    assert_eq!(status, 404);
    let (status, _) = raw(s.proxy, &post("/v1/completions", PROXY_AUTH, "")).await;
    assert_eq!(status, 400);
    assert_eq!(engine.stats.requests(), 0, "nothing reached the engine");
    s.stop().await;
}

#[tokio::test]
async fn serves_origin_form_absolute_form_and_connect() {
    let (engine, s) = engine_worker().await;

    // Origin-form with the instance header (the caller's key may come as Authorization too).
    for auth in [PROXY_AUTH, "Authorization: Bearer dp-key\r\n"] {
        let (status, text) = raw(s.proxy, &post("/v1/completions", auth, INSTANCE_HEADER)).await;
        assert_eq!(status, 200, "{text}");
        assert!(text.contains("text_completion"), "{text}");
    }
    // The worker proxy saw the configured worker credential, not the caller's key.
    assert_eq!(engine.stats.requests(), 2);

    // Absolute-form to the worker's registered address and worker port.
    let (status, text) = raw(
        s.proxy,
        &post(
            &format!("http://{WORKER_HOST}:{WORKER_PORT}/v1/completions"),
            PROXY_AUTH,
            INSTANCE_HEADER,
        ),
    )
    .await;
    assert_eq!(status, 200, "{text}");

    // SSE through the proxy port arrives chunk by chunk.
    let tcp = TcpStream::connect(s.proxy).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = Request::post("/v1/completions")
        .header("proxy-authorization", format!("Bearer {KEY}"))
        .header("x-gpustack-model-instance", "model-1-7.static")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"mock-model","prompt":"hi","stream":true}"#,
        )))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut arrivals = Vec::new();
    while let Some(f) = tokio::time::timeout(T, body.frame()).await.unwrap() {
        if f.unwrap().is_data() {
            arrivals.push(tokio::time::Instant::now());
        }
    }
    assert!(arrivals.len() >= 4, "{} chunks", arrivals.len());
    assert!(*arrivals.last().unwrap() - arrivals[0] >= Duration::from_millis(150));

    // CONNECT to the worker: then HTTP/1.1 to its proxy through the relay.
    let mut c = TcpStream::connect(s.proxy).await.unwrap();
    c.write_all(
        format!(
            "CONNECT {WORKER_HOST}:{WORKER_PORT} HTTP/1.1\r\nHost: {WORKER_HOST}:{WORKER_PORT}\r\n{PROXY_AUTH}\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let head = testkit::raw::read_head(&mut c).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    c.write_all(
        post(
            "/v1/completions",
            &format!("Authorization: Bearer {WORKER_CRED}\r\n"),
            INSTANCE_HEADER,
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    // `Connection: close`: the worker ends its side, and that end reaches us as EOF.
    let mut answer = Vec::new();
    tokio::time::timeout(T, c.read_to_end(&mut answer))
        .await
        .unwrap()
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("text_completion"));
    s.stop().await;
}

/// Origin-form requests go to the instance as the server's own gateway sends them: over one
/// relayed stream kept alive between requests (the engine accepts one connection for all of
/// them), origin-form, `Host: 127.0.0.1:<instance port>`, and neither the caller's key, the worker
/// credential nor the instance header reaches the engine.
#[tokio::test]
async fn origin_form_requests_share_a_kept_alive_relay() {
    let (engine, s) = engine_worker().await;
    let tcp = TcpStream::connect(s.proxy).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    for _ in 0..3 {
        let req = Request::post("/v1/completions")
            .header("proxy-authorization", format!("Bearer {KEY}"))
            .header("authorization", format!("Bearer {WORKER_CRED}"))
            .header("x-gpustack-model-instance", "model-1-7.static")
            .body(Full::new(Bytes::from_static(completion_body().as_bytes())))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let text = resp.into_body().collect().await.unwrap().to_bytes();
        assert!(String::from_utf8_lossy(&text).contains("text_completion"));
    }
    assert_eq!(engine.stats.requests(), 3);
    assert_eq!(
        engine.stats.connections(),
        1,
        "one relayed stream for three requests"
    );
    let seen = engine.stats.last_request().unwrap();
    assert_eq!(seen.uri, "/v1/completions");
    // The instance's port as the server records it (the harness's lookup says 40000).
    assert_eq!(seen.headers.get("host").unwrap(), "127.0.0.1:40000");
    for leaked in [
        "authorization",
        "proxy-authorization",
        "x-gpustack-model-instance",
    ] {
        assert!(
            !seen.headers.contains_key(leaked),
            "{leaked} reached the engine"
        );
    }
    s.stop().await;
}

/// Without a configured worker credential the caller's `Authorization` is the credential of the
/// relay: a kept-alive relay opened with a good one never carries a request that came with
/// another.
#[tokio::test]
async fn a_relay_kept_for_one_credential_serves_no_other() {
    let (engine, handler) = worker_proxy(MockEngineConfig::default()).await;
    let s = ProxySetup::start_with(handler, |c| c.worker_authorization = None).await;
    let with = |credential: &str| {
        post(
            "/v1/completions",
            &format!("{PROXY_AUTH}Authorization: Bearer {credential}\r\n"),
            INSTANCE_HEADER,
        )
    };
    let (status, text) = raw(s.proxy, &with(WORKER_CRED)).await;
    assert_eq!(status, 200, "{text}");
    let (status, text) = raw(s.proxy, &with("not-the-credential")).await;
    assert_eq!(status, 401, "{text}");
    let (status, text) = raw(s.proxy, &with(WORKER_CRED)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(engine.stats.requests(), 2);
    assert_eq!(
        engine.stats.connections(),
        1,
        "the good credential's relay was kept"
    );
    s.stop().await;
}

#[tokio::test]
async fn connect_propagates_half_close_both_ways() {
    let s = ProxySetup::start(test_handler).await;
    let mut c = TcpStream::connect(s.proxy).await.unwrap();
    c.write_all(
        format!("CONNECT {WORKER_HOST}:{WORKER_PORT} HTTP/1.1\r\nHost: x\r\n{PROXY_AUTH}\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let head = testkit::raw::read_head(&mut c).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // The echo handler ends its side only once our FIN reached it; its FIN reaches us as EOF.
    c.write_all(b"ehello, half-close").await.unwrap();
    c.shutdown().await.unwrap();
    let mut back = Vec::new();
    tokio::time::timeout(T, c.read_to_end(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, b"hello, half-close");
    s.stop().await;
}

#[tokio::test]
async fn hostile_clients_are_bounded_and_good_ones_served() {
    use net::admission::{AuthLimits, PendingLimits};
    use testkit::raw::{
        answers, closed_by_server, exchange_from, header, json_body, slow_clients, source, status,
    };
    let (engine, handler) = worker_proxy(MockEngineConfig::default()).await;
    let s = ProxySetup::start_with(handler, |c| {
        c.listener.header_read_timeout = Duration::from_millis(700);
        c.listener.pending = PendingLimits {
            max_pending: 16,
            max_pending_per_source: 2,
        };
        c.listener.max_header_bytes = 16 * 1024;
        c.listener.auth = AuthLimits {
            max_failures: 3,
            ..AuthLimits::default()
        };
    })
    .await;
    let good = post("/v1/completions", PROXY_AUTH, INSTANCE_HEADER);

    // Slowloris: the address's third pending connection is refused; others are served. The
    // listener admits connections in accept order, so the two hold their slots first.
    let mut slow = slow_clients(
        source(1),
        s.proxy,
        2,
        b"CONNECT 127.0.0.2:10150 HTTP/1.1\r\n",
    )
    .await;
    let out = exchange_from(source(1), s.proxy, b"").await;
    assert_eq!(status(&out), 429, "{out}");
    assert_eq!(header(&out, "retry-after"), Some("1"));
    assert_eq!(
        status(&exchange_from(source(2), s.proxy, good.as_bytes()).await),
        200
    );
    // Closed by the 700 ms deadline: `closed_by_server` fails after 10 s, the default is 30 s.
    closed_by_server(&mut slow).await;

    // Oversized head: 431. Smuggling shapes: 400, alone, nothing relayed.
    let huge = format!(
        "GET / HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
        "a".repeat(32 * 1024)
    );
    assert_eq!(
        status(&exchange_from(source(3), s.proxy, huge.as_bytes()).await),
        431
    );
    let body = completion_body();
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    let head = format!("POST /v1/completions HTTP/1.1\r\nhost: x\r\n{PROXY_AUTH}{INSTANCE_HEADER}");
    let next = "GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n";
    let before = engine.stats.requests();
    for (name, request) in [
        (
            "CL+TE",
            format!("{head}content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n{chunked}{next}"),
        ),
        (
            "differing Content-Length",
            format!(
                "{head}content-length: {}\r\ncontent-length: 4\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "chunked, identity",
            format!("{head}transfer-encoding: chunked, identity\r\n\r\n{chunked}{next}"),
        ),
        (
            "obs-fold",
            format!(
                "{head}x-folded: a\r\n b\r\ncontent-length: {}\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "CR in a value",
            format!(
                "{head}x-inject: a\rb\r\ncontent-length: {}\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
    ] {
        let out = exchange_from(source(3), s.proxy, request.as_bytes()).await;
        assert_eq!(status(&out), 400, "{name}: {out}");
        assert_eq!(answers(&out), 1, "{name}: {out}");
    }
    assert_eq!(engine.stats.requests(), before, "nothing was relayed");

    // Wrong keys: 407 three times, then 429 for that address; the right key is still served.
    let wrong = post(
        "/v1/completions",
        "Proxy-Authorization: Bearer guess\r\n",
        INSTANCE_HEADER,
    );
    for _ in 0..3 {
        assert_eq!(
            status(&exchange_from(source(4), s.proxy, wrong.as_bytes()).await),
            407
        );
    }
    let out = exchange_from(source(4), s.proxy, wrong.as_bytes()).await;
    assert_eq!(status(&out), 429, "{out}");
    assert!(header(&out, "retry-after").is_some());
    assert_eq!(json_body(&out)["error"]["code"], "too_many_auth_failures");
    let out = exchange_from(source(4), s.proxy, good.as_bytes()).await;
    assert_eq!(status(&out), 200, "{out}");
    // A missing key is a 407 that does not count; other addresses are served.
    for _ in 0..4 {
        let out = exchange_from(
            source(5),
            s.proxy,
            post("/v1/completions", "", INSTANCE_HEADER).as_bytes(),
        )
        .await;
        assert_eq!(status(&out), 407);
    }
    assert_eq!(
        status(&exchange_from(source(5), s.proxy, good.as_bytes()).await),
        200
    );
    s.stop().await;
}
