//! `/v2/worker-load`: workers report their own instances' load; readers see it, once or as a
//! stream; nothing of it reaches the event log.

use std::time::Duration;

use http::Method;
use serde_json::{Value, json};

use crate::common::{self, eventually};

fn line(id: i64, waiting: u32, age_ms: u64) -> String {
    format!(
        "{}\n",
        json!({"readings": [{"id": id, "waiting": waiting, "running": 1, "kv_usage": 0.5,
            "block_size": 16, "num_blocks": 64, "epoch": 3, "age_ms": age_ms}]})
    )
}

#[tokio::test]
async fn a_worker_reports_its_own_instances_only() {
    let t = common::start().await;
    let cluster = t.cluster("c").await;
    let (_, tok1) = t.register(&cluster, "w1").await;
    let (_, tok2) = t.register(&cluster, "w2").await;
    let model = t
        .admin
        .post("/v2/models", &json!({"name": "m"}))
        .await
        .expect(200)
        .json();
    let mine = |token: &str, port: u16| {
        let worker = t.admin.with_token(token);
        let model_id = model["id"].clone();
        async move {
            worker
                .post(
                    "/v2/model-instances",
                    &json!({"model_id": model_id, "port": port, "state": "running"}),
                )
                .await
                .expect(200)
                .json()["id"]
                .as_i64()
                .unwrap()
        }
    };
    let (i1, i2) = (mine(&tok1, 1000).await, mine(&tok2, 2000).await);
    let reader = t.admin.with_token(t.key("data_plane").await);
    let inference = t.admin.with_token(t.key("inference").await);
    let revision_before = t.admin.get("/v2/workers").await;
    let revision_before = revision_before.headers["x-faden-revision"].clone();

    let w1 = t.admin.with_token(&tok1);
    // Its own instance, and one the server does not know (dropped): accepted.
    let body = format!("{}{}", line(i1, 4, 10), line(999_999, 1, 0));
    w1.send(Method::POST, "/v2/worker-load", body)
        .await
        .expect(204);
    let table = reader.get("/v2/worker-load").await.expect(200).json();
    let readings = table["readings"].as_array().unwrap();
    assert_eq!(readings.len(), 1, "{table}");
    assert_eq!(readings[0]["id"], i1);
    assert_eq!(readings[0]["waiting"], 4);
    assert_eq!(readings[0]["epoch"], 3);
    assert!(readings[0]["age_ms"].as_u64().unwrap() >= 10);
    assert_eq!(t.server.engine_loads.all().len(), 1);

    // Another worker's instance: refused, and nothing of it is taken.
    let reply = w1
        .send(Method::POST, "/v2/worker-load", line(i2, 9, 0))
        .await;
    assert_eq!(reply.status, 403, "{}", reply.text());
    assert!(
        t.server
            .engine_loads
            .get(i2, tokio::time::Instant::now())
            .is_none()
    );

    // Readers read, workers and inference keys do not report for others nor read.
    inference.get("/v2/worker-load").await.expect(403);
    w1.get("/v2/worker-load").await.expect(403);
    reader
        .send(Method::POST, "/v2/worker-load", line(i1, 1, 0))
        .await
        .expect(403);
    t.admin.anonymous().get("/v2/worker-load").await.expect(401);

    // Too old to route by, a malformed line, a line too long: not taken.
    let w2 = t.admin.with_token(&tok2);
    w2.send(Method::POST, "/v2/worker-load", line(i2, 5, 5_000))
        .await
        .expect(204);
    assert!(
        t.server
            .engine_loads
            .get(i2, tokio::time::Instant::now())
            .is_none()
    );
    w2.send(
        Method::POST,
        "/v2/worker-load",
        "{\"readings\":[{\"id\":\"x\"}]}\n",
    )
    .await
    .expect(400);
    let long = format!(
        "{{\"readings\":[],\"pad\":\"{}\"}}\n",
        "x".repeat(300 * 1024)
    );
    w2.send(Method::POST, "/v2/worker-load", long)
        .await
        .expect(413);

    // Nothing went through the store.
    let revision_after = t.admin.get("/v2/workers").await;
    assert_eq!(revision_after.headers["x-faden-revision"], revision_before);
    t.stop().await;
}

/// The watch stream starts with the table and follows the reports; a reading nobody refreshes
/// goes stale and out of the table.
#[tokio::test]
async fn watchers_follow_the_reports() {
    let t = common::start().await;
    let cluster = t.cluster("c").await;
    let (_, token) = t.register(&cluster, "w").await;
    t.admin
        .post("/v2/models", &json!({"name": "m"}))
        .await
        .expect(200);
    let models = t.admin.get("/v2/models").await.json();
    let id = t
        .admin
        .with_token(&token)
        .post(
            "/v2/model-instances",
            &json!({"model_id": models["items"][0]["id"], "port": 1, "state": "running"}),
        )
        .await
        .expect(200)
        .json()["id"]
        .as_i64()
        .unwrap();
    let worker = t.admin.with_token(&token);
    worker
        .send(Method::POST, "/v2/worker-load", line(id, 1, 0))
        .await
        .expect(204);

    let reader = t.admin.with_token(t.key("data_plane").await);
    let mut stream = reader.stream("/v2/worker-load?watch=true").await;
    assert_eq!(stream.status(), 200);
    assert_eq!(stream.headers()["content-type"], "application/x-ndjson");
    let mut seen = String::new();
    let first = next_line(&mut stream, &mut seen).await;
    assert_eq!(first["readings"][0]["waiting"], 1, "the table first");
    worker
        .send(Method::POST, "/v2/worker-load", line(id, 7, 0))
        .await
        .expect(204);
    loop {
        let line = next_line(&mut stream, &mut seen).await;
        if line["readings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["waiting"] == 7)
        {
            break;
        }
    }
    // No more reports: the reading goes stale (2 s) and leaves the table.
    assert!(
        eventually(Duration::from_secs(10), || async {
            let table = reader.get("/v2/worker-load").await.json();
            table["readings"].as_array().is_some_and(Vec::is_empty)
        })
        .await
    );
    assert!(
        eventually(Duration::from_secs(10), || async {
            t.server.engine_loads.all().is_empty()
        })
        .await,
        "the server's writer drops stale readings without new reports"
    );
    t.stop().await;
}

/// The next non-empty line of an NDJSON stream, within 10 s.
async fn next_line(stream: &mut http::Response<hyper::body::Incoming>, buf: &mut String) -> Value {
    use http_body_util::BodyExt;
    loop {
        if let Some(at) = buf.find('\n') {
            let line: String = buf.drain(..=at).collect();
            if line.trim().is_empty() {
                continue;
            }
            return serde_json::from_str(&line).unwrap();
        }
        let frame = tokio::time::timeout(Duration::from_secs(10), stream.body_mut().frame())
            .await
            .expect("a line within 10 s")
            .expect("the stream goes on")
            .unwrap();
        if let Ok(data) = frame.into_data() {
            buf.push_str(&String::from_utf8_lossy(&data));
        }
    }
}
