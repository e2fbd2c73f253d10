use std::time::Duration;

use control::api::ApiConfig;
use control::server::{Server, ServerConfig};
use serde_json::{Value, json};
use testkit::Client;
use tokio_util::sync::CancellationToken;

pub struct TestServer {
    pub server: Server,
    pub admin: Client,
    pub shutdown: CancellationToken,
    pub dir: Data,
}

/// Where a test server keeps its state: a data directory, and with `FADEN_TEST_STORE=postgres`
/// a private PostgreSQL cluster (the whole suite then runs against PostgreSQL).
pub struct Data {
    pub dir: tempfile::TempDir,
    postgres: Option<testkit::postgres::Postgres>,
}

impl Data {
    /// A server configuration on this data.
    pub fn config(&self) -> ServerConfig {
        let mut cfg = config(self.dir.path());
        cfg.database_url = self.postgres.as_ref().map(|pg| pg.url());
        cfg
    }
}

impl From<tempfile::TempDir> for Data {
    fn from(dir: tempfile::TempDir) -> Self {
        let postgres = match std::env::var("FADEN_TEST_STORE").as_deref() {
            Ok("postgres") => Some(testkit::postgres::Postgres::start().unwrap()),
            Ok("sqlite") | Err(_) => None,
            Ok(other) => panic!("FADEN_TEST_STORE={other}: sqlite or postgres"),
        };
        Self { dir, postgres }
    }
}

pub fn config(dir: &std::path::Path) -> ServerConfig {
    ServerConfig {
        api: ApiConfig {
            heartbeat_timeout: Duration::from_millis(600),
            watch_heartbeat: Duration::from_millis(200),
            server_url: String::new(),
            ..ApiConfig::default()
        },
        history: 1000,
        shutdown_grace: Duration::from_secs(2),
        ..ServerConfig::new(dir, "127.0.0.1:0".parse().unwrap())
    }
}

pub async fn start() -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    start_with(dir, |_| {}).await
}

pub async fn start_with(dir: impl Into<Data>, tweak: impl FnOnce(&mut ServerConfig)) -> TestServer {
    let dir = dir.into();
    let mut cfg = dir.config();
    tweak(&mut cfg);
    let shutdown = CancellationToken::new();
    let server = Server::start(cfg, shutdown.clone()).await.unwrap();
    let admin = Client::new(format!("http://{}", server.api_addr)).with_token(&server.admin_key);
    TestServer {
        server,
        admin,
        shutdown,
        dir,
    }
}

impl TestServer {
    pub async fn stop(self) -> Data {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.server.wait())
            .await
            .unwrap();
        self.dir
    }

    pub async fn cluster(&self, name: &str) -> Value {
        self.admin
            .post("/v2/clusters", &json!({"name": name}))
            .await
            .expect(200)
            .json()
    }

    pub async fn key(&self, scope: &str) -> String {
        let reply = self
            .admin
            .post(
                "/v2/api-keys",
                &json!({"name": format!("{scope}-key"), "scope": scope}),
            )
            .await
            .expect(200);
        reply.json()["value"].as_str().unwrap().to_owned()
    }

    /// Registers a worker in `cluster` and returns (worker JSON, worker token).
    pub async fn register(&self, cluster: &Value, name: &str) -> (Value, String) {
        let token = cluster["registration_token"].as_str().unwrap();
        let reply = self
            .admin
            .with_token(token)
            .post(
                "/v2/workers",
                &json!({"name": name, "ip": "127.0.0.1", "proxy_mode": "direct"}),
            )
            .await
            .expect(200);
        let body = reply.json();
        let worker_token = body["token"].as_str().unwrap().to_owned();
        (body, worker_token)
    }
}

/// Polls `check` every 20 ms until it returns true or `limit` passes.
pub async fn eventually<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
