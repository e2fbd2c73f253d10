//! Hostile clients on the gateway's listener: slow and junk connections against the
//! pending-connection caps and the head deadline, smuggling and malformed heads, failed-auth rate
//! limiting. After each, a good client is still served. The worker proxy's listener has its own
//! in `worker/tests/proxy.rs`.

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
    assert_refused_alone, closed_by_server, connect_from, exchange_from, header, json_body,
    slow_clients, smuggling_cases, source, status,
};
use tokio::io::AsyncWriteExt;

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

    // The slow ones are closed at the deadline (counted from the accept), not before, and by
    // this deadline rather than the default 30 s one (`closed_by_server` fails after 10 s).
    let _ = closed_by_server(&mut slow).await;
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(700), "{took:?}");
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
    closed_by_server(&mut junk).await;
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

#[tokio::test]
async fn smuggling_and_malformed_heads_get_400() {
    let e = engine().await;
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, e.port())]).await;
    assert_refused_alone(h.addr, &smuggling_cases(&bearer_line(&h))).await;
    assert_eq!(e.stats.requests(), 0, "nothing reached the engine");
    served(h.addr, 1, &chat(&bearer_line(&h))).await;
    h.stop().await;
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
