use std::time::Duration;

use serde_json::{Value, json};
use testkit::http_client::read_until;

use crate::common::{start, start_with};

fn events(buf: &str) -> Vec<Value> {
    buf.split("\n\n")
        .filter(|s| !s.trim().is_empty())
        .map(|s| serde_json::from_str(s).unwrap())
        .collect()
}

#[tokio::test]
async fn snapshot_then_events_then_heartbeats() {
    let t = start().await;
    t.admin
        .post("/v2/models", &json!({"name": "before"}))
        .await
        .expect(200);
    let resp = t.admin.stream("/v2/models?watch=true").await;
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    assert_eq!(resp.headers()["x-faden-watch"], "snapshot");
    let mut body = resp.into_body();
    let mut buf = String::new();
    assert!(
        read_until(&mut body, &mut buf, Duration::from_secs(5), |b| events(b)
            .len()
            == 1)
        .await
    );
    let snap = events(&buf);
    assert_eq!(snap[0]["type"], 1);
    assert_eq!(snap[0]["data"]["name"], "before");
    assert_eq!(snap[0]["id"], snap[0]["data"]["id"]);

    let m = t
        .admin
        .post("/v2/models", &json!({"name": "live"}))
        .await
        .expect(200)
        .json();
    let path = format!("/v2/models/{}", m["id"]);
    t.admin
        .put(&path, &json!({"name": "live", "description": "changed"}))
        .await
        .expect(200);
    t.admin.delete(&path).await.expect(204);
    assert!(
        read_until(&mut body, &mut buf, Duration::from_secs(5), |b| events(b)
            .len()
            == 4)
        .await,
        "{buf}"
    );
    let evs = events(&buf);
    let types: Vec<i64> = evs[1..]
        .iter()
        .map(|e| e["type"].as_i64().unwrap())
        .collect();
    assert_eq!(types, [1, 2, 3]);
    assert_eq!(evs[2]["data"]["description"], "changed");
    // Revisions increase strictly.
    let revs: Vec<u64> = evs[1..]
        .iter()
        .map(|e| e["revision"].as_u64().unwrap())
        .collect();
    assert!(revs.windows(2).all(|w| w[0] < w[1]), "{revs:?}");
    // Other kinds do not leak into this stream.
    t.cluster("not-a-model").await;
    // Idle: blank-line heartbeats (test period 200 ms).
    let len = buf.len();
    assert!(
        read_until(&mut body, &mut buf, Duration::from_secs(3), |b| b[len..]
            .contains("\n\n"))
        .await
    );
    assert!(
        buf[len..].trim().is_empty(),
        "only heartbeats expected, got {:?}",
        &buf[len..]
    );
    assert_eq!(events(&buf).len(), 4);
    t.stop().await;
}

#[tokio::test]
async fn resume_with_since_and_fall_back_to_snapshot() {
    let t = start().await;
    let list = t.admin.get("/v2/models").await.expect(200);
    let rev: u64 = list.headers["x-faden-revision"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let a = t
        .admin
        .post("/v2/models", &json!({"name": "a"}))
        .await
        .expect(200)
        .json();
    t.admin
        .post("/v2/models", &json!({"name": "b"}))
        .await
        .expect(200);
    t.admin
        .delete(&format!("/v2/models/{}", a["id"]))
        .await
        .expect(204);

    let resp = t
        .admin
        .stream(&format!("/v2/models?watch=true&since={rev}"))
        .await;
    assert_eq!(resp.headers()["x-faden-watch"], "resumed");
    let mut body = resp.into_body();
    let mut buf = String::new();
    assert!(
        read_until(&mut body, &mut buf, Duration::from_secs(5), |b| events(b)
            .len()
            == 3)
        .await
    );
    let evs = events(&buf);
    let seen: Vec<(i64, &str)> = evs
        .iter()
        .map(|e| {
            (
                e["type"].as_i64().unwrap(),
                e["data"]["name"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(seen, [(1, "a"), (1, "b"), (3, "a")]);
    // Resuming at the last revision gives nothing old, then live events.
    let last = evs[2]["revision"].as_u64().unwrap();
    let resp = t
        .admin
        .stream(&format!("/v2/models?watch=true&since={last}"))
        .await;
    assert_eq!(resp.headers()["x-faden-watch"], "resumed");
    let mut body = resp.into_body();
    let mut buf = String::new();
    t.admin
        .post("/v2/models", &json!({"name": "c"}))
        .await
        .expect(200);
    assert!(
        read_until(&mut body, &mut buf, Duration::from_secs(5), |b| !events(b)
            .is_empty())
        .await
    );
    assert_eq!(events(&buf)[0]["data"]["name"], "c");
    t.stop().await;
}

#[tokio::test]
async fn pruned_history_sends_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let t = start_with(dir, |c| c.history = 2).await;
    for name in ["a", "b", "c", "d", "e"] {
        t.admin
            .post("/v2/models", &json!({"name": name}))
            .await
            .expect(200);
    }
    let resp = t.admin.stream("/v2/models?watch=true&since=1").await;
    assert_eq!(resp.headers()["x-faden-watch"], "snapshot");
    let mut body = resp.into_body();
    let mut buf = String::new();
    assert!(
        read_until(&mut body, &mut buf, Duration::from_secs(5), |b| events(b)
            .len()
            == 5)
        .await
    );
    assert!(events(&buf).iter().all(|e| e["type"] == 1));
    t.stop().await;
}

#[tokio::test]
async fn every_resource_is_watchable_and_shutdown_ends_streams() {
    let t = start().await;
    let c = t.cluster("c").await;
    t.register(&c, "w").await;
    for path in [
        "/v2/clusters",
        "/v2/workers",
        "/v2/models",
        "/v2/model-instances",
        "/v2/credentials",
    ] {
        let resp = t.admin.stream(&format!("{path}?watch=true")).await;
        assert_eq!(resp.status(), 200, "{path}");
    }
    let resp = t.admin.stream("/v2/credentials?watch=true").await;
    let mut body = resp.into_body();
    let mut buf = String::new();
    // The admin key's credential is in the snapshot, without a secret.
    assert!(
        read_until(&mut body, &mut buf, Duration::from_secs(5), |b| !events(b)
            .is_empty())
        .await
    );
    let ev = &events(&buf)[0];
    assert_eq!(ev["data"]["scope"], "all");
    assert!(!buf.contains(t.server.admin_key.rsplit('_').next().unwrap()));
    // Shutdown ends open streams, so the server drains promptly.
    t.shutdown.cancel();
    let ended = read_until(&mut body, &mut buf, Duration::from_secs(5), |_| false).await;
    assert!(!ended);
    tokio::time::timeout(Duration::from_secs(5), t.server.wait())
        .await
        .unwrap();
}
