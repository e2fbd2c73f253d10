//! The timed SSE body of a streamed answer.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use crate::Jitter;
use crate::perf::Ticket;
use crate::render::{Render, SSE_DONE};
use crate::rng::SplitMix64;
use crate::stats::MockStats;

/// Counts a generation request in flight while it lives, and a disconnect when it is dropped
/// before it finished.
pub(crate) struct DisconnectGuard {
    pub(crate) stats: Arc<MockStats>,
    pub(crate) armed: bool,
}

impl DisconnectGuard {
    pub(crate) fn new(stats: Arc<MockStats>) -> Self {
        stats.in_flight.fetch_add(1, Ordering::Relaxed);
        stats.changes.send_modify(|n| *n += 1);
        Self { stats, armed: true }
    }
}

impl Drop for DisconnectGuard {
    fn drop(&mut self) {
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.stats.changes.send_modify(|n| *n += 1);
        if self.armed {
            self.stats.disconnects.send_modify(|n| *n += 1);
        }
    }
}

/// A stream's request in the performance model: between tokens, or waiting for the next one.
pub(crate) enum ModelRun {
    Ready(Ticket),
    Waiting(Pin<Box<dyn std::future::Future<Output = Ticket> + Send>>),
}

/// The injected mid-stream failure.
#[derive(Debug, thiserror::Error)]
#[error("mock engine aborted the stream")]
pub struct MockAbort;

/// A timed SSE body: one frame per event, each flushed as it is produced.
pub struct SseBody {
    pub(crate) render: Render,
    pub(crate) include_usage: bool,
    pub(crate) abort_after: usize,
    /// Next token to send.
    pub(crate) next: usize,
    /// After the tokens: 0 = usage (if any), 1 = `[DONE]`, 2 = finished.
    pub(crate) tail: u8,
    /// When the next token is due (an absolute schedule: delays do not drift).
    pub(crate) next_deadline: Instant,
    pub(crate) itl: Duration,
    pub(crate) itl_jitter: Jitter,
    /// Extra delay after the first token (an injected stall).
    pub(crate) stall_after: Duration,
    pub(crate) rng: SplitMix64,
    pub(crate) sleep: Option<Pin<Box<Sleep>>>,
    /// Under the performance model, the request's place in it (the timing fields above are then
    /// unused); dropped when the last token is out.
    pub(crate) run: Option<ModelRun>,
    pub(crate) guard: DisconnectGuard,
}

impl std::fmt::Debug for SseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SseBody")
            .field("next", &self.next)
            .field("tokens", &self.render.tokens)
            .finish_non_exhaustive()
    }
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = MockAbort;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, MockAbort>>> {
        let this = &mut *self;
        if this.next < this.render.tokens {
            if let Some(run) = this.run.take() {
                let mut wait = match run {
                    ModelRun::Waiting(wait) => wait,
                    ModelRun::Ready(mut ticket) => {
                        let i = this.next;
                        Box::pin(async move {
                            ticket.token(i).await;
                            ticket
                        })
                    }
                };
                let Poll::Ready(ticket) = wait.as_mut().poll(cx) else {
                    this.run = Some(ModelRun::Waiting(wait));
                    return Poll::Pending;
                };
                this.render.cached_tokens = Some(ticket.cached_tokens());
                // The request leaves the model with its last token.
                if this.next + 1 < this.render.tokens {
                    this.run = Some(ModelRun::Ready(ticket));
                }
            } else if this.next_deadline > Instant::now() {
                let deadline = this.next_deadline;
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if sleep.deadline() != deadline {
                    sleep.as_mut().reset(deadline);
                }
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            // The engine dies while producing this token (what it sent before is flushed).
            if this.next == this.abort_after {
                this.run = None;
                this.guard.armed = false;
                this.render.tokens = 0;
                this.tail = 2;
                this.guard.stats.aborted.fetch_add(1, Ordering::Relaxed);
                return Poll::Ready(Some(Err(MockAbort)));
            }
            let event = this.render.token_event(this.next);
            this.next += 1;
            this.guard
                .stats
                .generation_tokens
                .fetch_add(1, Ordering::Relaxed);
            this.next_deadline += this.itl_jitter.apply(this.itl, &mut this.rng);
            if this.next == 1 {
                this.next_deadline += this.stall_after;
            }
            return Poll::Ready(Some(Ok(Frame::data(event))));
        }
        if this.tail == 0 {
            this.tail = 1;
            if this.include_usage {
                return Poll::Ready(Some(Ok(Frame::data(this.render.usage_event()))));
            }
        }
        if this.tail == 1 {
            this.tail = 2;
            this.guard.armed = false;
            this.guard.stats.completed.fetch_add(1, Ordering::Relaxed);
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(SSE_DONE)))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.tail == 2
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
