//! Token counting from the usage engines report, and the opt-in `include_usage` rewrite.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use gateway::GatewayConfig;
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle};

async fn engine() -> MockEngineHandle {
    MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap()
}

/// `faden_tokens_total` of the model, once it reached `want` (counted when the body is dropped,
/// a moment after the client read its end).
async fn wait_tokens(h: &Harness, want: (u64, u64)) -> String {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let text = h.gateway.metrics_text();
        let read = |kind: &str| -> u64 {
            let prefix = format!("faden_tokens_total{{model=\"{MODEL}\",kind=\"{kind}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .map_or(0, |v| v.parse().unwrap())
        };
        let got = (read("prompt"), read("completion"));
        if got == want {
            return text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "tokens {got:?}, want {want:?}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The usage in the last `data:` event carrying one.
fn stream_usage(body: &[u8]) -> serde_json::Value {
    let text = std::str::from_utf8(body).unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .rfind(|v| v["usage"].is_object())
        .map(|v| v["usage"].clone())
        .unwrap_or(serde_json::Value::Null)
}

#[tokio::test]
async fn counts_tokens_and_adds_include_usage_when_asked() {
    let e = engine().await;
    let config = GatewayConfig {
        count_tokens: true,
        ..GatewayConfig::default()
    };
    let h = Harness::start(config, &[Inst::direct(1, e.port())]).await;

    // Streamed without stream_options: the gateway asks for usage and counts it.
    let body = format!(r#"{{"model":"{MODEL}","max_tokens":3,"stream":true,"messages":[]}}"#);
    let resp = send(h.addr, h.post("/v1/chat/completions", body.clone())).await;
    assert_eq!(resp.status(), 200);
    let got = body_bytes(resp).await;
    let usage = stream_usage(&got);
    assert_eq!(
        usage["completion_tokens"],
        3,
        "{}",
        String::from_utf8_lossy(&got)
    );
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    let seen = e.stats.last_request().unwrap();
    let sent: serde_json::Value = serde_json::from_slice(&seen.body).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert_eq!(sent["model"], MODEL);
    assert_eq!(
        seen.headers["content-length"].to_str().unwrap(),
        seen.body.len().to_string()
    );
    wait_tokens(&h, (prompt, 3)).await;

    // The client's own stream_options are left alone (no usage asked: none counted).
    let own = format!(
        r#"{{"model":"{MODEL}","max_tokens":2,"stream":true,"stream_options":{{"include_usage":false}}}}"#
    );
    let resp = send(h.addr, h.post("/v1/completions", own.clone())).await;
    let got = body_bytes(resp).await;
    assert!(stream_usage(&got).is_null());
    assert_eq!(e.stats.last_request().unwrap().body, own.as_bytes());

    // Non-streamed chat: usage is in the JSON answer.
    let resp = send(
        h.addr,
        h.post(
            "/v1/chat/completions",
            format!(r#"{{"model":"{MODEL}","max_tokens":4}}"#),
        ),
    )
    .await;
    let v = json(resp).await;
    let p2 = v["usage"]["prompt_tokens"].as_u64().unwrap();
    wait_tokens(&h, (prompt + p2, 7)).await;
    h.stop().await;
}

#[tokio::test]
async fn counts_reported_usage_without_rewriting_by_default() {
    let e = engine().await;
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;

    // Streamed without stream_options: forwarded untouched, nothing to count.
    let body = format!(r#"{{"model":"{MODEL}","max_tokens":2,"stream":true}}"#);
    let resp = send(h.addr, h.post("/v1/chat/completions", body.clone())).await;
    let got = body_bytes(resp).await;
    assert!(stream_usage(&got).is_null());
    assert_eq!(e.stats.last_request().unwrap().body, body.as_bytes());

    // The client asked for usage itself: counted.
    let body = format!(
        r#"{{"model":"{MODEL}","max_tokens":5,"stream":true,"stream_options":{{"include_usage":true}}}}"#
    );
    let resp = send(h.addr, h.post("/v1/completions", body.clone())).await;
    let got = body_bytes(resp).await;
    let p1 = stream_usage(&got)["prompt_tokens"].as_u64().unwrap();
    assert_eq!(e.stats.last_request().unwrap().body, body.as_bytes());
    wait_tokens(&h, (p1, 5)).await;

    // Embeddings: prompt tokens only.
    let resp = send(
        h.addr,
        h.post(
            "/v1/embeddings",
            format!(r#"{{"model":"{MODEL}","input":"hello there"}}"#),
        ),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let v = json(resp).await;
    let p2 = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let text = wait_tokens(&h, (p1 + p2, 5)).await;
    assert!(text.contains("# TYPE faden_tokens_total counter"));
    h.stop().await;
}
