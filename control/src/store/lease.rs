//! Work that must run on one server at a time (the heartbeat monitor): on PostgreSQL the server
//! holding a session advisory lock runs it. The lock goes with its connection, so when the
//! holder dies (its sockets close with it) PostgreSQL releases it at once and another server
//! takes it at its next try, within [`RETRY`]. On SQLite there is one server: it always holds it.

use std::time::Duration;

use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::postgres::CONNECT_TIMEOUT;

/// How often a server that does not hold a role tries to take it, and how often the holder
/// checks that its connection (and so its lock) is still there.
pub const RETRY: Duration = Duration::from_secs(1);

/// Work that one server runs for all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Marks workers whose heartbeats stopped `not_ready`.
    HeartbeatMonitor,
}

impl Role {
    fn key(self) -> i64 {
        match self {
            Role::HeartbeatMonitor => 0x6661_6465_6e10,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Role::HeartbeatMonitor => "heartbeat monitor",
        }
    }
}

/// Whether this server holds a role now.
#[derive(Clone, Debug)]
pub struct Leadership {
    held: watch::Receiver<bool>,
}

impl Leadership {
    pub(super) fn always() -> Self {
        Self {
            held: watch::channel(true).1,
        }
    }

    pub fn is_held(&self) -> bool {
        *self.held.borrow()
    }

    /// Waits until holding changes (for tests and logs); `false` once nobody can change it.
    pub async fn changed(&mut self) -> bool {
        self.held.changed().await.is_ok()
    }
}

/// Tries to take `role` until `shutdown`, holding it while its connection lives.
pub(super) fn elect(
    target: PgConnectOptions,
    role: Role,
    shutdown: CancellationToken,
) -> Leadership {
    let (tx, rx) = watch::channel(false);
    net::task::spawn(async move {
        loop {
            hold(&target, role, &tx, &shutdown).await;
            if tx.send_replace(false) {
                tracing::warn!(role = role.name(), "this server no longer runs it");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(RETRY) => {}
            }
        }
    });
    Leadership { held: rx }
}

/// One connection's life: try the lock every [`RETRY`]; once held, check the connection every
/// [`RETRY`]. Returns when the connection fails (or at shutdown, which closes it and so frees
/// the lock for the others).
async fn hold(
    target: &PgConnectOptions,
    role: Role,
    held: &watch::Sender<bool>,
    shutdown: &CancellationToken,
) {
    let connected = tokio::select! {
        _ = shutdown.cancelled() => return,
        connected = tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(target)) => connected,
    };
    let mut conn = match connected {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            tracing::debug!(role = role.name(), error = %e, "cannot reach the database");
            return;
        }
        Err(_) => {
            tracing::debug!(role = role.name(), "cannot reach the database in time");
            return;
        }
    };
    let mut tick = tokio::time::interval(RETRY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        // A database that stops answering is a lost connection (and so a lost lock) too.
        if *held.borrow() {
            match tokio::time::timeout(CONNECT_TIMEOUT, conn.ping()).await {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => {
                    tracing::warn!(role = role.name(), error = %e, "lost the database connection");
                }
                Err(_) => tracing::warn!(role = role.name(), "the database stopped answering"),
            }
            return;
        }
        let tried = sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_lock($1)")
            .bind(role.key())
            .fetch_one(&mut conn);
        match tokio::time::timeout(CONNECT_TIMEOUT, tried).await {
            Ok(Ok(true)) => {
                tracing::info!(role = role.name(), "this server now runs it");
                held.send_replace(true);
            }
            Ok(Ok(false)) => {}
            Ok(Err(e)) => {
                tracing::debug!(role = role.name(), error = %e, "cannot try the lock");
                return;
            }
            Err(_) => {
                tracing::debug!(role = role.name(), "the database stopped answering");
                return;
            }
        }
    }
}
