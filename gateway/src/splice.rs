//! Byte relays for connections taken over by `CONNECT`, and their drain at shutdown: the
//! worker proxy's instance relay and the proxy port's relays share this.

use std::future::{Future, poll_fn};
use std::task::{Poll, Waker};
use std::time::Duration;

use http::Request;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The open relays of one listener. Cheap to clone; clones share.
#[derive(Clone, Debug, Default)]
pub struct Relays {
    tasks: TaskTracker,
    /// Ends the relays still open when the drain timeout is over.
    hard_stop: CancellationToken,
}

impl Relays {
    pub fn new() -> Self {
        Self::default()
    }

    /// Spawns the relay of `req`'s connection: once hyper hands it over (after the 200 answer
    /// went out), bytes are copied both ways between it and `far` through one 8 KiB buffer per
    /// direction. Each direction's end (EOF) becomes a shutdown of the other side's write half
    /// (half-close passed on); an error on either side (a reset: the peer went away) ends
    /// both, which closes `far`.
    pub fn spawn<B, T>(&self, req: &mut Request<B>, far: T)
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let on_upgrade = hyper::upgrade::on(req);
        let stop = self.hard_stop.clone();
        self.tasks.spawn(async move {
            let upgraded = match on_upgrade.await {
                Ok(u) => u,
                Err(e) => {
                    tracing::debug!(error = %e, "CONNECT: the connection was not handed over");
                    return;
                }
            };
            let mut near = TokioIo::new(upgraded);
            let mut far = far;
            let relay = tokio::io::copy_bidirectional(&mut near, &mut far);
            if let Some(Err(e)) = until_stopped(relay, &stop).await {
                tracing::debug!(error = %e, "CONNECT: relay ended with an error");
            }
        });
    }

    /// Refuses new relays, waits up to `timeout` for the open ones to end, then ends the rest.
    pub async fn drain(&self, timeout: Duration, listener: &str) {
        self.tasks.close();
        if tokio::time::timeout(timeout, self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                listener,
                "drain timeout: closing the remaining CONNECT relays"
            );
        }
        self.hard_stop.cancel();
        self.tasks.wait().await;
    }
}

/// `work` to its end, or `None` once `stop` is cancelled. A relay is polled on every read and
/// write, and polling `cancelled()` takes the token's lock each time: so the token's future is
/// polled only when the task's waker is not the one it holds already, and otherwise the flag
/// is read (the registered waker is woken on cancellation, and the flag then says why).
async fn until_stopped<F: Future>(work: F, stop: &CancellationToken) -> Option<F::Output> {
    let cancelled = stop.cancelled();
    tokio::pin!(work, cancelled);
    let mut registered: Option<Waker> = None;
    poll_fn(|cx| {
        if let Poll::Ready(out) = work.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        if stop.is_cancelled() {
            return Poll::Ready(None);
        }
        if !registered.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            if cancelled.as_mut().poll(cx).is_ready() {
                return Poll::Ready(None);
            }
            registered = Some(cx.waker().clone());
        }
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[tokio::test]
    async fn work_ends_on_its_own_or_when_stopped() {
        let stop = CancellationToken::new();
        assert_eq!(until_stopped(async { 7 }, &stop).await, Some(7));

        // Work that waits (and is polled again and again by wake-ups of its own) ends once
        // the token is cancelled, however late.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
        let waiting = tokio::spawn({
            let stop = stop.clone();
            async move { until_stopped(async move { while rx.recv().await.is_some() {} }, &stop).await }
        });
        for _ in 0..3 {
            tx.send(()).await.unwrap();
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished());
        stop.cancel();
        let out = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("stopped")
            .unwrap();
        assert_eq!(out, None);
        // Already cancelled: returns at once.
        assert_eq!(
            until_stopped(std::future::pending::<()>(), &stop).await,
            None
        );
    }
}
