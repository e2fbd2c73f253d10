//! Byte relays for connections taken over by `CONNECT`, and their drain at shutdown: the
//! worker proxy's instance relay and the proxy port's relays share this.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::Request;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
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

/// `work` to its end, or `None` once `stop` is cancelled (checked through [`StopSignal`]).
async fn until_stopped<F: Future>(work: F, stop: &CancellationToken) -> Option<F::Output> {
    let mut stop = StopSignal::new(stop.clone());
    tokio::pin!(work);
    poll_fn(|cx| {
        if let Poll::Ready(out) = work.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        stop.poll(cx).map(|()| None)
    })
    .await
}

/// A `CancellationToken` watched from a task that polls often (a relay on every read and
/// write, a tunnel's connection task on every pass). Polling `cancelled()` takes the token's
/// lock each time; this polls that future only when the task's waker is not the one it holds
/// already, and otherwise reads the flag: the registered waker is woken on cancellation, and
/// the flag then says why.
#[derive(Debug)]
pub struct StopSignal {
    token: CancellationToken,
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    registered: Option<Waker>,
}

impl StopSignal {
    pub fn new(token: CancellationToken) -> Self {
        Self {
            cancelled: Box::pin(token.clone().cancelled_owned()),
            token,
            registered: None,
        }
    }

    /// Ready once the token is cancelled; otherwise `cx`'s task is woken when it is.
    pub fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.token.is_cancelled() {
            return Poll::Ready(());
        }
        if !self
            .registered
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            if self.cancelled.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            self.registered = Some(cx.waker().clone());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[tokio::test]
    async fn a_stop_wakes_the_waiting_task_and_stays_set() {
        let token = CancellationToken::new();
        let waiting = tokio::spawn({
            let mut signal = StopSignal::new(token.clone());
            async move { poll_fn(|cx| signal.poll(cx)).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        token.cancel();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken")
            .unwrap();
        // Later polls see it at once.
        let mut signal = StopSignal::new(token);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(signal.poll(&mut cx).is_ready());
    }

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
