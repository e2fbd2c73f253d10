//! A standalone gateway's copy of the engines' load: `GET /v2/worker-load?watch=true` on one of
//! the faden servers it syncs from, into its own [`EngineLoads`].
//!
//! The servers it may follow are the sync client's, tried in the same order and moved on from
//! the same way (a failed or ended stream goes to the next one, after a full-jitter backoff).
//! A server that answers 404 (or anything but a stream of lines: a web UI's page) has no such
//! stream (a GPUStack server, whose workers report no load): it is asked again only after [`NOT_OFFERED_RETRY`], and the gateway routes by its own
//! accounting meanwhile. A reading the stream stops refreshing goes stale by itself
//! ([`super::MAX_AGE`]).

use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::StatusCode;
use hyper::body::Incoming;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::EngineLoads;
use super::wire::{Lines, LoadLine, MAX_LINE_BYTES};
use crate::sync::{Api, SessionError, SyncConfig, SyncError};
use net::backoff::Backoff;

/// The path of the load stream.
pub const WATCH_PATH: &str = "/v2/worker-load?watch=true";
/// How long a server without the load stream (404) is left alone.
pub const NOT_OFFERED_RETRY: Duration = Duration::from_secs(600);
/// A stream silent this long is dropped: the server writes a line at least every
/// [`super::KEEPALIVE`].
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Follows the servers of `config` into `loads` until `cancel` fires. Fails only for settings
/// that can never work (the sync client's own checks).
pub fn follow(
    config: &SyncConfig,
    loads: Arc<EngineLoads>,
    cancel: CancellationToken,
) -> Result<JoinHandle<()>, SyncError> {
    let api = Api::new(config)?;
    let follower = Follower {
        api,
        loads,
        backoff: Backoff::new(config.backoff_min, config.backoff_max),
        request_timeout: config.request_timeout,
        not_offered: false,
    };
    let task = async move {
        let _ = cancel.run_until_cancelled_owned(follower.run()).await;
    };
    // Ends when `cancel` fires; the caller keeps the handle.
    Ok(net::task::spawn(
        task.instrument(tracing::info_span!("engine_load_follow")),
    ))
}

struct Follower {
    api: Api,
    loads: Arc<EngineLoads>,
    backoff: Backoff,
    request_timeout: Duration,
    /// The last server asked had no load stream.
    not_offered: bool,
}

impl Follower {
    async fn run(mut self) {
        loop {
            let at = self.api.current();
            let failure = self.session(at).await;
            self.api.move_on(at);
            let server = self.api.base(at).to_owned();
            if failure.status() == Some(StatusCode::NOT_FOUND) {
                if !self.not_offered {
                    tracing::info!(
                        %server,
                        retry_in = ?NOT_OFFERED_RETRY,
                        "the server has no engine load stream (a GPUStack server?); routing without the engines' load"
                    );
                }
                self.not_offered = true;
                sleep(NOT_OFFERED_RETRY).await;
                continue;
            }
            let delay = self.backoff.next_delay();
            tracing::debug!(%server, error = %failure, ?delay, "engine load stream ended");
            sleep(delay).await;
        }
    }

    /// One stream, until it fails.
    async fn session(&mut self, at: usize) -> SessionError {
        let response = match timeout(self.request_timeout, self.api.get_at(at, WATCH_PATH)).await {
            Err(_) => return SessionError::Timeout(self.request_timeout),
            Ok(Err(e)) => return e,
            Ok(Ok(response)) => response,
        };
        if self.not_offered {
            tracing::info!(
                server = self.api.base(at),
                "the server has an engine load stream now"
            );
            self.not_offered = false;
        }
        self.read(response.into_body()).await
    }

    async fn read(&mut self, mut body: Incoming) -> SessionError {
        let mut lines = Lines::new(MAX_LINE_BYTES);
        loop {
            let data = match timeout(IDLE_TIMEOUT, body.frame()).await {
                Err(_) => return SessionError::Idle(IDLE_TIMEOUT),
                Ok(None) => return SessionError::Ended,
                Ok(Some(Err(e))) => return SessionError::Body(e.into()),
                Ok(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => data,
                    Err(_) => continue,
                },
            };
            if let Err(e) = lines.push(&data) {
                return SessionError::Body(e.into());
            }
            loop {
                let line = match lines.next_line() {
                    Ok(Some(line)) => line,
                    Ok(None) => break,
                    Err(e) => return SessionError::Body(e.into()),
                };
                let line = match LoadLine::parse(&line) {
                    Ok(line) => line,
                    Err(e) => return SessionError::MalformedEvent(e),
                };
                self.backoff.reset();
                let now = Instant::now();
                self.loads.update(
                    line.readings
                        .iter()
                        .filter_map(|r| Some((r.id, r.reading(now)?))),
                    now,
                );
            }
        }
    }
}
