//! The `faden-mock-engine` process: it prints its address, answers a streamed completion in
//! vLLM's framing, and stops on SIGTERM.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use http::Method;
use testkit::http_client::Client;

#[tokio::test]
async fn the_binary_serves_a_streamed_completion() {
    let (_engine, addr) = testkit::process::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_faden-mock-engine")),
        &["--port", "0", "--tokens", "3", "--itl", "1ms"],
        &[],
        "mock engine listening",
        "addr",
    )
    .await;
    let body = serde_json::json!({
        "model": "mock-model",
        "stream": true,
        "messages": [{"role": "user", "content": "hi"}],
    });
    let reply = tokio::time::timeout(
        Duration::from_secs(30),
        Client::new(format!("http://{addr}")).send(
            Method::POST,
            "/v1/chat/completions",
            body.to_string(),
        ),
    )
    .await
    .expect("an answer")
    .expect(200);
    let text = reply.text();
    assert!(text.contains("tok0 "), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
}
