//! The store: SQLite for one machine (the embedded default) or PostgreSQL for several servers on
//! one database, with versioned migrations and an event history that backs the watch streams.
//!
//! Every resource row keeps its wire object as JSON in `data`, beside the few columns that carry
//! constraints (unique names) and lookups (token access ids, foreign keys). A write runs in one
//! transaction that also appends its events to `events`, under one writer at a time (SQLite's
//! lock, or a cluster-wide advisory lock on PostgreSQL), so revisions commit in order. An
//! acknowledged write is committed before the handler answers, and its events are published to
//! this server's watchers before that; events committed through other servers reach them through
//! the tailer (see `postgres`). A watcher subscribes before it reads its starting point, so it
//! never misses an event; it skips live events its starting point already covers.

mod feed;
mod lease;
mod postgres;
mod sql;
mod sqlite;

use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use control_client::model::EventType;
use feed::Feed;
pub use lease::{Leadership, RETRY as ELECTION_RETRY, Role};
pub use sql::{Arg, FromValue, Row, Sql, ToArg, Value};

/// How many events the history keeps for `?since=` resumes.
pub const DEFAULT_HISTORY: u64 = 10_000;
/// How often a PostgreSQL server reads the events table even without a notification: the bound
/// on how late a change committed elsewhere reaches this server's watchers if a NOTIFY is lost.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// Events read per query while catching up.
const CATCH_UP_BATCH: i64 = 512;

/// Store failures. Constraint violations are reported separately so handlers can answer 409.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("database error: {0}")]
    Postgres(Arc<tokio_postgres::Error>),
    #[error("stored row is not valid JSON: {0}")]
    Corrupt(#[from] serde_json::Error),
    #[error("stored row has an unexpected shape: {0}")]
    Decode(String),
    #[error("store task failed: {0}")]
    Task(String),
    #[error("cannot open the store: {0}")]
    Open(String),
}

impl StoreError {
    /// Whether this is a UNIQUE constraint violation.
    pub fn is_unique_violation(&self) -> bool {
        match self {
            StoreError::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => {
                e.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
            }
            StoreError::Postgres(e) => {
                e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
            }
            _ => false,
        }
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
    /// The store revision the starting point reflects: live events at or below it are covered.
    pub revision: u64,
    /// `true` when `since` was honoured and `initial` holds only the missed events.
    pub resumed: bool,
    /// Events to send before the live ones: the missed history, or the snapshot as CREATED.
    pub initial: Vec<Event>,
    /// Live events; those at or below `revision` are to be skipped.
    pub live: broadcast::Receiver<Arc<Event>>,
}

/// The store. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    engine: Engine,
    feed: Feed,
    history: u64,
    /// Ends the PostgreSQL tailer when the last handle is dropped.
    stop: CancellationToken,
}

#[derive(Debug)]
// One per store, behind an `Arc`: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum Engine {
    Sqlite(Mutex<rusqlite::Connection>),
    Postgres(postgres::Pool),
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A write transaction that records the events it produces.
pub struct Tx<'a> {
    sql: Sql<'a>,
    /// The engine's SQL that appends one event and returns its revision.
    emit: &'static str,
    events: Vec<Event>,
}

impl Store {
    /// Opens (creating if needed) the SQLite store at `path` and applies pending migrations.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::open_with_history(path, DEFAULT_HISTORY)
    }

    /// Like [`Store::open`], keeping `history` events for resumes.
    pub fn open_with_history(path: &Path, history: u64) -> Result<Self, StoreError> {
        let conn = sqlite::open(path)?;
        let revision: Option<i64> =
            conn.lock()
                .query_row("SELECT max(revision) FROM events", [], |r| r.get(0))?;
        Ok(Self::with_engine(
            Engine::Sqlite(conn),
            revision.unwrap_or(0).max(0) as u64,
            history,
        ))
    }

    /// Connects to the PostgreSQL database at `url` (libpq's URL syntax), applies pending
    /// migrations and starts following the changes other servers commit.
    pub async fn connect(url: &str, history: u64) -> Result<Self, StoreError> {
        let target = postgres::Target::parse(url)?;
        let (pool, revision) = postgres::Pool::open(target.clone()).await?;
        // Start from the latest revision: nobody watches this server yet.
        let store = Self::with_engine(Engine::Postgres(pool), revision, history);
        net::task::spawn(tail(
            Arc::downgrade(&store.inner),
            target,
            store.inner.stop.clone(),
        ));
        Ok(store)
    }

    fn with_engine(engine: Engine, revision: u64, history: u64) -> Self {
        Self {
            inner: Arc::new(Inner {
                engine,
                feed: Feed::new(revision),
                history: history.max(1),
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Takes part in the election for `role` until `shutdown`: on SQLite this server always
    /// holds it; on PostgreSQL one server at a time does.
    pub fn elect(&self, role: Role, shutdown: CancellationToken) -> Leadership {
        match &self.inner.engine {
            Engine::Sqlite(_) => Leadership::always(),
            Engine::Postgres(pool) => lease::elect(pool.target().clone(), role, shutdown),
        }
    }

    /// Whether several servers may share this store (PostgreSQL).
    pub fn is_shared(&self) -> bool {
        matches!(self.inner.engine, Engine::Postgres(_))
    }

    /// The revision of the last event published to this server's watchers (0 for a new store).
    pub fn revision(&self) -> u64 {
        self.inner.feed.revision()
    }

    /// Runs a read on the blocking pool.
    pub async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Sql<'_>) -> Result<T, StoreError> + Send + 'static,
    {
        let inner = self.inner.clone();
        run_blocking(move || match &inner.engine {
            Engine::Sqlite(conn) => f(&Sql(sql::Engine::Sqlite(&conn.lock()))),
            Engine::Postgres(pool) => pool.read(f),
        })
        .await
    }

    /// Runs a read that also sees the revision the data reflects (for list answers that a
    /// watcher resumes from).
    pub async fn read_at_revision<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Sql<'_>, u64) -> Result<T, StoreError> + Send + 'static,
    {
        let inner = self.inner.clone();
        run_blocking(move || match &inner.engine {
            Engine::Sqlite(conn) => {
                let conn = conn.lock();
                // Writers publish while holding the lock, so this is consistent.
                f(&Sql(sql::Engine::Sqlite(&conn)), inner.feed.revision())
            }
            Engine::Postgres(pool) => pool.read_snapshot(f),
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
            // Subscribed before the starting point is read: nothing published in between is lost.
            let live = inner.feed.subscribe();
            let start = |sql: &Sql<'_>, current: u64| starting_point(sql, kind, since, current);
            let (revision, resumed, initial) = match &inner.engine {
                Engine::Sqlite(conn) => {
                    let conn = conn.lock();
                    start(&Sql(sql::Engine::Sqlite(&conn)), inner.feed.revision())?
                }
                Engine::Postgres(pool) => pool.read_snapshot(start)?,
            };
            Ok(Subscription {
                revision,
                resumed,
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
        match &self.engine {
            Engine::Sqlite(conn) => {
                let mut conn = conn.lock();
                let tx = conn.transaction().map_err(StoreError::from)?;
                let mut t = Tx::new(Sql(sql::Engine::Sqlite(&tx)), sqlite::EMIT);
                let value = f(&mut t)?;
                let (_, events) = t.finish(self.history)?;
                tx.commit().map_err(StoreError::from)?;
                // Still under the lock: the next writer publishes after this one.
                self.feed.send(events);
                Ok(value)
            }
            Engine::Postgres(pool) => pool.write(
                |t| f(t),
                self.history,
                |sql, events| {
                    // Committed is committed: a failed catch-up is the tailer's to retry (within
                    // a poll interval), not a failed write.
                    if let Err(e) = self
                        .feed
                        .publish(events, |after| events_after(sql, None, after))
                    {
                        tracing::warn!(error = %e, "cannot publish a committed write yet");
                    }
                    Ok(())
                },
            ),
        }
    }

    /// Publishes what other servers committed (PostgreSQL).
    fn catch_up(&self) -> Result<(), StoreError> {
        match &self.engine {
            Engine::Sqlite(_) => Ok(()),
            Engine::Postgres(pool) => {
                pool.read(|sql| self.feed.catch_up(|after| events_after(sql, None, after)))
            }
        }
    }
}

/// Follows the changes committed through other servers: wakes on NOTIFY, polls every
/// [`POLL_INTERVAL`] in case a notification was lost, and catches up after every reconnect of
/// its listening connection (notifications sent while it was away are gone).
async fn tail(inner: Weak<Inner>, target: postgres::Target, stop: CancellationToken) {
    let mut backoff =
        net::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        let listening = tokio::select! {
            _ = stop.cancelled() => return,
            listening = target.listen() => listening,
        };
        let (client, mut wake) = match listening {
            Ok(listening) => listening,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for database changes; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(backoff.next_delay()) => continue,
                }
            }
        };
        backoff.reset();
        let mut poll = tokio::time::interval(POLL_INTERVAL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                woken = wake.recv() => {
                    if woken.is_none() {
                        tracing::warn!("database listener lost; reconnecting");
                        break;
                    }
                    // One catch-up answers every notification already queued.
                    while wake.try_recv().is_ok() {}
                }
                _ = poll.tick() => {}
            }
            let Some(inner) = inner.upgrade() else { return };
            match run_blocking(move || inner.catch_up()).await {
                Ok(()) => {}
                Err(e) => tracing::warn!(error = %e, "cannot read database changes"),
            }
        }
        drop(client);
    }
}

impl std::fmt::Debug for Tx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("sql", &self.sql)
            .field("events", &self.events.len())
            .finish()
    }
}

impl<'a> Tx<'a> {
    fn new(sql: Sql<'a>, emit: &'static str) -> Self {
        Self {
            sql,
            emit,
            events: Vec::new(),
        }
    }

    /// The transaction, for queries.
    pub fn sql(&self) -> &Sql<'a> {
        &self.sql
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
        let revision = self.sql.insert(
            self.emit,
            &[
                Arg::Text(kind.as_str()),
                Arg::Int(event_type.code().into()),
                Arg::Int(object_id),
                Arg::Text(&data),
            ],
        )?;
        self.events.push(Event {
            revision: revision.max(0) as u64,
            kind,
            event_type,
            object_id,
            data,
        });
        Ok(())
    }

    /// Bounds the history (in the same transaction) and hands back the events to publish.
    fn finish(self, history: u64) -> Result<(Sql<'a>, Vec<Event>), StoreError> {
        if let Some(last) = self.events.last() {
            // A range delete on the primary key is cheap when empty.
            let keep_from = last.revision.saturating_sub(history);
            self.sql.execute(
                "DELETE FROM events WHERE revision <= ?1",
                &[Arg::Int(keep_from as i64)],
            )?;
        }
        Ok((self.sql, self.events))
    }
}

/// Loads one row's JSON of `kind` by id.
pub fn get<T: DeserializeOwned>(
    sql: &Sql<'_>,
    kind: Kind,
    id: i64,
) -> Result<Option<T>, StoreError> {
    let query = format!(
        "SELECT {} FROM {} WHERE id = ?1",
        kind.data_column(),
        kind.table()
    );
    sql.query_opt(&query, &[Arg::Int(id)])?
        .map(|row| Ok(serde_json::from_str(&row.get::<String>(0)?)?))
        .transpose()
}

/// Loads every row of `kind` (its `data` column) in id order, optionally filtered by a SQL
/// condition on the table's columns.
pub fn list<T: DeserializeOwned>(
    sql: &Sql<'_>,
    kind: Kind,
    filter: Option<(&str, i64)>,
) -> Result<Vec<T>, StoreError> {
    let (column, table) = (kind.data_column(), kind.table());
    let rows = match filter {
        Some((by, value)) => sql.query(
            &format!("SELECT {column} FROM {table} WHERE {by} = ?1 ORDER BY id"),
            &[Arg::Int(value)],
        )?,
        None => sql.query(&format!("SELECT {column} FROM {table} ORDER BY id"), &[])?,
    };
    rows.iter()
        .map(|row| Ok(serde_json::from_str(&row.get::<String>(0)?)?))
        .collect()
}

/// Counts rows of a table matching `column = value`.
pub fn count(sql: &Sql<'_>, table: &str, column: &str, value: i64) -> Result<u64, StoreError> {
    let query = format!("SELECT count(*) FROM {table} WHERE {column} = ?1");
    let n: i64 = sql
        .query_opt(&query, &[Arg::Int(value)])?
        .map_or(Ok(0), |row| row.get(0))?;
    Ok(n.max(0) as u64)
}

/// A watcher's starting point at `current`: `(revision, resumed, initial events)`.
fn starting_point(
    sql: &Sql<'_>,
    kind: Kind,
    since: Option<u64>,
    current: u64,
) -> Result<(u64, bool, Vec<Event>), StoreError> {
    if let Some(since) = since.filter(|s| *s <= current) {
        let oldest: Option<i64> = sql
            .query_opt("SELECT min(revision) FROM events", &[])?
            .map_or(Ok(None), |row| row.get(0))?;
        // Resumable when nothing after `since` has been pruned.
        let oldest = oldest.map_or(current + 1, |o| o.max(0) as u64);
        if since + 1 >= oldest || since == current {
            let mut initial = Vec::new();
            let mut after = since;
            loop {
                let batch = events_after(sql, Some(kind), after)?;
                let Some(last) = batch.last() else { break };
                after = last.revision;
                initial.extend(batch.into_iter().filter(|e| e.revision <= current));
                if after >= current {
                    break;
                }
            }
            return Ok((current, true, initial));
        }
    }
    Ok((current, false, snapshot_events(sql, kind, current)?))
}

/// Up to [`CATCH_UP_BATCH`] committed events after revision `after`, of `kind` or of every kind.
fn events_after(sql: &Sql<'_>, kind: Option<Kind>, after: u64) -> Result<Vec<Event>, StoreError> {
    let after = Arg::Int(after as i64);
    let rows = match kind {
        Some(kind) => sql.query(
            "SELECT revision, kind, type, object_id, data FROM events
             WHERE kind = ?1 AND revision > ?2 ORDER BY revision LIMIT ?3",
            &[Arg::Text(kind.as_str()), after, Arg::Int(CATCH_UP_BATCH)],
        )?,
        None => sql.query(
            "SELECT revision, kind, type, object_id, data FROM events
             WHERE revision > ?1 ORDER BY revision LIMIT ?2",
            &[after, Arg::Int(CATCH_UP_BATCH)],
        )?,
    };
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let revision: i64 = row.get(0)?;
        let kind_text: String = row.get(1)?;
        let code: i64 = row.get(2)?;
        let event_type = u8::try_from(code).ok().and_then(EventType::from_code);
        // A kind or type a newer faden wrote: not ours to show.
        let (Some(kind), Some(event_type)) = (Kind::parse(&kind_text), event_type) else {
            continue;
        };
        out.push(Event {
            revision: revision.max(0) as u64,
            kind,
            event_type,
            object_id: row.get(3)?,
            data: row.get::<String>(4)?.into(),
        });
    }
    Ok(out)
}

fn snapshot_events(sql: &Sql<'_>, kind: Kind, revision: u64) -> Result<Vec<Event>, StoreError> {
    let query = format!(
        "SELECT id, {} FROM {} ORDER BY id",
        kind.data_column(),
        kind.table()
    );
    let mut out = Vec::new();
    for row in sql.query(&query, &[])? {
        out.push(Event {
            revision,
            kind,
            event_type: EventType::Created,
            object_id: row.get(0)?,
            data: row.get::<String>(1)?.into(),
        });
    }
    Ok(out)
}

/// The migrations a database at schema `version` still needs, numbered from 1; a database newer
/// than this faden is refused.
fn pending_migrations(
    version: i64,
    migrations: &'static [&'static str],
) -> Result<impl Iterator<Item = (i64, &'static str)>, StoreError> {
    let applied = usize::try_from(version).unwrap_or(0);
    if applied > migrations.len() {
        return Err(StoreError::Open(format!(
            "the database has schema version {applied}, newer than this faden ({}); upgrade faden",
            migrations.len()
        )));
    }
    Ok((applied..migrations.len()).map(move |i| ((i + 1) as i64, migrations[i])))
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
