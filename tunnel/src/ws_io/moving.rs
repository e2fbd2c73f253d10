//! The server's request that a worker move its tunnel to another server, as a WebSocket ping
//! with a payload of its own ([`MOVE_PAYLOAD`]): out of band, beside the streams, so that the
//! tunnel serves on while the worker dials the next server. A peer that does not know it
//! answers it as any ping.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Waker;

use futures_util::task::AtomicWaker;
use tokio_util::sync::CancellationToken;

/// The payload of the move ping.
pub(crate) const MOVE_PAYLOAD: &[u8] = b"faden:move";

/// One tunnel's move request: the server asks with [`MoveSignal::request`], the worker learns
/// of it through [`MoveSignal::asked`]. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct MoveSignal {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// A move ping is to be sent (server side).
    pending: AtomicBool,
    /// The connection task, woken to send it.
    task: AtomicWaker,
    /// A move ping was received (worker side).
    asked: CancellationToken,
}

impl MoveSignal {
    /// Sends the move ping on this tunnel (once per call).
    pub fn request(&self) {
        self.inner.pending.store(true, Ordering::Release);
        self.inner.task.wake();
    }

    /// Fires when the peer asked this side to move.
    pub fn asked(&self) -> CancellationToken {
        self.inner.asked.clone()
    }

    /// Whether a move ping is due, clearing it.
    pub(super) fn take_request(&self) -> bool {
        self.inner.pending.load(Ordering::Relaxed)
            && self.inner.pending.swap(false, Ordering::Acquire)
    }

    /// The connection task to wake for [`MoveSignal::request`].
    pub(super) fn register(&self, waker: &Waker) {
        self.inner.task.register(waker);
    }

    /// The peer's move ping arrived.
    pub(super) fn received(&self) {
        self.inner.asked.cancel();
    }
}
