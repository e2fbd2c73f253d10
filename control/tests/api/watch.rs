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
        read_until(&mut body, &mut buf, Duration::from_secs(10), |b| events(b)
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
        read_until(&mut body, &mut buf, Duration::from_secs(10), |b| events(b)
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
    // Without `since`, GPUStack's keys only (its watch clients refuse others): no revision.
    for e in &evs {
        let mut keys: Vec<&str> = e.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["data", "id", "type"], "{e}");
    }
    // Other kinds do not leak into this stream.
    t.cluster("not-a-model").await;
    // Idle: blank-line heartbeats (test period 200 ms).
    let len = buf.len();
    assert!(
        read_until(&mut body, &mut buf, Duration::from_secs(10), |b| b[len..]
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
        read_until(&mut body, &mut buf, Duration::from_secs(10), |b| events(b)
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
    // With `since`, every event carries its revision, strictly increasing.
    let revs: Vec<u64> = evs
        .iter()
        .map(|e| e["revision"].as_u64().unwrap())
        .collect();
    assert!(revs.windows(2).all(|w| w[0] < w[1]), "{revs:?}");
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
        read_until(&mut body, &mut buf, Duration::from_secs(10), |b| !events(b)
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
        read_until(&mut body, &mut buf, Duration::from_secs(10), |b| events(b)
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
        read_until(&mut body, &mut buf, Duration::from_secs(10), |b| !events(b)
            .is_empty())
        .await
    );
    let ev = &events(&buf)[0];
    assert_eq!(ev["data"]["scope"], "all");
    assert!(!buf.contains(t.server.admin_key.rsplit('_').next().unwrap()));
    // Shutdown ends open streams, so the server drains promptly.
    t.shutdown.cancel();
    let ended = read_until(&mut body, &mut buf, Duration::from_secs(10), |_| false).await;
    assert!(!ended);
    tokio::time::timeout(Duration::from_secs(10), t.server.wait())
        .await
        .unwrap();
}

/// A worker watches its own instances (GPUStack's worker watches one by `id`): the snapshot and
/// the live events hold only those; another worker's stay out.
#[tokio::test]
async fn workers_watch_only_their_own_instances() {
    let t = start().await;
    let cluster = t.cluster("c").await;
    let (me, my_token) = t.register(&cluster, "me").await;
    let (other, _) = t.register(&cluster, "other").await;
    let model = t
        .admin
        .post("/v2/models", &json!({"name": "m"}))
        .await
        .expect(200)
        .json();
    let instance = |worker: &Value| json!({"model_id": model["id"], "worker_id": worker["id"]});
    let mine = t
        .admin
        .post("/v2/model-instances", &instance(&me))
        .await
        .expect(200)
        .json();
    t.admin
        .post("/v2/model-instances", &instance(&other))
        .await
        .expect(200);
    let worker = t.admin.with_token(&my_token);
    let all = worker.stream("/v2/model-instances?watch=true").await;
    let one = worker
        .stream(&format!("/v2/model-instances?watch=true&id={}", mine["id"]))
        .await;
    assert_eq!((all.status().as_u16(), one.status().as_u16()), (200, 200));
    // Live: another of mine and another of the other worker's, then a change of mine.
    t.admin
        .post("/v2/model-instances", &instance(&other))
        .await
        .expect(200);
    let second = t
        .admin
        .post("/v2/model-instances", &instance(&me))
        .await
        .expect(200)
        .json();
    t.admin
        .put(
            &format!("/v2/model-instances/{}", mine["id"]),
            &json!({"model_id": model["id"], "worker_id": me["id"], "state": "starting"}),
        )
        .await
        .expect(200);
    let (mut all, mut one) = (all.into_body(), one.into_body());
    let (mut all_buf, mut one_buf) = (String::new(), String::new());
    let t10 = Duration::from_secs(10);
    assert!(read_until(&mut all, &mut all_buf, t10, |b| events(b).len() == 3).await);
    assert!(read_until(&mut one, &mut one_buf, t10, |b| events(b).len() == 2).await);
    let ids = |buf: &str| -> Vec<(i64, i64)> {
        events(buf)
            .iter()
            .map(|e| (e["type"].as_i64().unwrap(), e["id"].as_i64().unwrap()))
            .collect()
    };
    let (m, s) = (mine["id"].as_i64().unwrap(), second["id"].as_i64().unwrap());
    assert_eq!(ids(&all_buf), [(1, m), (1, s), (2, m)]);
    assert_eq!(ids(&one_buf), [(1, m), (2, m)]);
    // The other worker's instances, created between these, would have come in revision order
    // before the last event: none did.
}

/// GPUStack's resources that faden does not manage, which GPUStack's workers watch from
/// start-up: empty lists whatever the query, watches of heartbeats only (ended by shutdown),
/// 404 for one object; registration tokens refused.
#[tokio::test]
async fn unmanaged_gpustack_resources_are_empty() {
    let t = start().await;
    let cluster = t.cluster("c").await;
    let (_, token) = t.register(&cluster, "w").await;
    let worker = t.admin.with_token(&token);
    for path in [
        "/v2/inference-backends",
        "/v2/benchmarks",
        "/v2/cache-providers",
        "/v2/cache-services",
        "/v2/cache-service-instances",
        "/v2/model-files",
    ] {
        let list = worker
            .get(&format!("{path}?page=0&worker_id=1&anything=x"))
            .await
            .expect(200)
            .json();
        assert_eq!(list["items"], json!([]), "{path}");
        assert_eq!(list["pagination"]["total"], 0, "{path}");
        worker.get(&format!("{path}/1")).await.expect(404);
        t.admin.get(path).await.expect(200);
    }
    assert_eq!(
        worker
            .get("/v2/inference-backends/all")
            .await
            .expect(200)
            .json(),
        json!([])
    );
    let registration = t
        .admin
        .with_token(cluster["registration_token"].as_str().unwrap());
    registration.get("/v2/benchmarks").await.expect(403);
    // GPUStack's worker finds itself with `me=true`.
    let me = worker.get("/v2/workers?me=true").await.expect(200).json();
    assert_eq!(me["pagination"]["total"], 1);
    let resp = worker.stream("/v2/model-files?watch=true").await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut buf = String::new();
    assert!(
        read_until(&mut body, &mut buf, Duration::from_secs(10), |b| b
            .starts_with("\n\n"))
        .await
    );
    assert!(events(&buf).is_empty());
    t.shutdown.cancel();
    let ended = read_until(&mut body, &mut buf, Duration::from_secs(10), |_| false).await;
    assert!(!ended, "the stream outlived the server");
    assert!(events(&buf).is_empty());
    tokio::time::timeout(Duration::from_secs(10), t.server.wait())
        .await
        .unwrap();
}
