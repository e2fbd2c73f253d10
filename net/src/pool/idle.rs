//! The idle connections by key, checked out most recent first, and their reaper.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::PoolConfig;
use super::conn::Conn;
use crate::hash::FastBuild;

#[derive(Debug)]
pub(super) struct PoolInner {
    pub(super) config: PoolConfig,
    pub(super) idle: Mutex<HashMap<Arc<str>, Vec<Idle>, FastBuild>>,
    pub(super) reaper: AtomicBool,
    /// Cancelled when the pool is dropped: the reaper stops at once, not at its next tick.
    pub(super) _stop_reaper: tokio_util::sync::DropGuard,
    pub(super) stop_reaper: tokio_util::sync::CancellationToken,
}

#[derive(Debug)]
pub(super) struct Idle {
    pub(super) conn: Box<Conn>,
    since: Instant,
}

impl PoolInner {
    pub(super) fn lock(
        &self,
    ) -> parking_lot::MutexGuard<'_, HashMap<Arc<str>, Vec<Idle>, FastBuild>> {
        self.idle.lock()
    }

    /// The most recently used idle connection to `key` that has not timed out and is still
    /// usable.
    pub(super) fn checkout(&self, key: &str) -> Option<Box<Conn>> {
        let mut retired = Vec::new();
        let found = {
            let mut idle = self.lock();
            let list = idle.get_mut(key)?;
            loop {
                match list.pop() {
                    Some(entry) if entry.since.elapsed() < self.config.idle_timeout => {
                        let mut conn = entry.conn;
                        if conn.is_usable() {
                            break Some(conn);
                        }
                        retired.push(conn);
                    }
                    Some(entry) => {
                        // The newest one is too old, so are the others.
                        retired.push(entry.conn);
                        retired.extend(list.drain(..).map(|e| e.conn));
                        break None;
                    }
                    None => break None,
                }
            }
        };
        // Closed outside the lock.
        drop(retired);
        found
    }

    pub(super) fn put(self: &Arc<Self>, conn: Box<Conn>) {
        start_reaper(self);
        let surplus = {
            let mut idle = self.lock();
            let list = match idle.get_mut(&*conn.key) {
                Some(list) => list,
                None => idle.entry(conn.key.clone()).or_default(),
            };
            list.push(Idle {
                conn,
                since: Instant::now(),
            });
            (list.len() > self.config.max_idle).then(|| list.remove(0))
        };
        drop(surplus);
    }

    pub(super) fn reap(&self) {
        let mut expired = Vec::new();
        {
            let mut idle = self.lock();
            idle.retain(|_, list| {
                let keep_from = list
                    .iter()
                    .position(|e| e.since.elapsed() < self.config.idle_timeout)
                    .unwrap_or(list.len());
                expired.extend(list.drain(..keep_from));
                !list.is_empty()
            });
        }
        drop(expired);
    }
}

/// Closes idle connections past the idle timeout even when no request comes (started with the
/// first idle connection).
fn start_reaper(pool: &Arc<PoolInner>) {
    if pool.reaper.swap(true, Ordering::Relaxed) {
        return;
    }
    let weak = Arc::downgrade(pool);
    let stop = pool.stop_reaper.clone();
    let every = pool.config.idle_timeout.max(Duration::from_millis(100));
    // Ends with the pool: `stop_reaper` is cancelled when the pool is dropped.
    crate::task::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(every) => {}
            }
            let Some(pool) = weak.upgrade() else { break };
            pool.reap();
        }
    });
}
