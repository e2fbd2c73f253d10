use std::time::Duration;

use serde_json::json;

use control::api::set_proxy_address;

use crate::common::{eventually, start};

#[tokio::test]
async fn registration_heartbeat_and_timeout() {
    let t = start().await;
    let c = t.cluster("c").await;
    let reg = t
        .admin
        .with_token(c["registration_token"].as_str().unwrap());
    let body = json!({"name": "gpu-1", "ip": "10.1.2.3", "labels": {"gpu": "a100"}});
    let first = reg.post("/v2/workers", &body).await.expect(200).json();
    assert_eq!(first["state"], "not_ready");
    assert_eq!(first["cluster_id"], c["id"]);
    assert_eq!(first["port"], 10150);
    assert_eq!(first["metrics_port"], 10151);
    assert_eq!(first["proxy_mode"], "worker");
    assert!(first["worker_uuid"].as_str().is_some_and(|u| !u.is_empty()));
    assert!(first["token"].as_str().unwrap().starts_with("fdnw_"));
    assert!(first.get("worker_config").is_some());
    let id = first["id"].as_i64().unwrap();

    // Re-registering is idempotent: same row, same uuid; the new token replaces the old one.
    let again = reg.post("/v2/workers", &body).await.expect(200).json();
    assert_eq!(again["id"], id);
    assert_eq!(again["worker_uuid"], first["worker_uuid"]);
    let list = t.admin.get("/v2/workers").await.expect(200).json();
    assert_eq!(list["pagination"]["total"], 1);
    let old_token = t.admin.with_token(first["token"].as_str().unwrap());
    old_token
        .post("/v2/worker-heartbeat", &json!({}))
        .await
        .expect(401);

    let worker = t.admin.with_token(again["token"].as_str().unwrap());
    let beat = tokio::time::Instant::now();
    worker
        .post("/v2/worker-heartbeat", &json!({}))
        .await
        .expect(204);
    let got = t
        .admin
        .get(&format!("/v2/workers/{id}"))
        .await
        .expect(200)
        .json();
    assert_eq!(got["state"], "ready");
    assert!(got["heartbeat_time"].is_string());
    // The worker's token is never shown again.
    assert!(got.get("token").is_none());

    // No heartbeat for the (test-short) timeout: not_ready.
    let admin = t.admin.clone();
    let path = format!("/v2/workers/{id}");
    assert!(
        eventually(Duration::from_secs(10), || {
            let (admin, path) = (admin.clone(), path.clone());
            async move { admin.get(&path).await.json()["state"] == "not_ready" }
        })
        .await
    );
    // Marked at the second check that found it silent (checks every timeout / 4 = 150 ms),
    // never at the first.
    assert!(
        beat.elapsed() >= Duration::from_millis(750),
        "not_ready after {:?}",
        beat.elapsed()
    );
    let got = t.admin.get(&path).await.json();
    assert!(
        got["state_message"]
            .as_str()
            .unwrap()
            .contains("Heartbeat lost"),
        "{got}"
    );
    // A heartbeat brings it back.
    worker
        .post("/v2/worker-heartbeat", &json!({}))
        .await
        .expect(204);
    assert_eq!(t.admin.get(&path).await.json()["state"], "ready");
    // A worker sees itself only.
    let own = worker.get("/v2/workers").await.expect(200).json();
    assert_eq!(own["pagination"]["total"], 1);
    t.stop().await;
}

#[tokio::test]
async fn registration_needs_the_right_credential() {
    let t = start().await;
    let c = t.cluster("c").await;
    let other = t.cluster("other").await;
    let body = json!({"name": "w", "ip": "127.0.0.1"});
    t.admin
        .anonymous()
        .post("/v2/workers", &body)
        .await
        .expect(401);
    t.admin
        .with_token("fdnr_0000000000000000_00000000000000000000000000000000")
        .post("/v2/workers", &body)
        .await
        .expect(401);
    t.admin
        .with_token("gpustack_0000000000000000_00000000000000000000000000000000")
        .post("/v2/workers", &body)
        .await
        .expect(401);
    // An admin must name the cluster.
    let r = t.admin.post("/v2/workers", &body).await.expect(403);
    assert!(r.text().contains("cluster_id"));
    t.admin
        .post(
            "/v2/workers",
            &json!({"name": "w", "ip": "127.0.0.1", "cluster_id": c["id"]}),
        )
        .await
        .expect(200);
    // A registration token cannot register into another cluster.
    let reg = t
        .admin
        .with_token(c["registration_token"].as_str().unwrap());
    reg.post(
        "/v2/workers",
        &json!({"name": "x", "ip": "127.0.0.1", "cluster_id": other["id"]}),
    )
    .await
    .expect(403);
    // An inference key is authenticated but not allowed.
    let inference = t.admin.with_token(t.key("inference").await);
    inference.post("/v2/workers", &body).await.expect(403);
    // Bad fields.
    reg.post("/v2/workers", &json!({"name": "w", "ip": "not-an-ip"}))
        .await
        .expect(422);
    reg.post(
        "/v2/workers",
        &json!({"name": "w", "ip": "127.0.0.1", "port": 0}),
    )
    .await
    .expect(422);
    reg.post(
        "/v2/workers",
        &json!({"name": "w", "ip": "127.0.0.1", "proxy_mode": "ssh"}),
    )
    .await
    .expect(422);
    for bad in [json!(0), json!(-2), json!(65536), json!("10151")] {
        reg.post(
            "/v2/workers",
            &json!({"name": "w", "ip": "127.0.0.1", "metrics_port": bad}),
        )
        .await
        .expect(422);
    }
    // GPUStack's workers send -1 when they serve no metrics (`--disable-worker-metrics`).
    let quiet = reg
        .post(
            "/v2/workers",
            &json!({"name": "quiet", "ip": "127.0.0.1", "metrics_port": -1}),
        )
        .await
        .expect(200)
        .json();
    assert_eq!(quiet["metrics_port"], -1);
    // The registration token is only for registering.
    reg.get("/v2/workers").await.expect(403);
    reg.post("/v2/worker-heartbeat", &json!({}))
        .await
        .expect(403);
    t.stop().await;
}

#[tokio::test]
async fn instance_permissions() {
    let t = start().await;
    let c = t.cluster("c").await;
    let (w1, tok1) = t.register(&c, "w1").await;
    let (w2, tok2) = t.register(&c, "w2").await;
    let model = t
        .admin
        .post("/v2/models", &json!({"name": "llama"}))
        .await
        .expect(200)
        .json();
    let mid = model["id"].clone();
    let worker1 = t.admin.with_token(&tok1);
    let worker2 = t.admin.with_token(&tok2);

    // A worker creates instances on itself (worker_id may be omitted)…
    let inst = worker1
        .post(
            "/v2/model-instances",
            &json!({"model_id": mid, "port": 40000, "state": "starting"}),
        )
        .await
        .expect(200)
        .json();
    assert_eq!(inst["worker_id"], w1["id"]);
    assert_eq!(inst["model_name"], "llama");
    let iid = inst["id"].as_i64().unwrap();
    // …but not on another worker.
    worker1
        .post(
            "/v2/model-instances",
            &json!({"model_id": mid, "worker_id": w2["id"], "port": 1}),
        )
        .await
        .expect(403);
    // It updates its own, and cannot move it or touch another's.
    let path = format!("/v2/model-instances/{iid}");
    worker1
        .put(
            &path,
            &json!({"model_id": mid, "port": 40000, "state": "running"}),
        )
        .await
        .expect(200);
    worker2
        .put(
            &path,
            &json!({"model_id": mid, "port": 40000, "state": "error"}),
        )
        .await
        .expect(403);
    worker1
        .put(
            &path,
            &json!({"model_id": mid, "worker_id": w2["id"], "port": 40000, "state": "running"}),
        )
        .await
        .expect(403);
    worker2.delete(&path).await.expect(403);
    // Reads: the worker sees its own; others see nothing of it.
    worker1.get(&path).await.expect(200);
    worker2.get(&path).await.expect(404);
    assert_eq!(
        worker2.get("/v2/model-instances").await.json()["pagination"]["total"],
        0
    );
    // Keys: data_plane reads, cannot write; inference can do neither.
    let dp = t.admin.with_token(t.key("data_plane").await);
    dp.get(&path).await.expect(200);
    dp.put(
        &path,
        &json!({"model_id": mid, "port": 1, "state": "error"}),
    )
    .await
    .expect(403);
    let inference = t.admin.with_token(t.key("inference").await);
    inference.get(&path).await.expect(403);
    // Validation: running needs a port and a worker; unknown model/worker are 422.
    t.admin
        .post(
            "/v2/model-instances",
            &json!({"model_id": mid, "state": "running"}),
        )
        .await
        .expect(422);
    t.admin
        .post("/v2/model-instances", &json!({"model_id": 999}))
        .await
        .expect(422);
    t.admin
        .post(
            "/v2/model-instances",
            &json!({"model_id": mid, "worker_id": 999}),
        )
        .await
        .expect(422);
    t.admin
        .post(
            "/v2/model-instances",
            &json!({"model_id": mid, "state": "sleeping"}),
        )
        .await
        .expect(422);
    // Admins may do anything; deleting the model removes its instances.
    t.admin
        .put(
            &path,
            &json!({"model_id": mid, "worker_id": w2["id"], "port": 9, "state": "draining"}),
        )
        .await
        .expect(200);
    t.admin
        .delete(&format!("/v2/models/{mid}"))
        .await
        .expect(204);
    t.admin.get(&path).await.expect(404);
    t.stop().await;
}

#[tokio::test]
async fn models_are_unique_and_validated() {
    let t = start().await;
    t.admin
        .post("/v2/models", &json!({"name": "m"}))
        .await
        .expect(200);
    t.admin
        .post("/v2/models", &json!({"name": "m"}))
        .await
        .expect(409);
    t.admin
        .post("/v2/models", &json!({"name": "x", "cluster_id": 42}))
        .await
        .expect(422);
    let m2 = t
        .admin
        .post("/v2/models", &json!({"name": "n", "description": "d"}))
        .await
        .expect(200)
        .json();
    let path = format!("/v2/models/{}", m2["id"]);
    t.admin.put(&path, &json!({"name": "m"})).await.expect(409);
    let replaced = t
        .admin
        .put(&path, &json!({"name": "n2"}))
        .await
        .expect(200)
        .json();
    assert!(replaced.get("description").is_none());
    let list = t
        .admin
        .get("/v2/models?page=2&perPage=1")
        .await
        .expect(200)
        .json();
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    assert_eq!(
        list["pagination"],
        json!({"page": 2, "perPage": 1, "total": 2, "totalPage": 2})
    );
    // Everything in one answer: GPUStack's `page=-1`, and faden's older `perPage=-1`.
    for all in ["/v2/models?page=-1", "/v2/models?perPage=-1"] {
        let all = t.admin.get(all).await.expect(200).json();
        assert_eq!(all["items"].as_array().unwrap().len(), 2);
    }
    let all = t.admin.get("/v2/models?page=-1").await.expect(200).json();
    assert_eq!(all["pagination"]["page"], -1);
    t.admin.get("/v2/models?perPage=0").await.expect(422);
    t.admin.get("/v2/models?page=0").await.expect(422);
    t.admin.get("/v2/models?page=-2").await.expect(422);
    t.admin.get("/v2/models?page=abc").await.expect(400);
    t.stop().await;
}

/// A tunnel's owner records itself in `proxy_address`; when the tunnel ends, the record goes
/// only if it still names that owner: a late disconnect on the old server never clears the
/// tunnel the worker has meanwhile opened on another one.
#[tokio::test]
async fn only_the_owner_of_a_tunnel_clears_its_record() {
    let t = start().await;
    let c = t.cluster("c").await;
    let (w, _) = t.register(&c, "w").await;
    let id = w["id"].as_i64().unwrap();
    let record = |t: &crate::common::TestServer| {
        let admin = t.admin.clone();
        async move {
            admin
                .get(&format!("/v2/workers/{id}"))
                .await
                .expect(200)
                .json()["proxy_address"]
                .clone()
        }
    };
    let (a, b) = (
        "http://10.0.0.1:30079".to_owned(),
        "http://10.0.0.2:30079".to_owned(),
    );
    let store = &t.server.store;
    assert!(set_proxy_address(store, id, a.clone(), true).await.unwrap());
    assert_eq!(record(&t).await, a.as_str());
    // The worker's tunnel moved to B before A noticed its old one ended.
    set_proxy_address(store, id, b.clone(), true).await.unwrap();
    set_proxy_address(store, id, a.clone(), false)
        .await
        .unwrap();
    assert_eq!(
        record(&t).await,
        b.as_str(),
        "A's late disconnect kept B's record"
    );
    set_proxy_address(store, id, b, false).await.unwrap();
    assert!(record(&t).await.is_null());
    assert!(
        !set_proxy_address(store, 999, a, true).await.unwrap(),
        "no such worker"
    );
    t.stop().await;
}
