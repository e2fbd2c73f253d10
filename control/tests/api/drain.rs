//! `/v2/workers/{id}/drain`: the plan, consent by the count of stops, the heartbeat that tells a
//! worker it drains, its in-flight reports, `drained`, the deadline, and the end of a drain.

use serde_json::{Value, json};

use crate::common::*;

async fn instance(t: &TestServer, model: i64, worker: i64, port: u16) -> i64 {
    t.admin
        .post(
            "/v2/model-instances",
            &json!({"model_id": model, "worker_id": worker, "port": port, "state": "running"}),
        )
        .await
        .expect(200)
        .json()["id"]
        .as_i64()
        .unwrap()
}

fn actions(status: &Value) -> Vec<(String, String)> {
    status["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["model_name"].as_str().unwrap().to_owned(),
                i["action"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_drain_is_planned_confirmed_followed_and_ended() {
    let t = start().await;
    let cluster = t.cluster("c").await;
    let (w1, t1) = t.register(&cluster, "w1").await;
    let (w2, t2) = t.register(&cluster, "w2").await;
    let (id1, id2) = (w1["id"].as_i64().unwrap(), w2["id"].as_i64().unwrap());
    for token in [&t1, &t2] {
        t.admin
            .with_token(token)
            .post("/v2/worker-heartbeat", &json!({}))
            .await
            .expect(204);
    }
    let m = t
        .admin
        .post("/v2/models", &json!({"name": "m"}))
        .await
        .expect(200)
        .json()["id"]
        .as_i64()
        .unwrap();
    let only = t
        .admin
        .post("/v2/models", &json!({"name": "only"}))
        .await
        .expect(200)
        .json()["id"]
        .as_i64()
        .unwrap();
    instance(&t, m, id1, 9001).await;
    instance(&t, only, id1, 9002).await;
    instance(&t, m, id2, 9001).await;
    let drain = format!("/v2/workers/{id1}/drain");

    // The plan: m moves to w2, "only" would stop.
    let plan = t.admin.get(&drain).await.expect(200).json();
    assert_eq!(plan["state"], "ready");
    assert_eq!(plan["stops"], 1);
    assert_eq!(
        actions(&plan),
        [
            ("m".into(), "moves".into()),
            ("only".into(), "would_stop".into())
        ]
    );
    assert!(
        plan["instances"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("w2")
    );
    // Without consent nothing changes; a wrong count is a 409 with the plan.
    let asked = t.admin.post(&drain, &json!({})).await.expect(200).json();
    assert_eq!(asked["applied"], false);
    let wrong = t
        .admin
        .post(&drain, &json!({"confirm_stops": 0}))
        .await
        .expect(409)
        .json();
    assert_eq!(wrong["stops"], 1);
    let worker = t
        .admin
        .get(&format!("/v2/workers/{id1}"))
        .await
        .expect(200)
        .json();
    assert_eq!(worker["maintenance"], Value::Null);

    // Consent: draining; "only" keeps serving (routed), m does not.
    let started = t
        .admin
        .post(&drain, &json!({"confirm_stops": 1}))
        .await
        .expect(200)
        .json();
    assert_eq!(started["applied"], true);
    assert_eq!(started["state"], "draining");
    let routed: Vec<bool> = started["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["routed"].as_bool().unwrap())
        .collect();
    assert_eq!(routed, [false, true]);
    let worker = t
        .admin
        .get(&format!("/v2/workers/{id1}"))
        .await
        .expect(200)
        .json();
    assert_eq!(worker["maintenance"]["enabled"], true);
    assert_eq!(worker["maintenance"]["requested_by"], "admin");

    // The worker hears of it in its heartbeat's answer and reports what it has in flight.
    let beat = t
        .admin
        .with_token(&t1)
        .post("/v2/worker-heartbeat", &json!({}))
        .await
        .expect(200)
        .json();
    assert_eq!(beat["maintenance"]["enabled"], true);
    let reported = t
        .admin
        .with_token(&t1)
        .post(&drain, &json!({"in_flight": 0}))
        .await
        .expect(200)
        .json();
    assert_eq!(reported["state"], "draining", "\"only\" is still routed");
    // A replacement of "only" runs on w2: nothing of w1 is routed, nothing in flight.
    instance(&t, only, id2, 9002).await;
    let done = t.admin.get(&drain).await.expect(200).json();
    assert_eq!(done["state"], "drained");
    assert_eq!(done["stops"], 0);

    // The worker cannot end an administrator's drain; an administrator can.
    let kept = t
        .admin
        .with_token(&t1)
        .delete(&drain)
        .await
        .expect(200)
        .json();
    assert_eq!(kept["applied"], false);
    let ended = t.admin.delete(&drain).await.expect(200).json();
    assert_eq!(ended["state"], "ready");
    t.admin
        .with_token(&t1)
        .post("/v2/worker-heartbeat", &json!({}))
        .await
        .expect(204);
    // Another worker's token drains nothing of w1.
    t.admin
        .with_token(&t2)
        .post(&drain, &json!({}))
        .await
        .expect(403);
    t.stop().await;
}

#[tokio::test]
async fn a_drain_past_its_deadline_says_what_did_not_move() {
    let t = start().await;
    let cluster = t.cluster("c").await;
    let (w1, t1) = t.register(&cluster, "w1").await;
    let id1 = w1["id"].as_i64().unwrap();
    t.admin
        .with_token(&t1)
        .post("/v2/worker-heartbeat", &json!({}))
        .await
        .expect(204);
    let only = t
        .admin
        .post("/v2/models", &json!({"name": "only"}))
        .await
        .expect(200)
        .json()["id"]
        .as_i64()
        .unwrap();
    let inst = instance(&t, only, id1, 9002).await;
    let drain = format!("/v2/workers/{id1}/drain");
    let status = t
        .admin
        .post(&drain, &json!({"confirm_stops": 1, "deadline_seconds": 0}))
        .await
        .expect(200)
        .json();
    assert_eq!(status["state"], "draining");
    assert_eq!(
        status["not_moved"],
        json!([format!(
            "instance {inst} (only-{inst}) has not moved: the replacement did not start"
        )])
    );
    // The worker's own drain (it stops) needs no consent, and ends when it starts again.
    t.admin.delete(&drain).await.expect(200);
    let own = t
        .admin
        .with_token(&t1)
        .post(&drain, &json!({"in_flight": 2}))
        .await
        .expect(200)
        .json();
    assert_eq!(own["maintenance"]["requested_by"], "worker");
    assert_eq!(own["maintenance"]["in_flight"], 2);
    let ended = t
        .admin
        .with_token(&t1)
        .delete(&drain)
        .await
        .expect(200)
        .json();
    assert_eq!(ended["applied"], true);
    assert_eq!(ended["state"], "ready");
    // An administrator may take a worker's own drain over: it then outlives the worker's
    // restart (the worker cannot end it).
    t.admin
        .with_token(&t1)
        .post(&drain, &json!({"in_flight": 0}))
        .await
        .expect(200);
    let taken = t.admin.post(&drain, &json!({})).await.expect(200).json();
    assert_eq!(taken["applied"], true);
    assert_eq!(taken["maintenance"]["requested_by"], "admin");
    let again = t.admin.post(&drain, &json!({})).await.expect(200).json();
    assert_eq!(again["applied"], false);
    let kept = t
        .admin
        .with_token(&t1)
        .delete(&drain)
        .await
        .expect(200)
        .json();
    assert_eq!(kept["applied"], false);
    assert_eq!(kept["state"], "draining");
    t.stop().await;
}
