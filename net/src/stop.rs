//! A stop signal cheap to poll often.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// A `CancellationToken` watched from a task that polls often (a relay on every read and
/// write, a tunnel's connection task on every pass). The token's own checks take its lock
/// (`is_cancelled` as much as polling `cancelled()`); this polls `cancelled()` once, with a
/// waker of its own that sets a flag and wakes the task, so that a poll is a read of that
/// flag, plus a swap of the task's waker when the task's waker changed.
#[derive(Debug)]
pub struct StopSignal {
    stop: Arc<Stop>,
    /// Polled once, at the first poll (with `stop`'s waker, which it then holds).
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    /// The task's waker that `stop` holds; `None` until the first poll.
    registered: Option<Waker>,
}

/// What the token's wake-up reaches: the only thing that wakes it is the cancellation.
#[derive(Debug, Default)]
struct Stop {
    stopped: AtomicBool,
    task: parking_lot::Mutex<Option<Waker>>,
}

impl Wake for Stop {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.stopped.store(true, Ordering::SeqCst);
        let task = self.task.lock().take();
        if let Some(task) = task {
            task.wake();
        }
    }
}

impl StopSignal {
    pub fn new(token: CancellationToken) -> Self {
        Self {
            stop: Arc::default(),
            cancelled: Box::pin(token.cancelled_owned()),
            registered: None,
        }
    }

    /// `work`'s output, or `None` once the token is cancelled first; `work` stays with the
    /// caller (to be shut down gracefully, say).
    pub async fn or_stopped<F: Future>(&mut self, mut work: Pin<&mut F>) -> Option<F::Output> {
        poll_fn(|cx| {
            if let Poll::Ready(out) = work.as_mut().poll(cx) {
                return Poll::Ready(Some(out));
            }
            self.poll(cx).map(|()| None)
        })
        .await
    }

    /// Ready once the token is cancelled; otherwise `cx`'s task is woken when it is.
    pub fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.stop.stopped.load(Ordering::SeqCst) {
            return Poll::Ready(());
        }
        if self
            .registered
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            return Poll::Pending;
        }
        *self.stop.task.lock() = Some(cx.waker().clone());
        let first = self.registered.replace(cx.waker().clone()).is_none();
        if first {
            let waker = Waker::from(self.stop.clone());
            if self
                .cancelled
                .as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_ready()
            {
                self.stop.stopped.store(true, Ordering::SeqCst);
            }
        }
        // A cancellation between the first check and the new waker woke the old one (or
        // none): the flag says so.
        if self.stop.stopped.load(Ordering::SeqCst) {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::disallowed_methods
    )]

    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_stop_wakes_the_waiting_task_and_stays_set() {
        let token = CancellationToken::new();
        let waiting = tokio::spawn({
            let mut signal = StopSignal::new(token.clone());
            async move { poll_fn(|cx| signal.poll(cx)).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        token.cancel();
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("woken")
            .unwrap();
        // Later polls see it at once.
        let mut signal = StopSignal::new(token);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(signal.poll(&mut cx).is_ready());
    }

    /// Counts its wake-ups.
    #[derive(Default)]
    struct Count(std::sync::atomic::AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_stop_wakes_the_waker_of_the_last_poll_only() {
        let token = CancellationToken::new();
        let mut signal = StopSignal::new(token.clone());
        let (first, second) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let (first_waker, second_waker) = (Waker::from(first.clone()), Waker::from(second.clone()));
        for _ in 0..3 {
            assert!(
                signal
                    .poll(&mut Context::from_waker(&first_waker))
                    .is_pending()
            );
        }
        // The task moved (another waker): the new one is woken, the old one not.
        assert!(
            signal
                .poll(&mut Context::from_waker(&second_waker))
                .is_pending()
        );
        token.cancel();
        assert_eq!(first.0.load(Ordering::SeqCst), 0);
        assert_eq!(second.0.load(Ordering::SeqCst), 1);
        assert!(
            signal
                .poll(&mut Context::from_waker(&first_waker))
                .is_ready()
        );
    }
}
