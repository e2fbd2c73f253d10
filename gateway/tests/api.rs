//! The client-facing surface: error classes, auth, header hygiene, listings, hostile input.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use control_client::model::{Scope, Timestamp};
use control_client::routing::{ModelRoute, RoutingSnapshot};
use control_client::tokens;
use gateway::GatewayConfig;
use http::Request;
use http_body_util::Full;
use mock_engine::{MockEngine, MockEngineConfig};

async fn engine() -> mock_engine::MockEngineHandle {
    MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap()
}

#[tokio::test]
async fn error_classes_are_openai_shaped() {
    let e = engine().await;
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;

    let resp = send(h.addr, h.post("/v1/chat/completions", "{\"model\":")).await;
    assert_error(resp, 400, "invalid_json").await;
    let resp = send(h.addr, h.post("/v1/chat/completions", r#"{"messages":[]}"#)).await;
    assert_error(resp, 400, "missing_model").await;
    let resp = send(
        h.addr,
        h.post("/v1/chat/completions", r#"{"model":"nope"}"#),
    )
    .await;
    assert_error(resp, 404, "model_not_found").await;
    let resp = send(h.addr, h.post("/v1/unknown", r#"{"model":"x"}"#)).await;
    assert_error(resp, 404, "not_found").await;
    let get = Request::get(format!("http://{}/v1/chat/completions", h.addr))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = send(h.addr, get).await;
    assert_eq!(resp.headers()["allow"], "POST");
    assert_error(resp, 405, "method_not_allowed").await;

    // A model whose every instance is gone: 503.
    let mut snap = snapshot(&[], std::slice::from_ref(&h.cred));
    snap.models.insert(
        "empty".into(),
        Arc::new(ModelRoute {
            model_id: 9,
            name: "empty".into(),
            policy: None,
            endpoints: vec![],
        }),
    );
    h.snapshots.send_replace(Arc::new(snap));
    let resp = send(
        h.addr,
        h.post("/v1/chat/completions", r#"{"model":"empty"}"#),
    )
    .await;
    assert_error(resp, 503, "no_routable_instance").await;

    assert_eq!(e.stats.requests(), 0, "nothing reached the engine");
    h.stop().await;
}

#[tokio::test]
async fn auth_missing_invalid_expired_scope_and_revoked() {
    let e = engine().await;
    let inst = [Inst::direct(1, e.port())];
    let h = Harness::start(GatewayConfig::default(), &inst).await;
    let body = format!(r#"{{"model":"{MODEL}"}}"#);

    // Missing.
    let req = Request::post(format!("http://{}/v1/completions", h.addr))
        .body(Full::new(Bytes::from(body.clone())))
        .unwrap();
    let resp = send(h.addr, req).await;
    assert_eq!(resp.headers()["www-authenticate"], "Bearer");
    assert_error(resp, 401, "invalid_api_key").await;

    // Unknown and malformed.
    for key in [tokens::generate("fdn").value, "garbage".to_owned()] {
        let req = Request::post(format!("http://{}/v1/completions", h.addr))
            .header("authorization", format!("Bearer {key}"))
            .body(Full::new(Bytes::from(body.clone())))
            .unwrap();
        assert_error(send(h.addr, req).await, 401, "invalid_api_key").await;
    }

    // X-API-Key works like Bearer.
    let req = Request::post(format!("http://{}/v1/completions", h.addr))
        .header("x-api-key", &h.key.value)
        .body(Full::new(Bytes::from(body.clone())))
        .unwrap();
    assert_eq!(send(h.addr, req).await.status(), 200);

    // Expired and management-only keys.
    let expired = tokens::generate("fdn");
    let mgmt = tokens::generate("fdn");
    let past = Timestamp(chrono::Utc::now() - chrono::Duration::seconds(5));
    h.publish(
        &inst,
        &[
            h.cred.clone(),
            credential(2, &expired, Scope::All, Some(past)),
            credential(3, &mgmt, Scope::Management, None),
        ],
    );
    for key in [&expired, &mgmt] {
        let req = Request::post(format!("http://{}/v1/completions", h.addr))
            .header("authorization", format!("Bearer {}", key.value))
            .body(Full::new(Bytes::from(body.clone())))
            .unwrap();
        assert_error(send(h.addr, req).await, 401, "invalid_api_key").await;
    }

    // Revoked: the key leaves the snapshot and the very next request is refused.
    assert_eq!(
        send(h.addr, h.post("/v1/completions", body.clone()))
            .await
            .status(),
        200
    );
    h.publish(&inst, &[]);
    assert_error(
        send(h.addr, h.post("/v1/completions", body)).await,
        401,
        "invalid_api_key",
    )
    .await;
    h.stop().await;
}

#[tokio::test]
async fn strips_client_credentials_and_internal_headers() {
    let e = engine().await;
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;
    let body = format!(
        r#"{{"model":"{MODEL}","unknown_field":{{"kept":[1,2.50,"x"]}},  "max_tokens":2}}"#
    );
    let req = Request::post(format!("http://{}/v1-openai/completions?trace=1", h.addr))
        .header("authorization", h.bearer())
        .header("x-api-key", &h.key.value)
        .header("x-gpustack-model-instance", "model-1-999.static")
        .header("x-gpustack-auth-token", "t")
        .header("x-gpustack-access-key", "a")
        .header("x-gpustack-key-ref", "r")
        .header("connection", "x-hop")
        .header("x-hop", "1")
        .header("x-request-id", "abc")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.clone())))
        .unwrap();
    let resp = send(h.addr, req).await;
    assert_eq!(resp.status(), 200);
    let seen = e.stats.last_request().unwrap();
    assert_eq!(seen.uri, "/v1/completions?trace=1");
    assert_eq!(seen.body, body.as_bytes(), "body forwarded byte for byte");
    for name in [
        "authorization",
        "x-api-key",
        "x-gpustack-model-instance",
        "x-gpustack-auth-token",
        "x-gpustack-access-key",
        "x-gpustack-key-ref",
        "x-hop",
    ] {
        assert!(!seen.headers.contains_key(name), "{name} leaked upstream");
    }
    assert!(
        !seen
            .headers
            .values()
            .any(|v| v.as_bytes() == h.key.value.as_bytes()),
        "client key leaked"
    );
    assert_eq!(seen.headers["x-request-id"], "abc");
    assert_eq!(
        seen.headers["content-length"],
        body.len().to_string().as_str()
    );
    h.stop().await;
}

#[tokio::test]
async fn models_health_ready_and_metrics() {
    let e = engine().await;
    let stale = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let probe_age = stale.clone();
    let key = tokens::generate("fdn");
    let cred = credential(1, &key, Scope::Inference, None);
    let snap = snapshot(&[Inst::direct(1, e.port())], std::slice::from_ref(&cred));
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(snap));
    let gw = gateway::Gateway::builder(
        GatewayConfig {
            max_snapshot_staleness: Some(Duration::from_secs(30)),
            ..Default::default()
        },
        rx,
    )
    .staleness_probe(Arc::new(move || {
        Duration::from_secs(probe_age.load(std::sync::atomic::Ordering::Relaxed))
    }))
    .build()
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let (g, s) = (gw.clone(), stop.clone());
    let task = tokio::spawn(async move { g.serve(listener, s).await });
    let get = |path: &str, auth: bool| {
        let mut b = Request::get(format!("http://{addr}{path}"));
        if auth {
            b = b.header("authorization", format!("Bearer {}", key.value));
        }
        b.body(Full::new(Bytes::new())).unwrap()
    };

    let v = json(send(addr, get("/v1/models", true)).await).await;
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
    assert_eq!(send(addr, get("/v1/models", false)).await.status(), 401);
    assert_eq!(send(addr, get("/healthz", false)).await.status(), 200);
    assert_eq!(send(addr, get("/readyz", false)).await.status(), 200);
    assert_eq!(send(addr, get("/health", false)).await.status(), 200);
    stale.store(31, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(send(addr, get("/readyz", false)).await.status(), 503);
    stale.store(0, std::sync::atomic::Ordering::Relaxed);
    gw.set_draining(true);
    assert_eq!(send(addr, get("/readyz", false)).await.status(), 503);
    assert_eq!(
        send(addr, get("/health", false)).await.status(),
        503,
        "/health is /readyz"
    );
    gw.set_draining(false);

    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("authorization", format!("Bearer {}", key.value))
        .body(Full::new(Bytes::from(format!(
            r#"{{"model":"{MODEL}","stream":true}}"#
        ))))
        .unwrap();
    let _ = body_bytes(send(addr, req).await).await;
    let text = String::from_utf8(
        body_bytes(send(addr, get("/metrics", false)).await)
            .await
            .to_vec(),
    )
    .unwrap();
    assert!(
        text.contains(&format!(
            "faden_gateway_requests_total{{model=\"{MODEL}\",route=\"chat/completions\",status=\"200\"}} 1"
        )),
        "{text}"
    );
    assert!(text.contains("faden_gateway_ttft_seconds_count{route=\"chat/completions\"} 1"));
    assert!(text.contains("faden_gateway_active_streams 0"));
    drop(tx);
    stop.cancel();
    tokio::time::timeout(T, task).await.unwrap().unwrap();
}

#[tokio::test]
async fn hostile_input() {
    let e = engine().await;
    let config = GatewayConfig {
        max_body_bytes: 1024,
        listener: gateway::ListenerConfig {
            max_header_bytes: 16 * 1024,
            header_read_timeout: Duration::from_millis(500),
            ..Default::default()
        },
        ..Default::default()
    };
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;

    // Oversized body, declared and chunked.
    let big = format!(r#"{{"model":"{MODEL}","pad":"{}"}}"#, "x".repeat(4096));
    assert_error(
        send(h.addr, h.post("/v1/completions", big.clone())).await,
        413,
        "payload_too_large",
    )
    .await;
    let chunked = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{big}\r\n0\r\n\r\n",
        h.bearer(),
        big.len()
    );
    assert!(
        raw(h.addr, chunked.as_bytes())
            .await
            .starts_with("HTTP/1.1 413")
    );
    // A declared length over the limit is refused before any of the body is sent.
    let declared = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ncontent-length: 1000000\r\n\r\n",
        h.bearer()
    );
    let started = std::time::Instant::now();
    let answer = raw(h.addr, declared.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("payload_too_large"), "{answer}");
    // `raw` gives up after `T`: the answer did not wait for the body, which never comes.
    assert!(started.elapsed() < T, "the answer waited for the body");

    // Oversized header.
    let huge = format!(
        "GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
        "a".repeat(32 * 1024)
    );
    let out = raw(h.addr, huge.as_bytes()).await;
    assert!(out.starts_with("HTTP/1.1 431"), "{out}");

    // Content-Length and Transfer-Encoding together: hyper lets chunked win, drops the
    // Content-Length and closes the connection after the answer (RFC 9112 §6.1), so the bytes
    // after the chunked body are never read as a second (smuggled) request.
    let body = format!(r#"{{"model":"{MODEL}"}}"#);
    let smuggle = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n",
        h.bearer(),
        body.len()
    );
    let out = raw(h.addr, smuggle.as_bytes()).await;
    assert_eq!(out.matches("HTTP/1.1 ").count(), 1, "{out}");
    assert!(
        out.starts_with("HTTP/1.1 200") || out.starts_with("HTTP/1.1 400"),
        "{out}"
    );

    // Garbage and a silent client are closed.
    let out = raw(h.addr, b"\x16\x03\x01 not http\r\n\r\n").await;
    assert!(out.is_empty() || out.starts_with("HTTP/1.1 400"), "{out}");
    let started = std::time::Instant::now();
    let out = raw(h.addr, b"").await;
    assert!(out.is_empty());
    // `raw` gives up after `T`; the default header timeout is 30 s.
    assert!(
        started.elapsed() < T,
        "silent client closed by the header timeout"
    );

    // Wrong body types.
    assert_error(
        send(h.addr, h.post("/v1/completions", "[1,2]")).await,
        400,
        "invalid_json",
    )
    .await;
    assert_error(
        send(
            h.addr,
            h.post("/v1/completions", r#"{"model":"a","model":"b"}"#),
        )
        .await,
        400,
        "invalid_json",
    )
    .await;
    h.stop().await;
}

#[tokio::test]
async fn multipart_model_and_tunnel_without_transport() {
    let e = engine().await;
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;
    let body = format!(
        "--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--b0undary\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{MODEL}\r\n--b0undary--\r\n"
    );
    let req = Request::post(format!("http://{}/v1/audio/transcriptions", h.addr))
        .header("authorization", h.bearer())
        .header("content-type", "multipart/form-data; boundary=b0undary")
        .body(Full::new(Bytes::from(body.clone())))
        .unwrap();
    let resp = send(h.addr, req).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(e.stats.last_request().unwrap().body, body.as_bytes());

    // A tunnel worker without a tunnel transport: 502.
    let tunnel = Inst {
        id: 5,
        port: 1,
        mode: control_client::model::ProxyMode::Tunnel,
        worker_port: 1,
    };
    h.publish(&[tunnel], std::slice::from_ref(&h.cred));
    let resp = send(h.addr, h.chat(false)).await;
    assert_error(resp, 502, "tunnel_unavailable").await;
    let _ = RoutingSnapshot::default();
    h.stop().await;
}
