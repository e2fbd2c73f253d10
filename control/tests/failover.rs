//! The management API's clients given several server URLs (servers sharing one database): the
//! API client and the sync client skip a server that cannot be reached, and the sync client
//! carries on with another server of the same PostgreSQL database when its server stops.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use control::api::ApiConfig;
use control::server::{Server, ServerConfig};
use control_client::client::ApiClient;
use control_client::sync::{self, SyncConfig, SyncHandle, SyncedObjects};
use http::{Method, StatusCode};
use serde_json::json;
use testkit::Client;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(10);

/// A URL nothing listens on: the port is bound but not listening, so connections are refused
/// and no other test can take it meanwhile. Keep the socket as long as the URL is used.
fn dead_url() -> (tokio::net::TcpSocket, String) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    (socket, format!("http://{addr}"))
}

/// A server on 127.0.0.1:0 with its data in `dir`, on `database_url` when given (else SQLite).
struct TestServer {
    server: Server,
    stop: CancellationToken,
    _dir: tempfile::TempDir,
}

impl TestServer {
    async fn start(database_url: Option<String>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = ServerConfig {
            database_url,
            api: ApiConfig {
                heartbeat_timeout: Duration::from_secs(60),
                watch_heartbeat: Duration::from_millis(200),
                server_url: String::new(),
                ..ApiConfig::default()
            },
            history: 1000,
            shutdown_grace: Duration::from_secs(1),
            ..ServerConfig::new(dir.path(), "127.0.0.1:0".parse().unwrap())
        };
        let stop = CancellationToken::new();
        let server = Server::start(config, stop.clone()).await.unwrap();
        Self {
            server,
            stop,
            _dir: dir,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.server.api_addr)
    }

    fn admin(&self) -> Client {
        Client::new(self.url()).with_token(&self.server.admin_key)
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(WAIT, self.server.wait())
            .await
            .expect("the server did not stop in time");
    }
}

fn sync_config(urls: &[String], key: &str) -> SyncConfig {
    let mut config = SyncConfig::with_urls(urls.iter().cloned(), key);
    config.backoff_min = Duration::from_millis(20);
    config.backoff_max = Duration::from_millis(200);
    config.idle_timeout = Duration::from_secs(2);
    config
}

/// Waits, snapshot by snapshot, until the synced objects pass `check`.
async fn until(sync: &SyncHandle, what: &str, check: impl Fn(&SyncedObjects) -> bool) {
    let mut snapshots = sync.snapshots();
    let done = tokio::time::timeout(WAIT, async {
        while !check(&sync.objects()) {
            snapshots.changed().await.expect("the sync stopped");
        }
    })
    .await;
    assert!(done.is_ok(), "timed out waiting for: {what}");
}

fn has_model(name: &str) -> impl Fn(&SyncedObjects) -> bool + '_ {
    move |objects| objects.models.values().any(|m| m.name == name)
}

#[tokio::test]
async fn the_api_client_stays_on_the_server_that_answered() {
    let (_reserved, dead) = dead_url();
    let a = TestServer::start(None).await;
    let b = TestServer::start(None).await;
    let key = a.server.admin_key.clone();

    // The first URL refuses connections: the call is answered by the second, and calls stay
    // there, for clones too.
    let api = ApiClient::with_urls(&[dead.clone(), a.url()], None).unwrap();
    assert_eq!(api.base(), dead);
    let clone = api.clone();
    let (status, body) = api.call(Method::GET, "/healthz", "", None).await.unwrap();
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok"[..]));
    assert_eq!(api.base(), a.url());
    assert_eq!(clone.base(), a.url());
    let (status, _) = clone
        .call(Method::GET, "/v2/clusters", &key, None)
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);

    // An HTTP error answer is an answer: no other server is asked.
    let api = ApiClient::with_urls(&[a.url(), b.url()], None).unwrap();
    let (status, _) = api
        .call(Method::GET, "/v2/clusters", "not-a-key", None)
        .await
        .unwrap();
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(api.base(), a.url());

    // No server reachable: the error names the URLs tried.
    let (_reserved2, dead2) = dead_url();
    let api = ApiClient::with_urls(&[dead.clone(), dead2.clone()], None).unwrap();
    let err = api
        .call(Method::GET, "/healthz", "", None)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(&dead2), "{err}");

    // Every URL is checked up front.
    let err = ApiClient::with_urls(&[a.url(), "ftp://x".to_owned()], None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("ftp://x"), "{err}");
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn the_sync_client_syncs_from_the_second_url_when_the_first_is_dead() {
    let (_reserved, dead) = dead_url();
    let srv = TestServer::start(None).await;
    srv.admin()
        .post("/v2/models", &json!({"name": "demo"}))
        .await
        .expect(200);
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let sync = sync::spawn(
        sync_config(&[dead, srv.url()], &srv.server.admin_key),
        cancel,
    )
    .unwrap();
    tokio::time::timeout(WAIT, sync.wait_synced())
        .await
        .expect("not synced in time");
    until(&sync, "demo synced", has_model("demo")).await;
    srv.stop().await;
}

/// Two servers on one PostgreSQL database: the sync client follows A, A stops, and changes
/// made through B arrive (the watch resumes on B from A's revision: they share revisions).
#[tokio::test]
async fn the_sync_client_moves_to_another_server_of_the_same_database() {
    let pg = testkit::postgres::Postgres::start().unwrap();
    let a = TestServer::start(Some(pg.url())).await;
    let b = TestServer::start(Some(pg.url())).await;
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let sync = sync::spawn(
        sync_config(&[a.url(), b.url()], &a.server.admin_key),
        cancel,
    )
    .unwrap();
    tokio::time::timeout(WAIT, sync.wait_synced())
        .await
        .expect("not synced in time");
    a.admin()
        .post("/v2/models", &json!({"name": "one"}))
        .await
        .expect(200);
    until(&sync, "model one (written through A)", has_model("one")).await;
    let before = sync.objects().revision;

    a.stop().await;
    b.admin()
        .post("/v2/models", &json!({"name": "two"}))
        .await
        .expect(200);
    until(&sync, "model two (written through B)", has_model("two")).await;
    assert!(has_model("one")(&sync.objects()));
    assert!(sync.objects().revision > before);
    b.stop().await;
}
