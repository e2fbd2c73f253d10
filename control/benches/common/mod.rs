//! What the store benchmarks share: a runtime, a private PostgreSQL cluster and servers on it
//! (or on SQLite), all running until the process ends.

use std::time::Duration;

use control::server::{Server, ServerConfig};
use testkit::postgres::Postgres;
use tokio_util::sync::CancellationToken;

pub struct Bench {
    pub rt: tokio::runtime::Runtime,
    pub pg: Postgres,
    pub shutdown: CancellationToken,
    dir: tempfile::TempDir,
}

impl Bench {
    /// `None` (with the reason printed) when no runtime can be made.
    pub fn new() -> Option<Self> {
        let rt = match tokio::runtime::Runtime::new() {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("no runtime: {e}");
                return None;
            }
        };
        Some(Self {
            rt,
            pg: Postgres::start().expect("a private PostgreSQL cluster"),
            shutdown: CancellationToken::new(),
            dir: tempfile::tempdir().expect("tempdir"),
        })
    }

    /// A server with its data in `sub`, on SQLite or on the PostgreSQL database `database_url`.
    pub async fn server(&self, sub: &str, database_url: Option<String>) -> Server {
        let config = ServerConfig {
            database_url,
            shutdown_grace: Duration::from_secs(1),
            ..ServerConfig::new(
                self.dir.path().join(sub),
                "127.0.0.1:0".parse().expect("addr"),
            )
        };
        Server::start(config, self.shutdown.clone())
            .await
            .expect("server")
    }
}
