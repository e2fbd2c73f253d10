//! An instance that turns `draining` (or leaves the snapshot) gets no new requests, while the
//! streams it is serving run to completion.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{Harness, Inst, T, body_bytes, send};
use gateway::GatewayConfig;
use http_body_util::BodyExt;
use mock_engine::{MockEngine, MockEngineConfig};

#[tokio::test]
async fn a_draining_instance_finishes_its_streams_and_takes_nothing_new() {
    let slow = MockEngineConfig {
        tokens: 10,
        inter_token_delay: Duration::from_millis(50),
        ..Default::default()
    };
    let a = MockEngine::start(slow.clone()).await.unwrap();
    let b = MockEngine::start(slow).await.unwrap();
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, a.port())]).await;

    // A live stream on instance 1.
    let resp = send(h.addr, h.chat(true)).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    tokio::time::timeout(T, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    // Instance 1 drains: the next snapshot routes only to instance 2.
    h.publish(&[Inst::direct(2, b.port())], std::slice::from_ref(&h.cred));
    for _ in 0..5 {
        let r = send(h.addr, h.chat(false)).await;
        assert_eq!(r.status(), 200);
        body_bytes(r).await;
    }
    assert_eq!(
        a.stats.requests(),
        1,
        "no new request may reach the draining instance"
    );
    assert_eq!(b.stats.requests(), 5);

    // The stream that was running on instance 1 completes normally.
    let rest = tokio::time::timeout(T, body.collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    assert!(
        rest.ends_with(b"data: [DONE]\n\n"),
        "stream cut when its instance drained"
    );
    assert_eq!(a.stats.disconnects(), 0);
    h.stop().await;
}
