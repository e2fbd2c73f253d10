//! Orphans: an instance a worker reports for a model that no longer exists is kept, listed
//! with `?orphaned=true`, adopted into a model of its name, or deleted.

use serde_json::json;

use crate::common::*;

#[tokio::test]
async fn a_worker_reports_an_orphan_which_is_listed_and_adopted() {
    let t = start().await;
    let cluster = t.cluster("c").await;
    let (w, token) = t.register(&cluster, "w").await;
    let worker = t.admin.with_token(&token);
    // The model is gone: the worker's report keeps the instance, as an orphan.
    let orphan = worker
        .post(
            "/v2/model-instances",
            &json!({"model_name": "gone", "worker_id": w["id"], "port": 9001, "state": "running"}),
        )
        .await
        .expect(200)
        .json();
    assert_eq!(orphan["model_id"], 0);
    assert_eq!(orphan["model_name"], "gone");
    assert!(
        orphan["state_message"]
            .as_str()
            .unwrap()
            .starts_with("orphaned")
    );
    let id = orphan["id"].as_i64().unwrap();
    // An administrator cannot create one: a model name must exist for them.
    t.admin
        .post(
            "/v2/model-instances",
            &json!({"model_name": "nope", "worker_id": w["id"], "port": 9002}),
        )
        .await
        .expect(422);
    // A second report updates the same row.
    let again = worker
        .put(
            &format!("/v2/model-instances/{id}"),
            &json!({"model_name": "gone", "worker_id": w["id"], "port": 9001, "state": "running"}),
        )
        .await
        .expect(200)
        .json();
    assert_eq!(again["model_id"], 0);

    let m = t
        .admin
        .post("/v2/models", &json!({"name": "kept"}))
        .await
        .expect(200)
        .json();
    worker
        .post(
            "/v2/model-instances",
            &json!({"model_id": m["id"], "worker_id": w["id"], "port": 9003, "state": "running"}),
        )
        .await
        .expect(200);
    let listed = t
        .admin
        .get("/v2/model-instances?orphaned=true")
        .await
        .expect(200)
        .json();
    let ids: Vec<i64> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, [id]);
    let others = t
        .admin
        .get("/v2/model-instances?orphaned=false")
        .await
        .expect(200)
        .json();
    assert_eq!(others["items"].as_array().unwrap().len(), 1);

    // Adopting creates the model of its name and binds it.
    let adopted = t
        .admin
        .post(&format!("/v2/model-instances/{id}/adopt"), &json!({}))
        .await
        .expect(200)
        .json();
    let model_id = adopted["model_id"].as_i64().unwrap();
    assert_ne!(model_id, 0);
    let model = t
        .admin
        .get(&format!("/v2/models/{model_id}"))
        .await
        .expect(200)
        .json();
    assert_eq!(model["name"], "gone");
    assert_eq!(adopted["state_message"], serde_json::Value::Null);
    t.admin
        .post(&format!("/v2/model-instances/{id}/adopt"), &json!({}))
        .await
        .expect(409);
    let listed = t
        .admin
        .get("/v2/model-instances?orphaned=true")
        .await
        .expect(200)
        .json();
    assert_eq!(listed["items"], json!([]));
    // Deleting the model deletes its instances, as always.
    t.admin
        .delete(&format!("/v2/models/{model_id}"))
        .await
        .expect(204);
    t.admin
        .get(&format!("/v2/model-instances/{id}"))
        .await
        .expect(404);
    t.stop().await;
}
