//! Waiting for a condition instead of for time: a bounded poll that fails the test with a
//! name for what never happened.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// Pause between two checks of a polled condition.
pub const POLL: Duration = Duration::from_millis(5);

/// Polls `cond` until it holds; panics naming `what` when `limit` passes first.
pub async fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?}: {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// [`wait_until`] for a condition that must be awaited (a request, a connect).
pub async fn wait_until_async<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        // The check itself may hang (a connect to a stopped peer): it counts against `limit`.
        if let Ok(true) = tokio::time::timeout_at(deadline, cond()).await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?}: {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}
