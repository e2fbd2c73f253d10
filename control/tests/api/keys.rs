use std::time::Duration;

use serde_json::json;

use crate::common::{eventually, start};

#[tokio::test]
async fn scopes_decide_between_401_and_403() {
    let t = start().await;
    let created = t
        .admin
        .post(
            "/v2/api-keys",
            &json!({"name": "svc", "scope": "inference"}),
        )
        .await
        .expect(200)
        .json();
    let value = created["value"].as_str().unwrap();
    let parts: Vec<&str> = value.split('_').collect();
    assert_eq!(parts.len(), 3);
    assert_eq!((parts[0], parts[1].len(), parts[2].len()), ("fdn", 16, 32));
    // Default scope is the least privilege.
    let default = t
        .admin
        .post("/v2/api-keys", &json!({"name": "d"}))
        .await
        .expect(200)
        .json();
    assert_eq!(default["scope"], "inference");

    let anon = t.admin.anonymous();
    anon.get("/v2/clusters").await.expect(401);
    let r = anon.get("/v2/clusters").await.json();
    assert_eq!(
        r,
        json!({"code": 401, "reason": "Unauthorized", "message": "Invalid authentication credentials"})
    );
    t.admin
        .with_token("garbage")
        .get("/v2/clusters")
        .await
        .expect(401);
    t.admin
        .with_token(format!("{value}0"))
        .get("/v2/clusters")
        .await
        .expect(401);
    // Right shape, wrong secret.
    let wrong = format!("{}_{}_{}", parts[0], parts[1], "0".repeat(32));
    t.admin
        .with_token(wrong)
        .get("/v2/clusters")
        .await
        .expect(401);
    // Valid key without the rights: 403.
    t.admin
        .with_token(value)
        .get("/v2/clusters")
        .await
        .expect(403);
    t.admin
        .with_token(value)
        .post("/v2/api-keys", &json!({"name": "x"}))
        .await
        .expect(403);
    // X-API-Key works too.
    let mut req = http::Request::builder()
        .uri(format!("{}/v2/clusters", t.admin.base()))
        .header("x-api-key", &t.server.admin_key)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    t.admin.anonymous().send_request(req).await.expect(200);
    req = http::Request::builder()
        .uri(format!("{}/v2/clusters", t.admin.base()))
        .header("authorization", format!("Basic {}", t.server.admin_key))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    t.admin.anonymous().send_request(req).await.expect(401);
    // management scope administers; data_plane reads routing state and the credential feed only.
    let mgmt = t.admin.with_token(t.key("management").await);
    mgmt.get("/v2/clusters").await.expect(200);
    let dp = t.admin.with_token(t.key("data_plane").await);
    dp.get("/v2/workers").await.expect(200);
    dp.get("/v2/credentials").await.expect(200);
    dp.get("/v2/clusters").await.expect(403);
    dp.get("/v2/api-keys").await.expect(403);
    t.admin
        .with_token(value)
        .get("/v2/credentials")
        .await
        .expect(403);
    t.stop().await;
}

#[tokio::test]
async fn list_and_feed_never_show_secrets() {
    let t = start().await;
    let created = t
        .admin
        .post("/v2/api-keys", &json!({"name": "k"}))
        .await
        .expect(200)
        .json();
    let secret = created["value"]
        .as_str()
        .unwrap()
        .rsplit('_')
        .next()
        .unwrap()
        .to_owned();
    let list = t.admin.get("/v2/api-keys").await.expect(200);
    assert!(!list.text().contains(&secret));
    assert!(
        list.json()["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k.get("value").is_none())
    );
    let one = t
        .admin
        .get(&format!("/v2/api-keys/{}", created["id"]))
        .await
        .expect(200);
    assert!(!one.text().contains(&secret));
    let feed = t.admin.get("/v2/credentials").await.expect(200);
    assert!(!feed.text().contains(&secret));
    let entry = feed.json()["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == created["id"])
        .cloned()
        .unwrap();
    assert_eq!(entry["secret_digest"].as_str().unwrap().len(), 64);
    assert_eq!(entry["access_id"], created["access_id"]);
    t.stop().await;
}

#[tokio::test]
async fn expiry_and_revocation() {
    let t = start().await;
    let short = t
        .admin
        .post(
            "/v2/api-keys",
            &json!({"name": "short", "scope": "management", "expires_in": 1}),
        )
        .await
        .expect(200)
        .json();
    let client = t.admin.with_token(short["value"].as_str().unwrap());
    client.get("/v2/clusters").await.expect(200);
    // Valid until its expiry a second from now, refused from then on.
    let expired = eventually(Duration::from_secs(10), || async {
        let status = client.get("/v2/clusters").await.status.as_u16();
        assert!(matches!(status, 200 | 401), "status {status}");
        status == 401
    })
    .await;
    assert!(expired, "the key was still accepted after its expiry");

    let past = chrono::Utc::now() - chrono::Duration::seconds(5);
    t.admin
        .post(
            "/v2/api-keys",
            &json!({"name": "p", "expires_at": past.to_rfc3339()}),
        )
        .await
        .expect(422);
    t.admin
        .post("/v2/api-keys", &json!({"name": "n", "expires_in": -1}))
        .await
        .expect(422);

    let key = t
        .admin
        .post("/v2/api-keys", &json!({"name": "r", "scope": "all"}))
        .await
        .expect(200)
        .json();
    let client = t.admin.with_token(key["value"].as_str().unwrap());
    client.get("/v2/clusters").await.expect(200);
    t.admin
        .delete(&format!("/v2/api-keys/{}", key["id"]))
        .await
        .expect(204);
    client.get("/v2/clusters").await.expect(401);
    t.admin
        .delete(&format!("/v2/api-keys/{}", key["id"]))
        .await
        .expect(404);
    t.stop().await;
}

#[tokio::test]
async fn admin_key_is_written_private_and_reused() {
    let dir = tempfile::tempdir().unwrap();
    let t = crate::common::start_with(dir, |_| {}).await;
    let path = t.server.admin_key_path.clone().unwrap();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let key = t.server.admin_key.clone();
    let dir = t.stop().await;
    let t = crate::common::start_with(dir, |_| {}).await;
    assert_eq!(t.server.admin_key, key);
    t.admin.get("/v2/clusters").await.expect(200);
    // FADEN_ADMIN_KEY overrides; a malformed one is refused at start.
    let dir = t.stop().await;
    let own = "fdn_0123456789abcdef_0123456789abcdef0123456789abcdef";
    let t = crate::common::start_with(dir, |c| c.admin_key = Some(own.to_owned())).await;
    t.admin
        .with_token(own)
        .get("/v2/clusters")
        .await
        .expect(200);
    let dir = t.stop().await;
    let mut cfg = dir.config();
    cfg.admin_key = Some("hunter2".to_owned());
    let err = control::server::Server::start(cfg, tokio_util::sync::CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("FADEN_ADMIN_KEY"), "{err}");
}
