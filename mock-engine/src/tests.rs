use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::rt::TokioExecutor;

use super::*;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

fn post(addr: SocketAddr, path: &str, body: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap()
}

#[tokio::test]
async fn streams_tokens_then_usage_then_done() {
    let engine = MockEngine::start(MockEngineConfig {
        tokens: 3,
        ..Default::default()
    })
    .await
    .unwrap();
    let body = r#"{"model":"mock-model","stream":true,"stream_options":{"include_usage":true}}"#;
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        client().request(post(engine.addr, "/v1/chat/completions", body)),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(resp.status(), 200);
    let seq: u64 = resp.headers()[REQUEST_SEQ_HEADER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let got = resp.into_body().collect().await.unwrap().to_bytes();
    let want: Vec<u8> = expected_stream(
        StreamKind::Chat,
        "mock-model",
        1_700_000_000,
        seq,
        3,
        body.len(),
        true,
    )
    .concat();
    assert_eq!(got, Bytes::from(want));
    assert!(got.ends_with(b"data: [DONE]\n\n"));
    assert_eq!(engine.stats.completed(), 1);
    assert_eq!(engine.stats.disconnects(), 0);
    let text = String::from_utf8(got.to_vec()).unwrap();
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").unwrap();
        if data != "[DONE]" {
            let _: serde_json::Value = serde_json::from_str(data).unwrap();
        }
    }
}

#[tokio::test]
async fn non_stream_and_embeddings_and_models() {
    let engine = MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap();
    let c = client();
    let resp = c
        .request(post(
            engine.addr,
            "/v1/completions",
            r#"{"model":"m","max_tokens":2}"#,
        ))
        .await
        .unwrap();
    let v: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(v["choices"][0]["text"], "tok0 tok1 ");
    assert_eq!(v["usage"]["completion_tokens"], 2);

    let resp = c
        .request(post(
            engine.addr,
            "/v1/embeddings",
            r#"{"model":"m","input":["a","b"]}"#,
        ))
        .await
        .unwrap();
    let v: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(v["data"][1]["embedding"].as_array().unwrap().len(), 8);

    let req = Request::get(format!("http://{}/v1/models", engine.addr))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let v: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(v["data"][0]["id"], "mock-model");
    assert_eq!(engine.stats.seen().len(), 3);
}

#[tokio::test]
async fn counts_a_disconnect_mid_stream() {
    let engine = MockEngine::start(MockEngineConfig {
        tokens: 100,
        inter_token_delay: Duration::from_millis(20),
        ..Default::default()
    })
    .await
    .unwrap();
    let resp = client()
        .request(post(
            engine.addr,
            "/v1/chat/completions",
            r#"{"stream":true}"#,
        ))
        .await
        .unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.data_ref().unwrap().starts_with(b"data: "));
    drop(body);
    tokio::time::timeout(Duration::from_secs(10), engine.stats.wait_disconnects(1))
        .await
        .unwrap();
}

#[tokio::test]
async fn injected_failures() {
    let engine = MockEngine::start(MockEngineConfig {
        tokens: 5,
        inter_token_delay: Duration::from_millis(5),
        ..Default::default()
    })
    .await
    .unwrap();
    engine.set_fail_status(Some(503));
    let resp = client()
        .request(post(engine.addr, "/v1/chat/completions", "{}"))
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    engine.set_fail_status(None);
    engine.set_abort_after_tokens(Some(2));
    let resp = client()
        .request(post(
            engine.addr,
            "/v1/chat/completions",
            r#"{"stream":true}"#,
        ))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.into_body().collect().await.is_err());
    assert_eq!(engine.stats.aborted(), 1);
}
