//! The live side of the watch contract: committed events, published to this server's watchers
//! in revision order, each once, and the revision they reached.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::broadcast;

use super::Event;

/// Capacity of the live event channel; a watcher that falls this far behind is disconnected and
/// resumes with `?since=`.
const LIVE_CHANNEL: usize = 4096;

#[derive(Debug)]
pub(super) struct Feed {
    live: Mutex<broadcast::Sender<Arc<Event>>>,
    /// The revision of the last published event.
    revision: AtomicU64,
    /// Held while publishing, so that a writer and the tailer interleave in revision order.
    publishing: tokio::sync::Mutex<()>,
}

impl Feed {
    pub(super) fn new(revision: u64) -> Self {
        Self {
            live: Mutex::new(broadcast::channel(LIVE_CHANNEL).0),
            revision: AtomicU64::new(revision),
            publishing: tokio::sync::Mutex::new(()),
        }
    }

    pub(super) fn revision(&self) -> u64 {
        self.revision.load(Ordering::Acquire)
    }

    pub(super) fn subscribe(&self) -> broadcast::Receiver<Arc<Event>> {
        self.live.lock().subscribe()
    }

    /// Held while publishing, so that a writer and the tailer interleave in revision order.
    pub(super) async fn ordered(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.publishing.lock().await
    }

    /// Whether `events` follow on from the last published one (no other server committed in
    /// between): they can be sent as they are, without reading the events table.
    pub(super) fn follows_on(&self, events: &[Event]) -> bool {
        events
            .first()
            .is_none_or(|first| first.revision == self.revision() + 1)
    }

    /// Sends events that are newer than the last published one, in order. A jump in revisions
    /// means the history was compacted past what this server published: its watchers have
    /// missed events, so their streams are ended and they resume from the history (or get a
    /// snapshot).
    pub(super) fn send(&self, events: Vec<Event>) {
        let mut live = self.live.lock();
        for event in events {
            let last = self.revision();
            if event.revision <= last {
                continue;
            }
            if event.revision != last + 1 {
                tracing::warn!(
                    published = last,
                    next = event.revision,
                    "events were compacted before this server published them; watchers resume"
                );
                *live = broadcast::channel(LIVE_CHANNEL).0;
            }
            self.revision.store(event.revision, Ordering::Release);
            // No receiver is not an error: nobody is watching.
            let _ = live.send(Arc::new(event));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use tokio::sync::broadcast::error::TryRecvError;

    use super::*;
    use crate::store::Kind;
    use control_client::model::EventType;

    fn event(revision: u64) -> Event {
        Event {
            revision,
            kind: Kind::Models,
            event_type: EventType::Updated,
            object_id: 1,
            data: "{}".into(),
        }
    }

    /// Events compacted before this server published them: its watchers cannot be told what
    /// they missed, so their streams end (they resume from the history or a snapshot).
    #[test]
    fn a_jump_in_revisions_ends_every_watch() {
        let feed = Feed::new(0);
        let mut watcher = feed.subscribe();
        feed.send(vec![event(1), event(2), event(2)]);
        assert_eq!(watcher.try_recv().unwrap().revision, 1);
        assert_eq!(watcher.try_recv().unwrap().revision, 2);
        let mut later = feed.subscribe();
        feed.send(vec![event(7)]);
        assert_eq!(watcher.try_recv().unwrap_err(), TryRecvError::Closed);
        assert_eq!(later.try_recv().unwrap_err(), TryRecvError::Closed);
        assert_eq!(feed.revision(), 7);
        let mut fresh = feed.subscribe();
        feed.send(vec![event(8)]);
        assert_eq!(fresh.try_recv().unwrap().revision, 8);
    }
}
