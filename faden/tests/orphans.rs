//! Orphans with the real binaries: a worker whose models were deleted while it was stopped
//! comes back serving them as orphans, listed by `?orphaned=true`; one is adopted and keeps
//! answering, the other is deleted: it stops answering, and its worker stops serving and reporting it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use common::*;

use std::net::SocketAddr;
use std::time::Duration;

use mock_engine::{MockEngine, MockEngineConfig};
use serde_json::{Value, json};
use testkit::process::start_faden_server;
use testkit::{wait_until, wait_until_async};

/// The status of a short chat request for `model`.
async fn status_of(gateway: SocketAddr, key: &str, model: &str) -> u16 {
    let body = json!({"model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]});
    match chat_body(gateway, key, body).await {
        Some(resp) => resp.status().as_u16(),
        None => 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_back_after_its_models_were_deleted_serves_them_as_orphans() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start_faden_server(bin(), &dir.path().join("server"), [0; 3], &[], &[]).await;
    let (reg, key) = provision(&server.admin).await;
    let key = key.as_str();
    let extra = server
        .admin
        .post("/v2/models", &json!({"name": "extra"}))
        .await
        .expect(200)
        .json();
    let demo_engine = engine(4, 1, 0).await;
    let extra_engine = MockEngine::start(MockEngineConfig {
        model: "extra".into(),
        tokens: 4,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut args = worker_args(
        &server.api_url(),
        &reg,
        "tunnel",
        demo_engine.port(),
        &dir.path().join("worker"),
    );
    args.extend([
        "--instance".to_owned(),
        format!("extra={}", extra_engine.port()),
        // The worker learns of deleted instances at its heartbeats.
        "--heartbeat-interval".to_owned(),
        "200ms".to_owned(),
    ]);
    let (mut worker, _) = start_worker(&args).await;
    let gw = server.gateway;
    for model in ["demo", "extra"] {
        wait_until_async(T, "served before", || async move {
            status_of(gw, key, model).await == 200
        })
        .await;
    }

    // The worker is away while both models are deleted.
    stop(&mut worker).await;
    let models = server.admin.get("/v2/models").await.expect(200).json();
    for m in models["items"].as_array().unwrap() {
        server
            .admin
            .delete(&format!("/v2/models/{}", m["id"]))
            .await
            .expect(204);
    }
    assert_ne!(extra["id"], Value::Null);
    wait_until_async(T, "demo unknown", || async move {
        status_of(gw, key, "demo").await == 404
    })
    .await;

    // Back: it reports both as orphans, which answer under their names.
    let (mut worker, _) = start_worker(&args).await;
    for model in ["demo", "extra"] {
        wait_until_async(T, "an orphan answers", || async move {
            status_of(gw, key, model).await == 200
        })
        .await;
    }
    let orphans = server
        .admin
        .get("/v2/model-instances?orphaned=true")
        .await
        .expect(200)
        .json();
    let items = orphans["items"].as_array().unwrap();
    let by_name = |name: &str| {
        items
            .iter()
            .find(|i| i["model_name"] == name)
            .unwrap_or_else(|| panic!("no orphan of {name}: {orphans}"))["id"]
            .as_i64()
            .unwrap()
    };
    let (demo_orphan, extra_orphan) = (by_name("demo"), by_name("extra"));
    assert_eq!(items.len(), 2);

    // Adopted: a model `demo` again, still answering.
    let adopted = server
        .admin
        .post(
            &format!("/v2/model-instances/{demo_orphan}/adopt"),
            &json!({}),
        )
        .await
        .expect(200)
        .json();
    assert_ne!(adopted["model_id"], 0);
    let demo = server
        .admin
        .get(&format!("/v2/models/{}", adopted["model_id"]))
        .await
        .expect(200)
        .json();
    assert_eq!(demo["name"], "demo");
    assert_eq!(status_of(gw, key, "demo").await, 200);
    // Deleted properly: `extra` stops answering.
    server
        .admin
        .delete(&format!("/v2/model-instances/{extra_orphan}"))
        .await
        .expect(204);
    wait_until_async(
        Duration::from_secs(10),
        "the deleted orphan stops",
        || async move { status_of(gw, key, "extra").await == 404 },
    )
    .await;
    // The worker learns it at its next heartbeat: it stops serving and reporting it.
    wait_until(T, "the worker retires the deleted orphan", || {
        worker.printed("the instance was deleted on the server")
    })
    .await;
    let listed = server
        .admin
        .get("/v2/model-instances")
        .await
        .expect(200)
        .json();
    let models: Vec<_> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["model_name"].clone())
        .collect();
    assert_eq!(models, [json!("demo")], "{listed}");
    assert_eq!(status_of(gw, key, "demo").await, 200);
    stop(&mut worker).await;
    server.kill().await;
}
