//! Watch streams: `GET /v2/<resource>?watch=true[&since=<revision>]`.
//!
//! GPUStack's framing: content type `text/event-stream`, but each event is one bare JSON object
//! followed by a blank line, and an idle stream sends a blank line every heartbeat period. A
//! watcher that sends `since` resumes by revision: faden honours it while the history still
//! holds it (the `x-faden-watch` header says which: `resumed`, or `snapshot`, every row as a
//! CREATED event) and adds a `revision` to every event. Without `since` the events are
//! GPUStack's exactly: its watch clients refuse any other key.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderValue, header};
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{ApiError, ApiResult, AppState};
use crate::store::{Event, Kind};
use control_client::model::{REVISION_HEADER, WATCH_MODE_HEADER};

const HEARTBEAT: &[u8] = b"\n\n";

/// Which events a watcher gets (see `list_or_watch`).
pub(super) type Filter = Box<dyn Fn(&Event) -> bool + Send + Sync>;

struct WatchState {
    kind: Kind,
    initial: VecDeque<Event>,
    live: broadcast::Receiver<Arc<Event>>,
    /// Live events at or below this revision were already covered by `initial`.
    after: u64,
    heartbeat: Duration,
    next_heartbeat: Instant,
    shutdown: CancellationToken,
    filter: Option<Filter>,
    /// Frames carry their revision: the watcher resumes by revision (it sent `since`).
    revisions: bool,
}

impl WatchState {
    fn wanted(&self, event: &Event) -> bool {
        self.filter.as_ref().is_none_or(|keep| keep(event))
    }
}

pub(super) async fn respond(
    state: &AppState,
    kind: Kind,
    since: Option<u64>,
    filter: Option<Filter>,
) -> ApiResult<Response> {
    let sub = state.store.subscribe(kind, since).await?;
    let mode = if sub.resumed { "resumed" } else { "snapshot" };
    tracing::debug!(
        resource = kind.as_str(),
        mode,
        since,
        revision = sub.revision,
        "watch opened"
    );
    let heartbeat = state.config.watch_heartbeat;
    let watch = WatchState {
        kind,
        initial: sub.initial.into(),
        live: sub.live,
        after: sub.revision,
        heartbeat,
        next_heartbeat: Instant::now() + heartbeat,
        shutdown: state.shutdown.clone(),
        filter,
        revisions: since.is_some(),
    };
    let stream = futures_util::stream::unfold(watch, next_frame);
    stream_response(
        Response::builder()
            .header(WATCH_MODE_HEADER, mode)
            .header(REVISION_HEADER, HeaderValue::from(sub.revision)),
        stream,
    )
}

/// A watch stream's answer: GPUStack's content type, never cached or buffered by a proxy.
fn stream_response<S>(builder: http::response::Builder, frames: S) -> ApiResult<Response>
where
    S: futures_util::Stream<Item = Result<Bytes, Infallible>> + Send + 'static,
{
    builder
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(frames))
        .map_err(|e| ApiError::new(http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// A watch of a resource faden has none of (`unmanaged`): heartbeats until shutdown.
pub(super) fn idle(state: &AppState) -> ApiResult<Response> {
    let (period, shutdown) = (state.config.watch_heartbeat, state.shutdown.clone());
    let beats = futures_util::stream::unfold(shutdown, move |shutdown| async move {
        tokio::select! {
            _ = shutdown.cancelled() => None,
            _ = tokio::time::sleep(period) => {
                Some((Ok::<_, Infallible>(Bytes::from_static(HEARTBEAT)), shutdown))
            }
        }
    });
    stream_response(Response::builder(), beats)
}

async fn next_frame(mut st: WatchState) -> Option<(Result<Bytes, Infallible>, WatchState)> {
    while let Some(event) = st.initial.pop_front() {
        if st.wanted(&event) {
            st.next_heartbeat = Instant::now() + st.heartbeat;
            return Some((Ok(Bytes::from(event.to_frame(st.revisions))), st));
        }
    }
    loop {
        tokio::select! {
            _ = st.shutdown.cancelled() => return None,
            _ = tokio::time::sleep_until(st.next_heartbeat) => {
                st.next_heartbeat = Instant::now() + st.heartbeat;
                return Some((Ok(Bytes::from_static(HEARTBEAT)), st));
            }
            received = st.live.recv() => match received {
                Ok(event) if event.kind == st.kind && event.revision > st.after => {
                    st.after = event.revision;
                    if !st.wanted(&event) {
                        continue;
                    }
                    st.next_heartbeat = Instant::now() + st.heartbeat;
                    return Some((Ok(Bytes::from(event.to_frame(st.revisions))), st));
                }
                Ok(_) => continue,
                Err(RecvError::Lagged(missed)) => {
                    // Too far behind to catch up from memory: end the stream; the client
                    // resumes with `since` from the history.
                    tracing::warn!(resource = st.kind.as_str(), missed, "watcher lagged, closing");
                    return None;
                }
                Err(RecvError::Closed) => return None,
            }
        }
    }
}
