//! Every request counted in is counted out: a client that leaves in any phase (before the
//! answer's head, while sending its body, mid-stream, during a retry) leaves the in-flight
//! gauges and every instance's outstanding count at zero, and is counted once.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{Harness, Inst, T, dead_port, send};
use gateway::{EjectionConfig, GatewayConfig};
use http_body_util::BodyExt;
use mock_engine::{MockEngine, MockEngineConfig};
use testkit::wait::wait_until_async;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// The gateway's `/metrics` text.
async fn scrape(h: &Harness) -> String {
    let req = http::Request::get(format!("http://{}/metrics", h.addr))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let body = send(h.addr, req).await.into_body().collect().await.unwrap();
    String::from_utf8(body.to_bytes().to_vec()).unwrap()
}

/// The sum of a metric's samples whose line starts with `prefix` (a name, maybe with labels).
fn sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Waits until nothing is in flight anywhere: the request gauge, the stream gauge and every
/// instance's outstanding count.
async fn wait_idle(h: &Harness) -> String {
    wait_until_async(T, "every in-flight count back at zero", || async {
        let text = scrape(h).await;
        sum(&text, "faden_gateway_active_requests ") == 0.0
            && sum(&text, "faden_gateway_active_streams ") == 0.0
            && sum(&text, "faden_gateway_instance_requests_in_flight{") == 0.0
    })
    .await;
    scrape(h).await
}

/// Waits until `n` requests are in flight at the gateway.
async fn wait_active(h: &Harness, n: f64) {
    wait_until_async(T, "the request in flight at the gateway", || async {
        sum(&scrape(h).await, "faden_gateway_active_requests ") == n
    })
    .await;
}

fn slow_engine() -> MockEngineConfig {
    MockEngineConfig {
        // Longer than any test: the answer's head never comes while the client waits.
        time_to_first_token: Duration::from_secs(60),
        ..Default::default()
    }
}

/// A whole chat request on a raw connection, left open.
async fn raw_chat(h: &Harness, stream: bool) -> TcpStream {
    let body = format!(
        r#"{{"model":"mock-model","messages":[{{"role":"user","content":"hi"}}],"stream":{stream}}}"#
    );
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        h.bearer(),
        body.len()
    );
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    s
}

#[tokio::test]
async fn a_client_gone_before_the_head_is_counted_once_and_out() {
    let engine = MockEngine::start(slow_engine()).await.unwrap();
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, engine.port())]).await;
    let client = raw_chat(&h, false).await;
    engine.stats.wait_requests(1).await;
    drop(client);
    // The engine's work is cancelled with the upstream connection.
    tokio::time::timeout(T, engine.stats.wait_disconnects(1))
        .await
        .unwrap();
    let text = wait_idle(&h).await;
    assert_eq!(sum(&text, "faden_gateway_client_disconnects_total "), 1.0);
    assert_eq!(
        sum(
            &text,
            "faden_gateway_requests_total{model=\"mock-model\",route=\"chat/completions\",status=\"499\"}"
        ),
        1.0,
        "{text}"
    );
    assert_eq!(sum(&text, "faden_gateway_requests_total{"), 1.0, "{text}");
}

#[tokio::test]
async fn a_client_gone_while_sending_its_body_is_counted_once_and_out() {
    let engine = MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap();
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, engine.port())]).await;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {}\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{{\"model\":",
        h.bearer()
    );
    let mut client = TcpStream::connect(h.addr).await.unwrap();
    client.write_all(head.as_bytes()).await.unwrap();
    wait_active(&h, 1.0).await;
    drop(client);
    let text = wait_idle(&h).await;
    assert_eq!(sum(&text, "faden_gateway_requests_total{"), 1.0, "{text}");
    assert_eq!(engine.stats.requests(), 0, "nothing went upstream");
}

#[tokio::test]
async fn a_client_gone_mid_stream_is_counted_once_and_out() {
    let engine = MockEngine::start(MockEngineConfig {
        tokens: 1000,
        inter_token_delay: Duration::from_millis(20),
        ..Default::default()
    })
    .await
    .unwrap();
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, engine.port())]).await;
    let resp = send(h.addr, h.chat(true)).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = tokio::time::timeout(T, body.frame()).await.unwrap();
    assert!(first.unwrap().unwrap().is_data());
    drop(body);
    tokio::time::timeout(T, engine.stats.wait_disconnects(1))
        .await
        .unwrap();
    let text = wait_idle(&h).await;
    assert_eq!(sum(&text, "faden_gateway_client_disconnects_total "), 1.0);
    assert_eq!(
        sum(
            &text,
            "faden_gateway_requests_total{model=\"mock-model\",route=\"chat/completions\",status=\"200\"}"
        ),
        1.0,
        "{text}"
    );
    assert_eq!(sum(&text, "faden_gateway_requests_total{"), 1.0, "{text}");
}

#[tokio::test]
async fn a_client_gone_during_a_retry_is_counted_once_and_out() {
    let engine = MockEngine::start(slow_engine()).await.unwrap();
    let config = GatewayConfig {
        // No ejection during the test: the dead instance keeps being tried first.
        ejection: EjectionConfig {
            consecutive_failures: 1000,
            ..EjectionConfig::default()
        },
        ..Default::default()
    };
    let h = Harness::start(
        config,
        &[
            Inst::direct(1, dead_port().await),
            Inst::direct(2, engine.port()),
        ],
    )
    .await;
    // The first request ends on the live instance, whichever it tried first; with it
    // outstanding there, the second is sent to the dead one first and retried.
    let first = raw_chat(&h, false).await;
    engine.stats.wait_requests(1).await;
    let second = raw_chat(&h, false).await;
    engine.stats.wait_requests(2).await;
    let text = scrape(&h).await;
    assert!(sum(&text, "faden_gateway_retries_total ") >= 1.0, "{text}");
    assert_eq!(
        sum(
            &text,
            "faden_gateway_instance_requests_in_flight{instance=\"2\"}"
        ),
        2.0,
        "{text}"
    );
    drop(second);
    drop(first);
    let text = wait_idle(&h).await;
    assert_eq!(sum(&text, "faden_gateway_client_disconnects_total "), 2.0);
    assert_eq!(
        sum(
            &text,
            "faden_gateway_requests_total{model=\"mock-model\",route=\"chat/completions\",status=\"499\"}"
        ),
        2.0,
        "{text}"
    );
    assert_eq!(sum(&text, "faden_gateway_requests_total{"), 2.0, "{text}");
}
