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
mod migrate;
mod postgres;
mod sql;
mod sqlite;

use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use control_client::model::EventType;
use feed::Feed;
pub use lease::{Leadership, RETRY as ELECTION_RETRY, Role};
pub use sql::{Arg, FromValue, Row, Sql, ToArg, Value};
use sql::{Conn, Held};

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
    Database(#[from] sqlx::Error),
    #[error("stored row is not valid JSON: {0}")]
    Corrupt(#[from] serde_json::Error),
    #[error("stored row has an unexpected shape: {0}")]
    Decode(String),
    #[error("cannot open the store: {0}")]
    Open(String),
    #[error("store task failed: {0}")]
    Task(String),
}

impl StoreError {
    /// Whether this is a UNIQUE constraint violation.
    pub fn is_unique_violation(&self) -> bool {
        match self {
            StoreError::Database(sqlx::Error::Database(e)) => {
                e.kind() == sqlx::error::ErrorKind::UniqueViolation
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
    /// Held through each write transaction, its commit and its publication: one permit on
    /// SQLite (its single writer, which also publishes in commit order), a few on PostgreSQL
    /// (whose write lock serialises them), so that writers queue here rather than each holding
    /// a pooled connection.
    writers: Arc<tokio::sync::Semaphore>,
    /// Ends the PostgreSQL tailer when the last handle is dropped.
    stop: CancellationToken,
}

// One per store, behind an `Arc`: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum Engine {
    Sqlite(sqlx::SqlitePool),
    Postgres {
        pool: sqlx::PgPool,
        /// For the election's own connections.
        options: sqlx::postgres::PgConnectOptions,
    },
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the connect options: they hold the password.
        match self {
            Engine::Sqlite(pool) => f.debug_tuple("Sqlite").field(pool).finish(),
            Engine::Postgres { pool, .. } => f.debug_tuple("Postgres").field(pool).finish(),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A write transaction that records the events it produces.
pub struct Tx {
    sql: Sql,
    /// The engine's SQL that appends one event and returns its revision.
    emit: &'static str,
    events: Vec<Event>,
}

impl Store {
    /// Opens (creating if needed) the SQLite store at `path` and applies pending migrations.
    pub async fn open(path: &Path) -> Result<Self, StoreError> {
        Self::open_with_history(path, DEFAULT_HISTORY).await
    }

    /// Like [`Store::open`], keeping `history` events for resumes.
    pub async fn open_with_history(path: &Path, history: u64) -> Result<Self, StoreError> {
        let pool = sqlite::open(path).await?;
        let revision: i64 = sqlx::query_scalar(sqlite::REVISION)
            .fetch_one(&pool)
            .await?;
        Ok(Self::with_engine(
            Engine::Sqlite(pool),
            revision.max(0) as u64,
            history,
        ))
    }

    /// Connects to the PostgreSQL database at `url` (libpq's URL syntax), applies pending
    /// migrations and starts following the changes other servers commit.
    pub async fn connect(url: &str, history: u64) -> Result<Self, StoreError> {
        let options = postgres::options(url)?;
        let pool = postgres::open(options.clone()).await?;
        let revision: i64 = sqlx::query_scalar(postgres::REVISION)
            .fetch_one(&pool)
            .await?;
        // Start from the latest revision: nobody watches this server yet.
        let engine = Engine::Postgres {
            pool: pool.clone(),
            options,
        };
        let store = Self::with_engine(engine, revision.max(0) as u64, history);
        // Ends at `stop` (the last handle's drop) or when the store is gone.
        net::task::spawn(tail(
            Arc::downgrade(&store.inner),
            pool,
            store.inner.stop.clone(),
        ));
        Ok(store)
    }

    fn with_engine(engine: Engine, revision: u64, history: u64) -> Self {
        let writers = match engine {
            Engine::Sqlite(_) => 1,
            Engine::Postgres { .. } => postgres::WRITERS,
        };
        Self {
            inner: Arc::new(Inner {
                engine,
                feed: Feed::new(revision),
                history: history.max(1),
                writers: Arc::new(tokio::sync::Semaphore::new(writers)),
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Takes part in the election for `role` until `shutdown`: on SQLite this server always
    /// holds it; on PostgreSQL one server at a time does.
    pub fn elect(&self, role: Role, shutdown: CancellationToken) -> Leadership {
        match &self.inner.engine {
            Engine::Sqlite(_) => Leadership::always(),
            Engine::Postgres { options, .. } => lease::elect(options.clone(), role, shutdown),
        }
    }

    /// Whether several servers may share this store (PostgreSQL).
    pub fn is_shared(&self) -> bool {
        matches!(self.inner.engine, Engine::Postgres { .. })
    }

    /// The revision of the last event published to this server's watchers (0 for a new store).
    pub fn revision(&self) -> u64 {
        self.inner.feed.revision()
    }

    /// Runs a read on a pooled connection (each statement sees the latest commits).
    pub async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: AsyncFnOnce(&mut Sql) -> Result<T, StoreError>,
    {
        let mut sql = self.inner.connection().await?;
        f(&mut sql).await
    }

    /// Runs a read in one snapshot that also sees the revision the data reflects (for list
    /// answers that a watcher resumes from).
    pub async fn read_at_revision<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: AsyncFnOnce(&mut Sql, u64) -> Result<T, StoreError>,
    {
        let (mut sql, revision) = self.inner.snapshot().await?;
        let value = f(&mut sql, revision).await?;
        sql.commit().await?;
        Ok(value)
    }

    /// Runs a write transaction: commits, then publishes its events. The closure's error rolls
    /// everything back. Once the closure has succeeded, the commit and the publication run to
    /// their end even if the caller goes away (a client that hangs up): a committed write is
    /// always published.
    pub async fn write<T, E, F>(&self, f: F) -> Result<T, E>
    where
        E: From<StoreError>,
        F: AsyncFnOnce(&mut Tx) -> Result<T, E>,
    {
        let writer = self
            .inner
            .writers
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| StoreError::Task(e.to_string()))?;
        let mut tx = self.inner.begin().await?;
        let value = match f(&mut tx).await {
            Ok(value) => value,
            Err(e) => {
                // Rolled back before the next writer's turn, not when the connection is reused.
                if let Err(rollback) = tx.sql.rollback().await {
                    tracing::debug!(error = %rollback, "rollback failed");
                }
                return Err(e);
            }
        };
        let events = tx.finish(self.inner.history).await?;
        let inner = self.inner.clone();
        // Ends with the commit and publication; awaited below, and not cancelled with the caller.
        let done = net::task::spawn(async move {
            let committed = inner.commit_and_publish(tx.sql, events).await;
            drop(writer);
            committed
        });
        match done.await {
            Ok(committed) => committed?,
            Err(e) => return Err(StoreError::Task(e.to_string()).into()),
        }
        Ok(value)
    }

    /// Subscribes to `kind`: the missed history when `since` is still retained, else a snapshot
    /// of every row as CREATED events; then live events.
    pub async fn subscribe(
        &self,
        kind: Kind,
        since: Option<u64>,
    ) -> Result<Subscription, StoreError> {
        // Subscribed before the starting point is read: nothing published in between is lost.
        let live = self.inner.feed.subscribe();
        let (revision, resumed, initial) = self
            .read_at_revision(async |sql, current| starting_point(sql, kind, since, current).await)
            .await?;
        Ok(Subscription {
            revision,
            resumed,
            initial,
            live,
        })
    }
}

impl Inner {
    /// A pooled connection.
    async fn connection(&self) -> Result<Sql, StoreError> {
        Ok(Sql(match &self.engine {
            Engine::Sqlite(pool) => Conn::Sqlite(Held::Pooled(pool.acquire().await?)),
            Engine::Postgres { pool, .. } => Conn::Postgres(Held::Pooled(pool.acquire().await?)),
        }))
    }

    /// A read-only snapshot and the revision of the last event committed before it.
    async fn snapshot(&self) -> Result<(Sql, u64), StoreError> {
        let (mut sql, revision) = match &self.engine {
            // A read transaction's snapshot starts at its first read: the revision.
            Engine::Sqlite(pool) => (
                Sql(Conn::Sqlite(Held::Tx(pool.begin().await?))),
                sqlite::REVISION,
            ),
            Engine::Postgres { pool, .. } => (
                Sql(Conn::Postgres(Held::Tx(
                    pool.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                        .await?,
                ))),
                postgres::REVISION,
            ),
        };
        let revision: i64 = sql
            .query_opt(revision, &[])
            .await?
            .ok_or_else(|| StoreError::Decode("no revision".to_owned()))?
            .get(0)?;
        Ok((sql, revision.max(0) as u64))
    }

    /// A write transaction, holding the cluster-wide write lock on PostgreSQL.
    async fn begin(&self) -> Result<Tx, StoreError> {
        match &self.engine {
            // IMMEDIATE: the write lock now, not at the first write.
            Engine::Sqlite(pool) => {
                let tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                Ok(Tx::new(Sql(Conn::Sqlite(Held::Tx(tx))), sqlite::EMIT))
            }
            Engine::Postgres { pool, .. } => {
                let mut sql = Sql(Conn::Postgres(Held::Tx(pool.begin().await?)));
                sql.execute(
                    "SELECT pg_advisory_xact_lock($1)",
                    &[Arg::Int(postgres::WRITE_LOCK)],
                )
                .await?;
                Ok(Tx::new(sql, postgres::EMIT))
            }
        }
    }

    /// Commits a write (waking the other servers' tailers on PostgreSQL), then publishes its
    /// events to this server's watchers, in revision order: on SQLite the caller is the only
    /// writer; on PostgreSQL a write that does not follow on from the last published one reads
    /// what it missed first.
    async fn commit_and_publish(&self, mut sql: Sql, events: Vec<Event>) -> Result<(), StoreError> {
        let shared = matches!(self.engine, Engine::Postgres { .. });
        if let (true, Some(last)) = (shared, events.last()) {
            sql.execute(
                "SELECT pg_notify($1, $2)",
                crate::args![postgres::CHANNEL, last.revision.to_string()],
            )
            .await?;
        }
        sql.commit().await?;
        if !shared {
            // One server: nothing commits between this write and its publication.
            self.feed.send(events);
            return Ok(());
        }
        let _order = self.feed.ordered().await;
        if self.feed.follows_on(&events) {
            self.feed.send(events);
            return Ok(());
        }
        // Committed is committed: a failed catch-up is the tailer's to retry (within a poll
        // interval), not a failed write.
        if let Err(e) = self.fetch_all().await {
            tracing::warn!(error = %e, "cannot publish a committed write yet");
        }
        Ok(())
    }

    /// Publishes what other servers committed (PostgreSQL).
    async fn catch_up(&self) -> Result<(), StoreError> {
        let _order = self.feed.ordered().await;
        self.fetch_all().await
    }

    /// Publishes every committed event after the last published one; the caller holds the
    /// feed's order.
    async fn fetch_all(&self) -> Result<(), StoreError> {
        let mut sql = self.connection().await?;
        loop {
            let batch = events_after(&mut sql, None, self.feed.revision()).await?;
            if batch.is_empty() {
                return Ok(());
            }
            self.feed.send(batch);
        }
    }
}

/// Follows the changes committed through other servers: wakes on NOTIFY, polls every
/// [`POLL_INTERVAL`] in case a notification was lost, and catches up after every reconnect of
/// its listening connection (notifications sent while it was away are gone).
async fn tail(inner: Weak<Inner>, pool: sqlx::PgPool, stop: CancellationToken) {
    let mut backoff =
        net::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        let listening = tokio::select! {
            _ = stop.cancelled() => return,
            listening = postgres::listen(&pool, stop.clone()) => listening,
        };
        let mut wake = match listening {
            Ok(wake) => wake,
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
            if let Err(e) = inner.catch_up().await {
                tracing::warn!(error = %e, "cannot read database changes");
            }
        }
    }
}

impl std::fmt::Debug for Tx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("sql", &self.sql)
            .field("events", &self.events.len())
            .finish()
    }
}

impl Tx {
    fn new(sql: Sql, emit: &'static str) -> Self {
        Self {
            sql,
            emit,
            events: Vec::new(),
        }
    }

    /// The transaction, for queries.
    pub fn sql(&mut self) -> &mut Sql {
        &mut self.sql
    }

    /// Appends an event for `kind` with the object's JSON.
    pub async fn emit<T: Serialize>(
        &mut self,
        kind: Kind,
        event_type: EventType,
        object_id: i64,
        object: &T,
    ) -> Result<(), StoreError> {
        let data: Arc<str> = serde_json::to_string(object)?.into();
        let revision = self
            .sql
            .insert(
                self.emit,
                &[
                    Arg::Text(kind.as_str()),
                    Arg::Int(event_type.code().into()),
                    Arg::Int(object_id),
                    Arg::Text(&data),
                ],
            )
            .await?;
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
    async fn finish(&mut self, history: u64) -> Result<Vec<Event>, StoreError> {
        if let Some(last) = self.events.last() {
            // A range delete on the primary key is cheap when empty.
            let keep_from = last.revision.saturating_sub(history);
            self.sql
                .execute(
                    "DELETE FROM events WHERE revision <= $1",
                    &[Arg::Int(keep_from as i64)],
                )
                .await?;
        }
        Ok(std::mem::take(&mut self.events))
    }
}

/// Loads one row's JSON of `kind` by id.
pub async fn get<T: DeserializeOwned>(
    sql: &mut Sql,
    kind: Kind,
    id: i64,
) -> Result<Option<T>, StoreError> {
    let query = format!(
        "SELECT {} FROM {} WHERE id = $1",
        kind.data_column(),
        kind.table()
    );
    sql.query_opt(&query, &[Arg::Int(id)])
        .await?
        .map(|row| Ok(serde_json::from_str(&row.get::<String>(0)?)?))
        .transpose()
}

/// Loads every row of `kind` (its `data` column) in id order, optionally filtered by a SQL
/// condition on the table's columns.
pub async fn list<T: DeserializeOwned>(
    sql: &mut Sql,
    kind: Kind,
    filter: Option<(&str, i64)>,
) -> Result<Vec<T>, StoreError> {
    let (column, table) = (kind.data_column(), kind.table());
    let rows = match filter {
        Some((by, value)) => {
            let query = format!("SELECT {column} FROM {table} WHERE {by} = $1 ORDER BY id");
            sql.query(&query, &[Arg::Int(value)]).await?
        }
        None => {
            let query = format!("SELECT {column} FROM {table} ORDER BY id");
            sql.query(&query, &[]).await?
        }
    };
    rows.iter()
        .map(|row| Ok(serde_json::from_str(&row.get::<String>(0)?)?))
        .collect()
}

/// Counts rows of a table matching `column = value`.
pub async fn count(
    sql: &mut Sql,
    table: &str,
    column: &str,
    value: i64,
) -> Result<u64, StoreError> {
    let query = format!("SELECT count(*) FROM {table} WHERE {column} = $1");
    let n: i64 = sql
        .query_opt(&query, &[Arg::Int(value)])
        .await?
        .map_or(Ok(0), |row| row.get(0))?;
    Ok(n.max(0) as u64)
}

/// A watcher's starting point at `current`: `(revision, resumed, initial events)`.
async fn starting_point(
    sql: &mut Sql,
    kind: Kind,
    since: Option<u64>,
    current: u64,
) -> Result<(u64, bool, Vec<Event>), StoreError> {
    if let Some(since) = since.filter(|s| *s <= current) {
        let oldest: Option<i64> = sql
            .query_opt("SELECT min(revision) FROM events", &[])
            .await?
            .map_or(Ok(None), |row| row.get(0))?;
        // Resumable when nothing after `since` has been pruned.
        let oldest = oldest.map_or(current + 1, |o| o.max(0) as u64);
        if since + 1 >= oldest || since == current {
            let mut initial = Vec::new();
            let mut after = since;
            loop {
                let batch = events_after(sql, Some(kind), after).await?;
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
    Ok((current, false, snapshot_events(sql, kind, current).await?))
}

/// Up to [`CATCH_UP_BATCH`] committed events after revision `after`, of `kind` or of every kind.
async fn events_after(
    sql: &mut Sql,
    kind: Option<Kind>,
    after: u64,
) -> Result<Vec<Event>, StoreError> {
    let after = Arg::Int(after as i64);
    let rows = match kind {
        Some(kind) => {
            sql.query(
                "SELECT revision, kind, type, object_id, data FROM events
                 WHERE kind = $1 AND revision > $2 ORDER BY revision LIMIT $3",
                &[Arg::Text(kind.as_str()), after, Arg::Int(CATCH_UP_BATCH)],
            )
            .await?
        }
        None => {
            sql.query(
                "SELECT revision, kind, type, object_id, data FROM events
                 WHERE revision > $1 ORDER BY revision LIMIT $2",
                &[after, Arg::Int(CATCH_UP_BATCH)],
            )
            .await?
        }
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

async fn snapshot_events(
    sql: &mut Sql,
    kind: Kind,
    revision: u64,
) -> Result<Vec<Event>, StoreError> {
    let query = format!(
        "SELECT id, {} FROM {} ORDER BY id",
        kind.data_column(),
        kind.table()
    );
    let mut out = Vec::new();
    for row in sql.query(&query, &[]).await? {
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
