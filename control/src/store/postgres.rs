//! The PostgreSQL engine, for several servers on one database.
//!
//! Every write transaction first takes one transaction-scoped advisory lock, so writes are
//! serialised across all servers exactly as SQLite's single writer serialises them: handlers keep
//! their read-check-write logic, and revisions (a counter row bumped inside the transaction)
//! become visible in revision order. A reader that fetches "events after N" therefore never
//! skips a commit that lands late, which a sequence alone would allow. NOTIFY only wakes the
//! other servers' tailers; the `events` table is the truth, and a periodic poll covers a lost
//! notification.

use std::str::FromStr;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions, PgSslMode};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::StoreError;
use super::migrate;
use super::sql::{Conn, Held, Sql};

/// Connections each server keeps for reads and writes (the tailer's listener holds one).
const POOL_SIZE: u32 = 8;
/// How long a pooled connection may sit idle before it is pinged on its next use.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// Write transactions one server runs at once: they queue on the cluster-wide write lock, and
/// one that waits there has its connection and `BEGIN` done already; the cap leaves the rest of
/// the pool to reads.
pub(super) const WRITERS: usize = 3;
/// How long a request waits for a connection (a new one included) before it fails.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Key of the advisory lock every write transaction holds.
pub(super) const WRITE_LOCK: i64 = 0x6661_6465_6e01;
/// Key of the advisory lock migrations hold, so servers starting together migrate once.
const MIGRATE_LOCK: i64 = 0x6661_6465_6e02;
/// The channel NOTIFY wakes tailers on.
pub(super) const CHANNEL: &str = "faden_events";

/// SQL that appends one event with the next revision (the counter row is bumped in the same
/// transaction, under the write lock).
pub(super) const EMIT: &str =
    "WITH r AS (UPDATE faden_revision SET revision = revision + 1 RETURNING revision)
     INSERT INTO events (revision, kind, type, object_id, data)
     SELECT revision, $1::text, $2::bigint, $3::bigint, $4::text FROM r RETURNING revision";

/// The revision of the last committed event (the counter row).
pub(super) const REVISION: &str = "SELECT revision FROM faden_revision";

/// Parses a `postgres://` URL (libpq's syntax). `sslmode=disable` connects in plain TCP;
/// `prefer` (the default) uses TLS when the server offers it; `require` insists on TLS and, as
/// `verify-full`, checks the server's certificate and name against the platform's roots (or
/// `sslrootcert`); `verify-ca` checks the certificate only.
pub(super) fn options(url: &str) -> Result<PgConnectOptions, StoreError> {
    let mut options = PgConnectOptions::from_str(url)
        .map_err(|e| StoreError::Open(format!("database URL: {e}")))?;
    if options.get_application_name().is_none() {
        options = options.application_name("faden");
    }
    if matches!(options.get_ssl_mode(), PgSslMode::Require) {
        options = options.ssl_mode(PgSslMode::VerifyFull);
    }
    Ok(options)
}

/// Connects the pool (once first, so a bad URL fails at start) and applies pending migrations.
pub(super) async fn open(options: PgConnectOptions) -> Result<PgPool, StoreError> {
    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .acquire_timeout(CONNECT_TIMEOUT)
        // A connection in use is known to be alive: only one idle for a while is pinged (a
        // dead one is replaced), which spares the round trip on every request under load.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > IDLE_CHECK {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
        .connect_with(options)
        .await?;
    migrate(&pool).await?;
    Ok(pool)
}

async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
    let mut sql = Sql(Conn::Postgres(Held::Tx(pool.begin().await?)));
    sql.execute(
        "SELECT pg_advisory_xact_lock($1)",
        crate::args![MIGRATE_LOCK],
    )
    .await?;
    sql.batch("CREATE TABLE IF NOT EXISTS faden_schema (version BIGINT NOT NULL)")
        .await?;
    let version = match sql
        .query_opt("SELECT version FROM faden_schema", &[])
        .await?
    {
        Some(row) => row.get(0)?,
        None => {
            sql.execute("INSERT INTO faden_schema (version) VALUES (0)", &[])
                .await?;
            0
        }
    };
    for (next, migration) in migrate::pending(version, migrate::POSTGRES)? {
        tracing::info!(
            version = next,
            migration = migration.name,
            "migrating the database"
        );
        sql.batch(migration.sql).await?;
        sql.execute("UPDATE faden_schema SET version = $1", crate::args![next])
            .await?;
    }
    sql.commit().await
}

/// Listens for NOTIFY on [`CHANNEL`]: each notification, and each reconnect of the listening
/// connection (notifications sent while it was away are gone), is a wake-up on the returned
/// channel. The channel closes when the listener fails for good (the caller listens anew).
pub(super) async fn listen(
    pool: &PgPool,
    stop: CancellationToken,
) -> Result<mpsc::UnboundedReceiver<()>, StoreError> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(CHANNEL).await?;
    let (wake, woken) = mpsc::unbounded_channel();
    // Ends at `stop`, when the receiver is dropped, or when the listener fails.
    net::task::spawn(async move {
        loop {
            let received = tokio::select! {
                _ = stop.cancelled() => return,
                _ = wake.closed() => return,
                received = listener.try_recv() => received,
            };
            match received {
                // `None`: the connection was lost and is back (the listener reconnects).
                Ok(_) => {
                    if wake.send(()).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "database listener ended");
                    return;
                }
            }
        }
    });
    Ok(woken)
}
