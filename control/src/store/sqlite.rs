//! The SQLite engine, the embedded default: one file, WAL, `synchronous=FULL`, one connection
//! behind a mutex (SQLite has one writer anyway), so every write and its publication happen in
//! revision order without further care.

use std::path::Path;

use parking_lot::Mutex;
use rusqlite::Connection;

use super::StoreError;

/// SQL that appends one event; `AUTOINCREMENT` gives the next revision.
pub(super) const EMIT: &str =
    "INSERT INTO events (kind, type, object_id, data) VALUES (?1, ?2, ?3, ?4) RETURNING revision";

const MIGRATIONS: &[&str] = &[
    // 1: initial schema.
    "CREATE TABLE clusters (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL UNIQUE,
        reg_access_id TEXT NOT NULL UNIQUE,
        data TEXT NOT NULL
    );
    CREATE TABLE workers (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        cluster_id INTEGER NOT NULL REFERENCES clusters(id),
        name TEXT NOT NULL,
        token_access_id TEXT UNIQUE,
        token_digest BLOB,
        data TEXT NOT NULL,
        UNIQUE (cluster_id, name)
    );
    CREATE TABLE models (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL UNIQUE,
        cluster_id INTEGER REFERENCES clusters(id),
        data TEXT NOT NULL
    );
    CREATE TABLE model_instances (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        model_id INTEGER NOT NULL REFERENCES models(id),
        worker_id INTEGER REFERENCES workers(id),
        data TEXT NOT NULL
    );
    CREATE INDEX model_instances_model ON model_instances(model_id);
    CREATE INDEX model_instances_worker ON model_instances(worker_id);
    CREATE TABLE api_keys (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,
        access_id TEXT NOT NULL UNIQUE,
        digest BLOB NOT NULL,
        data TEXT NOT NULL,
        credential TEXT NOT NULL
    );
    CREATE TABLE events (
        revision INTEGER PRIMARY KEY AUTOINCREMENT,
        kind TEXT NOT NULL,
        type INTEGER NOT NULL,
        object_id INTEGER NOT NULL,
        data TEXT NOT NULL
    );
    CREATE INDEX events_kind ON events(kind, revision);",
    // 2: an instance may have no model (an orphan: its model was deleted while its worker was
    // away). SQLite cannot drop a NOT NULL: the table is rebuilt, ids and sequence kept.
    "CREATE TABLE model_instances_new (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        model_id INTEGER REFERENCES models(id),
        worker_id INTEGER REFERENCES workers(id),
        data TEXT NOT NULL
    );
    INSERT INTO model_instances_new (id, model_id, worker_id, data)
        SELECT id, model_id, worker_id, data FROM model_instances;
    DELETE FROM sqlite_sequence WHERE name = 'model_instances_new';
    INSERT INTO sqlite_sequence (name, seq)
        SELECT 'model_instances_new', seq FROM sqlite_sequence WHERE name = 'model_instances';
    DROP TABLE model_instances;
    ALTER TABLE model_instances_new RENAME TO model_instances;
    CREATE INDEX model_instances_model ON model_instances(model_id);
    CREATE INDEX model_instances_worker ON model_instances(worker_id);",
];

/// Opens (creating if needed) the database at `path` and applies pending migrations.
pub(super) fn open(path: &Path) -> Result<Mutex<Connection>, StoreError> {
    let mut conn = Connection::open(path)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    // FULL: the WAL is fsynced at every commit, so an acknowledged write survives power loss,
    // not only a killed process.
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.pragma_update(None, "foreign_keys", true)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    migrate(&mut conn)?;
    Ok(Mutex::new(conn))
}

fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    for (next, sql) in super::pending_migrations(version, MIGRATIONS)? {
        let tx = conn.transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", next)?;
        tx.commit()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Migration 2 rebuilds `model_instances`: rows and ids kept, the id sequence goes on past
    /// deleted rows, and an instance may then have no model.
    #[test]
    fn migration_2_keeps_instances_and_their_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("faden.db");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(MIGRATIONS[0]).unwrap();
            conn.pragma_update(None, "user_version", 1).unwrap();
            conn.execute_batch(
                "INSERT INTO models (name, data) VALUES ('m', '{}');
                 INSERT INTO model_instances (model_id, data) VALUES (1, '{\"a\":1}');
                 INSERT INTO model_instances (model_id, data) VALUES (1, '{\"a\":2}');
                 INSERT INTO model_instances (model_id, data) VALUES (1, '{\"a\":3}');
                 DELETE FROM model_instances WHERE id = 3;",
            )
            .unwrap();
        }
        let conn = open(&path).unwrap();
        let conn = conn.lock();
        let rows: Vec<(i64, String)> = conn
            .prepare("SELECT id, data FROM model_instances ORDER BY id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            rows,
            [(1, "{\"a\":1}".to_owned()), (2, "{\"a\":2}".to_owned())]
        );
        let id: i64 = conn
            .query_row(
                "INSERT INTO model_instances (model_id, data) VALUES (NULL, '{}') RETURNING id",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(id, 4, "a deleted id is not reused");
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap();
        assert_eq!(version, 2);
    }
}
