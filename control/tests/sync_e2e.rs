//! The sync client against the real faden server: it converges, follows changes (a revoked key
//! disappears from the snapshot within a second), and converges again after the server restarts,
//! including changes made while it was down.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::Duration;

use control::api::ApiConfig;
use control::server::{Server, ServerConfig};
use control::store::{self, Kind, Store};
use control_client::model::{EventType, InstanceState, ModelInstance};
use control_client::sync::{self, SyncConfig, SyncHandle};
use serde_json::json;
use testkit::Client;
use tokio_util::sync::CancellationToken;

fn config(dir: &std::path::Path, addr: SocketAddr) -> ServerConfig {
    ServerConfig {
        api: ApiConfig {
            heartbeat_timeout: Duration::from_secs(60),
            watch_heartbeat: Duration::from_millis(200),
            server_url: String::new(),
            ..ApiConfig::default()
        },
        history: 1000,
        shutdown_grace: Duration::from_secs(1),
        ..ServerConfig::new(dir, addr)
    }
}

async fn wait_for(
    sync: &SyncHandle,
    what: &str,
    check: impl Fn(&control_client::routing::RoutingSnapshot) -> bool,
) {
    let mut rx = sync.snapshots();
    let ok = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if check(&sync.current()) {
                return;
            }
            if rx.changed().await.is_err() {
                panic!("sync stopped");
            }
        }
    })
    .await;
    assert!(ok.is_ok(), "timed out waiting for: {what}");
}

#[tokio::test]
async fn sync_follows_the_server_and_converges_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let stop1 = CancellationToken::new();
    let server = Server::start(
        config(dir.path(), "127.0.0.1:0".parse().unwrap()),
        stop1.clone(),
    )
    .await
    .unwrap();
    let addr = server.api_addr;
    let admin = Client::new(format!("http://{addr}")).with_token(&server.admin_key);

    // A cluster, a ready direct-mode worker, a model with a running instance.
    let cluster = admin
        .post("/v2/clusters", &json!({"name": "c"}))
        .await
        .expect(200)
        .json();
    let reg = admin.with_token(cluster["registration_token"].as_str().unwrap());
    let worker = reg
        .post(
            "/v2/workers",
            &json!({"name": "w", "ip": "127.0.0.1", "proxy_mode": "direct"}),
        )
        .await
        .expect(200)
        .json();
    let wclient = admin.with_token(worker["token"].as_str().unwrap());
    wclient
        .post("/v2/worker-heartbeat", &json!({}))
        .await
        .expect(204);
    let model = admin
        .post("/v2/models", &json!({"name": "demo"}))
        .await
        .expect(200)
        .json();
    let inst = wclient
        .post(
            "/v2/model-instances",
            &json!({"model_id": model["id"], "port": 40001, "state": "running"}),
        )
        .await
        .expect(200)
        .json();

    let dp_key = admin
        .post(
            "/v2/api-keys",
            &json!({"name": "gateway", "scope": "data_plane"}),
        )
        .await
        .expect(200)
        .json()["value"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut cfg = SyncConfig::new(format!("http://{addr}"), &dp_key);
    cfg.backoff_min = Duration::from_millis(20);
    cfg.backoff_max = Duration::from_millis(200);
    cfg.idle_timeout = Duration::from_secs(2);
    let cancel = CancellationToken::new();
    let sync = sync::spawn(cfg, cancel.clone()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), sync.wait_synced())
        .await
        .unwrap();
    wait_for(&sync, "demo routable", |s| {
        s.route("demo").is_some_and(|r| r.endpoints.len() == 1)
    })
    .await;
    let ep = sync.current().route("demo").unwrap().endpoints[0].clone();
    assert_eq!(
        (ep.address.as_str(), ep.instance_port),
        ("127.0.0.1", 40001)
    );

    // A user key verifies locally; revoking it reaches the gateway on the live watch.
    let user = admin
        .post("/v2/api-keys", &json!({"name": "u"}))
        .await
        .expect(200)
        .json();
    let user_key = user["value"].as_str().unwrap().to_owned();
    let now = chrono::Utc::now;
    wait_for(&sync, "key synced", |s| {
        s.verify_key(&user_key, now()).is_ok()
    })
    .await;
    admin
        .delete(&format!("/v2/api-keys/{}", user["id"]))
        .await
        .expect(204);
    let failed = sync.failed_sessions();
    let revoked_at = tokio::time::Instant::now();
    wait_for(&sync, "key revoked", |s| {
        s.verify_key(&user_key, now()).is_err()
    })
    .await;
    eprintln!("revocation took {:?}", revoked_at.elapsed());
    // Not through a broken stream's re-list: no session failed meanwhile.
    assert_eq!(sync.failed_sessions(), failed);

    // Stop the server; change the store while it is down (as another server version or an
    // operator would); bring it back on the same address.
    stop1.cancel();
    server.wait().await;
    let store = Store::open(&dir.path().join(control::server::DB_FILE))
        .await
        .unwrap();
    let inst_id = inst["id"].as_i64().unwrap();
    store
        .write(async move |tx| -> Result<(), store::StoreError> {
            let mut i: ModelInstance = store::get(tx.sql(), Kind::ModelInstances, inst_id)
                .await?
                .unwrap();
            i.state = InstanceState::Draining;
            tx.sql()
                .execute(
                    "UPDATE model_instances SET data = $1 WHERE id = $2",
                    control::args![serde_json::to_string(&i)?, inst_id],
                )
                .await?;
            tx.emit(Kind::ModelInstances, EventType::Updated, inst_id, &i)
                .await
        })
        .await
        .unwrap();
    drop(store);
    // While the server is away the gateway keeps its last snapshot, through failed reconnects.
    let failed = sync.failed_sessions();
    testkit::wait_until(
        Duration::from_secs(20),
        "reconnects failed while the server is away",
        || sync.failed_sessions() >= failed + 4,
    )
    .await;
    assert!(!sync.current().route("demo").unwrap().endpoints.is_empty());

    let stop2 = CancellationToken::new();
    let server = Server::start(config(dir.path(), addr), stop2.clone())
        .await
        .unwrap();
    let back = tokio::time::Instant::now();
    wait_for(&sync, "offline change applied", |s| {
        s.route("demo").is_some_and(|r| r.endpoints.is_empty())
    })
    .await;
    eprintln!("converged {:?} after the restart", back.elapsed());
    // And live changes flow again.
    wclient
        .put(
            &format!("/v2/model-instances/{inst_id}"),
            &json!({"model_id": model["id"], "port": 40002, "state": "running"}),
        )
        .await
        .expect(200);
    wait_for(&sync, "instance back", |s| {
        s.route("demo").is_some_and(|r| {
            r.endpoints
                .first()
                .is_some_and(|e| e.instance_port == 40002)
        })
    })
    .await;
    // Every resource heard from again since the server came back.
    testkit::wait_until(Duration::from_secs(10), "every resource heard from", || {
        sync.staleness().unwrap() < back.elapsed()
    })
    .await;
    cancel.cancel();
    stop2.cancel();
    server.wait().await;
}
