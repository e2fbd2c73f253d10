//! The embedded store: SQLite (WAL, `synchronous=FULL`) with versioned migrations and an event
//! history that backs the watch streams.
//!
//! Every resource row keeps its wire object as JSON in `data`, beside the few columns that carry
//! constraints (unique names) and lookups (token access ids, foreign keys). A write runs in one
//! transaction that also appends its events to `events`; the events are broadcast to live watchers
//! only after the commit, while the connection lock is still held, so a watcher that subscribes
//! under the same lock never misses or reorders an event. An acknowledged write is on disk: the
//! transaction commits (with an fsync) before the handler answers.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, Transaction, params};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::broadcast;

use crate::model::EventType;

/// How many events the history keeps for `?since=` resumes.
pub const DEFAULT_HISTORY: u64 = 10_000;
/// Capacity of the live event channel; a watcher that falls this far behind is disconnected and
/// resumes with `?since=`.
const LIVE_CHANNEL: usize = 4096;

/// Store failures. Constraint violations are reported separately so handlers can answer 409.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Db(#[from] rusqlite::Error),
    #[error("stored row is not valid JSON: {0}")]
    Corrupt(#[from] serde_json::Error),
    #[error("store task failed: {0}")]
    Task(String),
    #[error("cannot open the store: {0}")]
    Open(String),
}

impl StoreError {
    /// Whether this is a UNIQUE constraint violation.
    pub fn is_unique_violation(&self) -> bool {
        matches!(
            self,
            StoreError::Db(rusqlite::Error::SqliteFailure(e, _))
                if e.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
        )
    }
}

/// The watchable resource kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Clusters,
    Workers,
    Models,
    ModelInstances,
    /// Key digests for data-plane components (derived from `api_keys`).
    Credentials,
    /// API keys as administrators list them (not watchable).
    ApiKeys,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 6] = [
        Kind::Clusters,
        Kind::Workers,
        Kind::Models,
        Kind::ModelInstances,
        Kind::Credentials,
        Kind::ApiKeys,
    ];

    /// The name used in URLs and in the `events` table.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Clusters => "clusters",
            Kind::Workers => "workers",
            Kind::Models => "models",
            Kind::ModelInstances => "model-instances",
            Kind::Credentials => "credentials",
            Kind::ApiKeys => "api-keys",
        }
    }

    fn parse(text: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == text)
    }

    /// The table holding this kind's rows.
    fn table(self) -> &'static str {
        match self {
            Kind::Clusters => "clusters",
            Kind::Workers => "workers",
            Kind::Models => "models",
            Kind::ModelInstances => "model_instances",
            Kind::Credentials | Kind::ApiKeys => "api_keys",
        }
    }

    /// The column holding the JSON shown to watchers.
    fn data_column(self) -> &'static str {
        match self {
            Kind::Credentials => "credential",
            _ => "data",
        }
    }
}

/// One committed change, ready to be written to a watch stream.
#[derive(Clone, Debug)]
pub struct Event {
    pub revision: u64,
    pub kind: Kind,
    pub event_type: EventType,
    pub object_id: i64,
    /// The object's JSON, serialised once.
    pub data: Arc<str>,
}

impl Event {
    /// The event as a watch-stream frame: one JSON object and a blank line, with the revision
    /// when `revision` (GPUStack's own watch clients refuse any key beyond theirs).
    pub fn to_frame(&self, revision: bool) -> String {
        let (code, data, id) = (self.event_type.code(), &self.data, self.object_id);
        if revision {
            format!(
                "{{\"type\":{code},\"data\":{data},\"id\":{id},\"revision\":{}}}\n\n",
                self.revision
            )
        } else {
            format!("{{\"type\":{code},\"data\":{data},\"id\":{id}}}\n\n")
        }
    }
}

/// What a new watcher starts from.
#[derive(Debug)]
pub struct Subscription {
    /// The store revision at subscription: live events are newer.
    pub revision: u64,
    /// `true` when `since` was honoured and `initial` holds only the missed events.
    pub resumed: bool,
    /// Events to send before the live ones: the missed history, or the snapshot as CREATED.
    pub initial: Vec<Event>,
    /// Live events committed after `initial`.
    pub live: broadcast::Receiver<Arc<Event>>,
}

/// The embedded store. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    conn: Mutex<Connection>,
    live: broadcast::Sender<Arc<Event>>,
    revision: AtomicU64,
    history: u64,
}

/// A write transaction that records the events it produces.
#[derive(Debug)]
pub struct Tx<'a> {
    tx: Transaction<'a>,
    events: Vec<Event>,
}

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
];

impl Store {
    /// Opens (creating if needed) the store at `path` and applies pending migrations.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::open_with_history(path, DEFAULT_HISTORY)
    }

    /// Like [`Store::open`], keeping `history` events for resumes.
    pub fn open_with_history(path: &Path, history: u64) -> Result<Self, StoreError> {
        let mut conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // FULL: the WAL is fsynced at every commit, so an acknowledged write survives power loss,
        // not only a killed process.
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", true)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        migrate(&mut conn)?;
        let revision: Option<i64> =
            conn.query_row("SELECT max(revision) FROM events", [], |r| r.get(0))?;
        let (live, _) = broadcast::channel(LIVE_CHANNEL);
        Ok(Self {
            inner: Arc::new(Inner {
                conn: Mutex::new(conn),
                live,
                revision: AtomicU64::new(revision.unwrap_or(0).max(0) as u64),
                history: history.max(1),
            }),
        })
    }

    /// The revision of the last committed event (0 for a new store).
    pub fn revision(&self) -> u64 {
        self.inner.revision.load(Ordering::Acquire)
    }

    /// Runs a read on the blocking pool.
    pub async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let inner = self.inner.clone();
        run_blocking(move || f(&inner.conn.lock())).await
    }

    /// Runs a read that also sees the revision the data reflects (for list answers that a
    /// watcher resumes from).
    pub async fn read_at_revision<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, u64) -> Result<T, StoreError> + Send + 'static,
    {
        let inner = self.inner.clone();
        run_blocking(move || {
            let conn = inner.conn.lock();
            // Writers publish the revision while holding the lock, so this is consistent.
            f(&conn, inner.revision.load(Ordering::Acquire))
        })
        .await
    }

    /// Runs a write transaction on the blocking pool: commits, then publishes its events.
    /// The closure's error rolls everything back.
    pub async fn write<T, E, F>(&self, f: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<StoreError> + Send + 'static,
        F: FnOnce(&mut Tx<'_>) -> Result<T, E> + Send + 'static,
    {
        let inner = self.inner.clone();
        let joined = tokio::task::spawn_blocking(move || inner.write_blocking(f)).await;
        match joined {
            Ok(result) => result,
            Err(e) => Err(StoreError::Task(e.to_string()).into()),
        }
    }

    /// Subscribes to `kind`: the missed history when `since` is still retained, else a snapshot
    /// of every row as CREATED events; then live events.
    pub async fn subscribe(
        &self,
        kind: Kind,
        since: Option<u64>,
    ) -> Result<Subscription, StoreError> {
        let inner = self.inner.clone();
        run_blocking(move || {
            let conn = inner.conn.lock();
            let live = inner.live.subscribe();
            let current = inner.revision.load(Ordering::Acquire);
            if let Some(since) = since.filter(|s| *s <= current) {
                let oldest: Option<i64> =
                    conn.query_row("SELECT min(revision) FROM events", [], |r| r.get(0))?;
                // Resumable when nothing after `since` has been pruned.
                let oldest = oldest.map_or(current + 1, |o| o.max(0) as u64);
                if since + 1 >= oldest || since == current {
                    let initial = history_since(&conn, kind, since)?;
                    return Ok(Subscription {
                        revision: current,
                        resumed: true,
                        initial,
                        live,
                    });
                }
            }
            let initial = snapshot_events(&conn, kind, current)?;
            Ok(Subscription {
                revision: current,
                resumed: false,
                initial,
                live,
            })
        })
        .await
    }
}

impl Inner {
    fn write_blocking<T, E, F>(&self, f: F) -> Result<T, E>
    where
        E: From<StoreError>,
        F: FnOnce(&mut Tx<'_>) -> Result<T, E>,
    {
        let mut conn = self.conn.lock();
        let tx = conn.transaction().map_err(StoreError::from)?;
        let mut tx = Tx {
            tx,
            events: Vec::new(),
        };
        let value = f(&mut tx)?;
        let Tx { tx, events } = tx;
        if let Some(last) = events.last() {
            // Bound the history; a range delete on the primary key is cheap when empty.
            let keep_from = last.revision.saturating_sub(self.history);
            tx.execute(
                "DELETE FROM events WHERE revision <= ?1",
                params![keep_from as i64],
            )
            .map_err(StoreError::from)?;
        }
        tx.commit().map_err(StoreError::from)?;
        if let Some(last) = events.last() {
            self.revision.store(last.revision, Ordering::Release);
        }
        for event in events {
            // No receiver is not an error: nobody is watching.
            let _ = self.live.send(Arc::new(event));
        }
        Ok(value)
    }
}

impl Tx<'_> {
    /// The underlying transaction, for queries.
    pub fn conn(&self) -> &Transaction<'_> {
        &self.tx
    }

    /// Appends an event for `kind` with the object's JSON.
    pub fn emit<T: Serialize>(
        &mut self,
        kind: Kind,
        event_type: EventType,
        object_id: i64,
        object: &T,
    ) -> Result<(), StoreError> {
        let data: Arc<str> = serde_json::to_string(object)?.into();
        self.tx.execute(
            "INSERT INTO events (kind, type, object_id, data) VALUES (?1, ?2, ?3, ?4)",
            params![kind.as_str(), event_type.code(), object_id, &*data],
        )?;
        let revision = self.tx.last_insert_rowid().max(0) as u64;
        self.events.push(Event {
            revision,
            kind,
            event_type,
            object_id,
            data,
        });
        Ok(())
    }
}

/// Loads one row's JSON of `kind` by id.
pub fn get<T: DeserializeOwned>(
    conn: &Connection,
    kind: Kind,
    id: i64,
) -> Result<Option<T>, StoreError> {
    let sql = format!(
        "SELECT {} FROM {} WHERE id = ?1",
        kind.data_column(),
        kind.table()
    );
    let data: Option<String> = conn.query_row(&sql, params![id], |r| r.get(0)).optional()?;
    data.map(|d| serde_json::from_str(&d).map_err(StoreError::from))
        .transpose()
}

/// Loads every row of `kind` (its `data` column) in id order, optionally filtered by a SQL
/// condition on the table's columns.
pub fn list<T: DeserializeOwned>(
    conn: &Connection,
    kind: Kind,
    filter: Option<(&str, i64)>,
) -> Result<Vec<T>, StoreError> {
    let sql = match filter {
        Some((column, _)) => format!(
            "SELECT {} FROM {} WHERE {column} = ?1 ORDER BY id",
            kind.data_column(),
            kind.table()
        ),
        None => format!(
            "SELECT {} FROM {} ORDER BY id",
            kind.data_column(),
            kind.table()
        ),
    };
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows: Vec<String> = match filter {
        Some((_, value)) => stmt
            .query_map(params![value], |r| r.get(0))?
            .collect::<Result<_, _>>()?,
        None => stmt
            .query_map([], |r| r.get(0))?
            .collect::<Result<_, _>>()?,
    };
    rows.iter()
        .map(|row| serde_json::from_str(row).map_err(StoreError::from))
        .collect()
}

/// Counts rows of a table matching `column = value`.
pub fn count(conn: &Connection, table: &str, column: &str, value: i64) -> Result<u64, StoreError> {
    let sql = format!("SELECT count(*) FROM {table} WHERE {column} = ?1");
    let n: i64 = conn.query_row(&sql, params![value], |r| r.get(0))?;
    Ok(n.max(0) as u64)
}

fn history_since(conn: &Connection, kind: Kind, since: u64) -> Result<Vec<Event>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT revision, kind, type, object_id, data FROM events
         WHERE kind = ?1 AND revision > ?2 ORDER BY revision",
    )?;
    let rows = stmt.query_map(params![kind.as_str(), since as i64], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, u8>(2)?,
            r.get(3)?,
            r.get(4)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (revision, kind_text, code, object_id, data): (i64, String, u8, i64, String) = row?;
        let (Some(kind), Some(event_type)) = (Kind::parse(&kind_text), EventType::from_code(code))
        else {
            continue;
        };
        out.push(Event {
            revision: revision.max(0) as u64,
            kind,
            event_type,
            object_id,
            data: data.into(),
        });
    }
    Ok(out)
}

fn snapshot_events(conn: &Connection, kind: Kind, revision: u64) -> Result<Vec<Event>, StoreError> {
    let sql = format!(
        "SELECT id, {} FROM {} ORDER BY id",
        kind.data_column(),
        kind.table()
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))?;
    let mut out = Vec::new();
    for row in rows {
        let (object_id, data) = row?;
        out.push(Event {
            revision,
            kind,
            event_type: EventType::Created,
            object_id,
            data: data.into(),
        });
    }
    Ok(out)
}

fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    let version = usize::try_from(version).unwrap_or(0);
    if version > MIGRATIONS.len() {
        return Err(StoreError::Open(format!(
            "the store has schema version {version}, newer than this faden ({}); upgrade faden",
            MIGRATIONS.len()
        )));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version) {
        let tx = conn.transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", (i + 1) as i64)?;
        tx.commit()?;
    }
    Ok(())
}

async fn run_blocking<T, F>(f: F) -> Result<T, StoreError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, StoreError> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::Task(e.to_string()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn events_are_recorded_and_resumable() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_with_history(&dir.path().join("s.db"), 3).unwrap();
        for i in 0..5 {
            store
                .write(move |tx| {
                    tx.conn().execute(
                        "INSERT INTO models (name, data) VALUES (?1, ?2)",
                        params![
                            format!("m{i}"),
                            format!("{{\"id\":{},\"name\":\"m{i}\"}}", i + 1)
                        ],
                    )?;
                    tx.emit(
                        Kind::Models,
                        EventType::Created,
                        i + 1,
                        &serde_json::json!({"i": i}),
                    )
                })
                .await
                .unwrap();
        }
        assert_eq!(store.revision(), 5);
        let sub = store.subscribe(Kind::Models, Some(4)).await.unwrap();
        assert!(sub.resumed);
        assert_eq!(sub.initial.len(), 1);
        assert_eq!(sub.initial[0].revision, 5);
        let sub = store.subscribe(Kind::Models, Some(5)).await.unwrap();
        assert!(sub.resumed && sub.initial.is_empty());
        // A future revision (e.g. another server's) falls back to a snapshot.
        let sub = store.subscribe(Kind::Models, Some(99)).await.unwrap();
        assert!(!sub.resumed);
        assert_eq!(sub.initial.len(), 5);
    }

    #[tokio::test]
    async fn pruned_history_falls_back_to_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_with_history(&dir.path().join("s.db"), 2).unwrap();
        for i in 0..6 {
            store
                .write(move |tx| {
                    tx.emit(Kind::Models, EventType::Updated, 1, &i)?;
                    tx.emit(Kind::Models, EventType::Updated, 1, &i)
                })
                .await
                .unwrap();
        }
        let sub = store.subscribe(Kind::Models, Some(1)).await.unwrap();
        assert!(!sub.resumed);
    }
}
