//! The SQLite engine, the embedded default: one file, WAL, `synchronous=FULL`, a few pooled
//! connections (readers run beside the one writer that WAL allows; the store lets one write
//! transaction run at a time, `BEGIN IMMEDIATE`).

use std::path::Path;
use std::time::Duration;

use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use super::StoreError;
use super::migrate;
use super::sql::{Conn, Held, Sql};

/// Connections kept: readers in parallel, and the writer.
const POOL_SIZE: u32 = 4;

/// SQL that appends one event; `AUTOINCREMENT` gives the next revision.
pub(super) const EMIT: &str =
    "INSERT INTO events (kind, type, object_id, data) VALUES ($1, $2, $3, $4) RETURNING revision";

/// The revision of the last committed event (0 before the first).
pub(super) const REVISION: &str =
    "SELECT coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0)";

/// Opens (creating if needed) the database at `path` and applies pending migrations.
pub(super) async fn open(path: &Path) -> Result<SqlitePool, StoreError> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // FULL: the WAL is fsynced at every commit, so an acknowledged write survives power
        // loss, not only a killed process.
        .synchronous(SqliteSynchronous::Full)
        .foreign_keys(true)
        .busy_timeout(Duration::from_secs(5));
    // No ping before each use: a file does not go away as a server can (sqlx still pings a
    // connection when it comes back to the pool, which also ends an unfinished transaction).
    let pool = SqlitePoolOptions::new()
        .max_connections(POOL_SIZE)
        .test_before_acquire(false)
        .connect_with(options)
        .await?;
    migrate(&pool).await?;
    Ok(pool)
}

async fn migrate(pool: &SqlitePool) -> Result<(), StoreError> {
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(pool)
        .await?;
    for (next, migration) in migrate::pending(version, migrate::SQLITE)? {
        tracing::info!(
            version = next,
            migration = migration.name,
            "migrating the database"
        );
        let mut sql = Sql(Conn::Sqlite(Held::Tx(pool.begin().await?)));
        sql.batch(migration.sql).await?;
        sql.batch(&format!("PRAGMA user_version = {next}")).await?;
        sql.commit().await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Migration 2 rebuilds `model_instances`: rows and ids kept, the id sequence goes on past
    /// deleted rows, and an instance may then have no model.
    #[tokio::test]
    async fn migration_2_keeps_instances_and_their_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("faden.db");
        {
            let options = SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true);
            let pool = SqlitePool::connect_with(options).await.unwrap();
            sqlx::raw_sql(migrate::SQLITE[0].sql)
                .execute(&pool)
                .await
                .unwrap();
            sqlx::raw_sql(
                "PRAGMA user_version = 1;
                 INSERT INTO models (name, data) VALUES ('m', '{}');
                 INSERT INTO model_instances (model_id, data) VALUES (1, '{\"a\":1}');
                 INSERT INTO model_instances (model_id, data) VALUES (1, '{\"a\":2}');
                 INSERT INTO model_instances (model_id, data) VALUES (1, '{\"a\":3}');
                 DELETE FROM model_instances WHERE id = 3;",
            )
            .execute(&pool)
            .await
            .unwrap();
            pool.close().await;
        }
        let pool = open(&path).await.unwrap();
        let rows: Vec<(i64, String)> =
            sqlx::query_as("SELECT id, data FROM model_instances ORDER BY id")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(
            rows,
            [(1, "{\"a\":1}".to_owned()), (2, "{\"a\":2}".to_owned())]
        );
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO model_instances (model_id, data) VALUES (NULL, '{}') RETURNING id",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(id, 4, "a deleted id is not reused");
        let version: i64 = sqlx::query_scalar("PRAGMA user_version")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(version, migrate::SQLITE.len() as i64);
    }

    /// Migration 3 copies each worker's state to its column, and gives the ready ones a
    /// heartbeat time (now) for the monitor to count from.
    #[tokio::test]
    async fn migration_3_fills_the_liveness_columns() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("faden.db");
        {
            let options = SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true);
            let pool = SqlitePool::connect_with(options).await.unwrap();
            for migration in &migrate::SQLITE[..2] {
                sqlx::raw_sql(migration.sql).execute(&pool).await.unwrap();
            }
            sqlx::raw_sql(
                "PRAGMA user_version = 2;
                 INSERT INTO clusters (name, reg_access_id, data) VALUES ('c', 'r', '{}');
                 INSERT INTO workers (cluster_id, name, data)
                     VALUES (1, 'up', '{\"state\":\"ready\"}');
                 INSERT INTO workers (cluster_id, name, data)
                     VALUES (1, 'down', '{\"state\":\"not_ready\"}');",
            )
            .execute(&pool)
            .await
            .unwrap();
            pool.close().await;
        }
        let before = chrono::Utc::now().timestamp_millis() / 1000 * 1000;
        let pool = open(&path).await.unwrap();
        let rows: Vec<(String, String, Option<i64>)> =
            sqlx::query_as("SELECT name, state, heartbeat_at FROM workers ORDER BY id")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(rows[0].0, "up");
        assert_eq!(rows[0].1, "ready");
        assert!(rows[0].2.unwrap() >= before);
        assert_eq!(rows[1], ("down".to_owned(), "not_ready".to_owned(), None));
    }
}
