//! Hostile clients on the management API port: slow and silent connections against the head
//! deadline and the pending caps, malformed heads, oversized heads, and failed-auth rate
//! limiting. After each, a good client is still served.

use std::time::Duration;

use net::admission::{AuthLimits, PendingLimits};
use testkit::raw::{
    closed_by_server, connect_from, exchange_from, header, slow_clients, source, status,
};
use tokio::io::AsyncWriteExt;

use crate::common::start_with;

fn get(path: &str, token: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\nconnection: close\r\n\r\n")
        .into_bytes()
}

#[tokio::test]
async fn slow_silent_and_malformed_connections() {
    let t = start_with(tempfile::tempdir().unwrap(), |c| {
        c.limits.header_read_timeout = Duration::from_millis(700);
        c.limits.pending = PendingLimits {
            max_pending: 16,
            max_pending_per_source: 3,
        };
    })
    .await;
    let addr = t.server.api_addr;
    let good = get("/v2/clusters", &t.server.admin_key);

    // Slowloris from 127.0.0.1, a silent connection and an HTTP/2 preface without a request.
    let mut slow = slow_clients(
        source(1),
        addr,
        2,
        b"GET /v2/clusters HTTP/1.1\r\nhost: x\r\n",
    )
    .await;
    slow.push(connect_from(source(1), addr).await);
    let mut h2 = connect_from(source(2), addr).await;
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    slow.push(h2);
    // The address's fourth pending connection is refused at once (the listener admits in
    // accept order, so the three above come first); another address is served.
    let out = exchange_from(source(1), addr, b"").await;
    assert_eq!(status(&out), 429, "{out}");
    assert_eq!(header(&out, "retry-after"), Some("1"));
    let out = exchange_from(source(3), addr, &good).await;
    assert_eq!(status(&out), 200, "{out}");
    // All closed by the 700 ms deadline (`closed_by_server` fails after 10 s, and the default
    // deadline is 30 s): a silent client is not held.
    closed_by_server(&mut slow).await;
    assert_eq!(status(&exchange_from(source(1), addr, &good).await), 200);

    // Heads that must not be framed, and an oversized head.
    let admin = &t.server.admin_key;
    for (name, head) in [
        (
            "differing Content-Length",
            "content-length: 2\r\ncontent-length: 3\r\n",
        ),
        (
            "chunked, identity",
            "transfer-encoding: chunked, identity\r\n",
        ),
        ("obs-fold", "x-folded: a\r\n b\r\ncontent-length: 2\r\n"),
        (
            "CR in a value",
            "x-inject: a\rinjected: 1\r\ncontent-length: 2\r\n",
        ),
    ] {
        let request = format!(
            "POST /v2/clusters HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {admin}\r\n{head}\r\n{{}}GET /v2/clusters HTTP/1.1\r\nhost: x\r\n\r\n"
        );
        let out = exchange_from(source(4), addr, request.as_bytes()).await;
        assert_eq!(status(&out), 400, "{name}: {out}");
        assert_eq!(testkit::raw::answers(&out), 1, "{name}: {out}");
    }
    let huge = format!(
        "GET /v2/clusters HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
        "a".repeat(128 * 1024)
    );
    let out = exchange_from(source(4), addr, huge.as_bytes()).await;
    assert_eq!(status(&out), 431, "{out}");
    assert_eq!(status(&exchange_from(source(4), addr, &good).await), 200);
    t.stop().await;
}

#[tokio::test]
async fn failed_authentication_is_rate_limited_per_source() {
    let t = start_with(tempfile::tempdir().unwrap(), |c| {
        c.limits.auth = AuthLimits {
            max_failures: 3,
            window: Duration::from_secs(60),
            ..AuthLimits::default()
        };
    })
    .await;
    let addr = t.server.api_addr;
    let wrong = get(
        "/v2/clusters",
        "fdn_0000000000000000_00000000000000000000000000000000",
    );
    for i in 0..3 {
        let out = exchange_from(source(5), addr, &wrong).await;
        assert_eq!(status(&out), 401, "attempt {i}: {out}");
    }
    // Past the limit: a wrong key gets 429 with Retry-After, in GPUStack's error shape, up to
    // 100 failures; the admin key from the same address is served all the same.
    for _ in 3..100 {
        let out = exchange_from(source(5), addr, &wrong).await;
        assert_eq!(status(&out), 429, "{out}");
        let retry: u64 = header(&out, "retry-after").unwrap().parse().unwrap();
        assert!((1..=60).contains(&retry));
        let v = testkit::raw::json_body(&out);
        assert_eq!(v["reason"], "TooManyRequests", "{v}");
    }
    let out = exchange_from(source(5), addr, &get("/v2/clusters", &t.server.admin_key)).await;
    assert_eq!(status(&out), 200, "{out}");
    // Requests without a credential do not count; other addresses are served.
    for _ in 0..5 {
        let out = exchange_from(
            source(6),
            addr,
            b"GET /v2/clusters HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        .await;
        assert_eq!(status(&out), 401, "{out}");
    }
    let out = exchange_from(source(6), addr, &get("/v2/clusters", &t.server.admin_key)).await;
    assert_eq!(status(&out), 200, "{out}");
    t.stop().await;
}
