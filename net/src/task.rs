//! The one place faden's libraries spawn a task outside a `TaskTracker` or `JoinSet`.
//!
//! `tokio::spawn` is banned by clippy's `disallowed_methods` (clippy.toml), so that every task has
//! a visible owner: a tracker or join set that its owner drains at shutdown, or this function,
//! whose callers say at the call what ends the task (the handle they keep and await, the
//! shutdown token it watches, the one connection or the weakly held pool it serves).

use std::future::Future;

/// Spawns `task`, whose end the caller has bounded (say how at the call).
#[allow(clippy::disallowed_methods)]
pub fn spawn<F>(task: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(task)
}
