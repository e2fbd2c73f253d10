//! One task per resource: list, then watch, and start over on failure.
//!
//! ```text
//!        ┌──────────── list ok ───────────┐
//!  list ─┤                                ▼
//!        └─ fail ─► backoff ─► list     watch(since) ─ events ─► merger
//!                                         │ fail
//!                     ┌─ revision known, ─┴─ no revision, broken event,
//!                     │  transport error    history gone
//!                     ▼                     ▼
//!           backoff ─► watch(since)      backoff ─► list
//! ```
//!
//! A list replaces the resource's whole state in one message, so the published snapshot never
//! goes partial. With a faden server (`x-faden-revision`) a broken stream resumes at the highest
//! revision seen, without a list; GPUStack has no resume token, so every reconnect re-lists.
//! Each session runs against one server; a failed one sends the next to the next server.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::StatusCode;
use hyper::body::Incoming;
use tokio::sync::mpsc;
use tokio::time::{sleep, timeout};
use tracing::{debug, error, info, warn};

use super::Shared;
use super::decode::{self, Action, Skipped};
use super::error::SessionError;
use super::framing::{EventFramer, MAX_EVENT_BYTES, payload};
use super::http::Api;
use super::resource::{Change, Message, Resource};
use net::backoff::Backoff;

/// How often a resource the server does not offer (404) is asked for again.
pub(crate) const NOT_OFFERED_RETRY: Duration = Duration::from_secs(60);

/// The list-and-watch loop of one resource.
#[derive(Debug)]
pub(crate) struct ResourceTask<T> {
    api: Arc<Api>,
    shared: Arc<Shared>,
    updates: mpsc::Sender<Message>,
    backoff: Backoff,
    idle_timeout: Duration,
    /// The server (index in the API's URLs) of the current or last session.
    server: usize,
    /// Highest revision seen (list header or event): where the next watch resumes.
    revision: Option<u64>,
    /// The next session starts with a list.
    must_list: bool,
    /// The server answered 404 for this (optional) resource, and it is published as empty.
    not_offered: bool,
    _resource: PhantomData<fn() -> T>,
}

impl<T: Resource> ResourceTask<T> {
    pub(crate) fn new(
        api: Arc<Api>,
        shared: Arc<Shared>,
        updates: mpsc::Sender<Message>,
        backoff: Backoff,
        idle_timeout: Duration,
    ) -> Self {
        Self {
            api,
            shared,
            updates,
            backoff,
            idle_timeout,
            server: 0,
            revision: None,
            must_list: true,
            not_offered: false,
            _resource: PhantomData,
        }
    }

    /// Runs until the merger is gone; the caller cancels it by dropping this future.
    pub(crate) async fn run(mut self) {
        loop {
            let Err(failure) = self.session().await;
            if matches!(failure, SessionError::Closed) {
                debug!("merger gone; stopping");
                return;
            }
            self.shared.count_failed_session();
            self.api.move_on(self.server);
            if self.must_list
                && T::KIND.optional()
                && failure.status() == Some(StatusCode::NOT_FOUND)
            {
                if self.mark_not_offered().await.is_err() {
                    return;
                }
                sleep(NOT_OFFERED_RETRY).await;
                continue;
            }
            if failure.requires_relist() || self.revision.is_none() {
                self.must_list = true;
            }
            let attempt = self.backoff.attempt();
            let delay = self.backoff.next_delay();
            let server = self.api.base(self.server);
            log_failure(
                &failure,
                server,
                attempt,
                delay,
                self.revision,
                self.must_list,
            );
            sleep(delay).await;
        }
    }

    /// One list (when needed) and one watch, until the watch fails.
    async fn session(&mut self) -> Result<Infallible, SessionError> {
        self.server = self.api.current();
        if self.must_list {
            self.list().await?;
        }
        let since = self.revision;
        let watch = self.api.watch(self.server, T::KIND, since).await?;
        if let Some(since) = since.filter(|_| watch.snapshot) {
            // The server dropped the history we asked for and starts over with every object;
            // a fresh list tells us which objects no longer exist, the stream would not.
            return Err(SessionError::HistoryGone { since });
        }
        debug!(server = self.api.base(self.server), revision = ?since, "watching");
        self.follow(watch.body).await
    }

    async fn list(&mut self) -> Result<(), SessionError> {
        let listed = self.api.list::<T>(self.server).await?;
        self.shared.touch(T::KIND);
        for skipped in &listed.skipped {
            warn!(error = %skipped, "skipping a listed object faden cannot read");
        }
        self.shared.count_skipped(listed.skipped.len());
        debug!(
            revision = ?listed.revision,
            items = listed.items.len(),
            skipped = listed.skipped.len(),
            "listed"
        );
        if self.not_offered {
            info!("the server offers this resource again");
            self.not_offered = false;
        }
        self.revision = listed.revision;
        self.must_list = false;
        self.send(Change::Replace(listed.items), listed.revision)
            .await
    }

    /// Reads the watch body until it fails, applying every event.
    async fn follow(&mut self, mut body: Incoming) -> Result<Infallible, SessionError> {
        let mut framer = EventFramer::new(MAX_EVENT_BYTES);
        loop {
            let frame = match timeout(self.idle_timeout, body.frame()).await {
                Err(_) => return Err(SessionError::Idle(self.idle_timeout)),
                Ok(None) => {
                    if framer.pending() > 0 {
                        debug!(bytes = framer.pending(), "stream ended inside an event");
                    }
                    return Err(SessionError::Ended);
                }
                Ok(Some(Err(e))) => return Err(SessionError::Body(e.into())),
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            if data.is_empty() {
                continue;
            }
            // Any byte, heartbeats included, proves the stream alive and the connection good.
            self.shared.touch(T::KIND);
            self.backoff.reset();
            framer.push(&data)?;
            while let Some(block) = framer.next_block() {
                self.apply(&block).await?;
            }
        }
    }

    /// Applies one event block.
    async fn apply(&mut self, block: &[u8]) -> Result<(), SessionError> {
        let Some(json) = payload(block) else {
            return Ok(()); // an SSE comment: a heartbeat
        };
        let event = decode::event::<T>(&json).map_err(SessionError::MalformedEvent)?;
        // Skipped events advance the revision too: resuming before them would only skip them
        // again.
        if event.revision > self.revision {
            self.revision = event.revision;
        }
        match event.action {
            Action::Apply(change) => self.send(change, event.revision).await,
            Action::Skip(reason) => {
                self.skip(&reason);
                Ok(())
            }
        }
    }

    fn skip(&self, reason: &Skipped) {
        self.shared.count_skipped(1);
        warn!(revision = ?self.revision, error = %reason, "skipping a watch event faden cannot read");
    }

    /// Publishes an empty set for a resource the server does not have (GPUStack answers 404
    /// for `/v2/credentials`), so that the data plane still counts as synced and routes.
    async fn mark_not_offered(&mut self) -> Result<(), SessionError> {
        if self.not_offered {
            debug!("still not offered by the server");
            return Ok(());
        }
        warn!(
            retry_in = ?NOT_OFFERED_RETRY,
            "the server does not offer this resource (404); treating it as empty"
        );
        self.not_offered = true;
        self.shared.not_offered(T::KIND);
        self.revision = None;
        self.send(Change::Replace(Vec::new()), None).await
    }

    async fn send(&self, change: Change<T>, revision: Option<u64>) -> Result<(), SessionError> {
        let message = Message {
            update: T::wrap(change),
            revision,
        };
        self.updates
            .send(message)
            .await
            .map_err(|_| SessionError::Closed)
    }
}

fn log_failure(
    failure: &SessionError,
    server: &str,
    attempt: u32,
    delay: Duration,
    revision: Option<u64>,
    relist: bool,
) {
    let next = if relist { "list" } else { "resume" };
    match failure {
        SessionError::Auth { .. } => {
            error!(server, attempt, ?delay, ?revision, next, error = %failure, "management API refused the token");
        }
        SessionError::HistoryGone { .. } => {
            info!(server, attempt, ?delay, ?revision, next, error = %failure, "watch cannot resume");
        }
        _ => {
            warn!(server, attempt, ?delay, ?revision, next, error = %failure, "sync stream failed")
        }
    }
}
