//! A stop signal for tasks that poll by hand.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// A `CancellationToken` watched from a task that polls by hand (a relay, a tunnel's connection
/// task): the token's own future, polled on each pass. A flag-and-waker of its own saved 2-3 %
/// of the tunnel's instructions per request, under the bar for hand-written code
/// (docs/development.md).
#[derive(Debug)]
pub struct StopSignal {
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    stopped: bool,
}

impl StopSignal {
    pub fn new(token: CancellationToken) -> Self {
        Self {
            cancelled: Box::pin(token.cancelled_owned()),
            stopped: false,
        }
    }

    /// `work`'s output, or `None` once the token is cancelled first.
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
        if self.stopped {
            return Poll::Ready(());
        }
        if self.cancelled.as_mut().poll(cx).is_ready() {
            self.stopped = true;
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

    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::task::{Wake, Waker};
    use std::time::Duration;

    use super::*;

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
        tokio::time::timeout(Duration::from_secs(5), waiting)
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
