//! The data plane's sync client: keeps a [`RoutingSnapshot`] current from a management API.
//!
//! It works against faden's own API and against a real GPUStack server (same `/v2` paths and
//! JSON shapes). Per resource (workers, model instances, models, credentials) one task lists
//! everything (`GET /v2/<resource>?page=-1`), then follows the watch stream
//! (`?watch=true`, plus `&since=<revision>` when faden reported one). Changes go to one merger
//! task that owns the state, rebuilds the snapshot once per burst and publishes it:
//!
//! ```text
//! workers task ────────┐
//! model-instances task ┤ mpsc  ┌────────┐ ArcSwap + watch  ┌─────────────┐
//! models task ─────────┼──────►│ merger ├─────────────────►│ SyncHandle  │ (readers: no locks)
//! credentials task ────┘       └────────┘                  └─────────────┘
//! ```
//!
//! Liveness follows the field notes: any received byte counts (GPUStack sends a blank-line
//! heartbeat every 15 s), `idle_timeout` (45 s) of silence drops the stream, reconnects use
//! full-jitter exponential backoff reset by a stream that delivered data. Every task ends when
//! the [`CancellationToken`] fires.
//!
//! Given several base URLs (faden servers sharing one database), every reconnect after a failure
//! or an ended stream goes to the next one, all resource tasks together. Resuming with `since`
//! carries over: servers of one database share its revisions.
//!
//! ```no_run
//! # async fn demo() -> Result<(), control_client::sync::SyncError> {
//! use control_client::sync::{self, SyncConfig};
//! use tokio_util::sync::CancellationToken;
//!
//! let cancel = CancellationToken::new();
//! let sync = sync::spawn(SyncConfig::new("http://127.0.0.1:30080", "key"), cancel.clone())?;
//! sync.wait_synced().await;
//! let snapshot = sync.current(); // per request: an Arc clone, no lock
//! # let _ = snapshot;
//! cancel.cancel();
//! # Ok(())
//! # }
//! ```

mod decode;
mod error;
mod framing;
mod http;
mod merger;
mod resource;
mod task;

/// The watch-stream framer behind a small public surface, for fuzzing. Not an API.
#[doc(hidden)]
pub mod fuzzing {
    use bytes::Bytes;

    pub use super::framing::FrameError;

    /// Splits a watch body into event blocks, as the sync client does.
    #[derive(Debug)]
    pub struct WatchFramer(super::framing::EventFramer);

    impl WatchFramer {
        pub fn new(limit: usize) -> Self {
            Self(super::framing::EventFramer::new(limit))
        }

        pub fn push(&mut self, data: &[u8]) -> Result<(), FrameError> {
            self.0.push(data)
        }

        pub fn next_block(&mut self) -> Option<Bytes> {
            self.0.next_block()
        }

        pub fn pending(&self) -> usize {
            self.0.pending()
        }
    }

    /// The JSON text of an event block (`None`: a block without data).
    pub fn payload(block: &[u8]) -> Option<Vec<u8>> {
        super::framing::payload(block).map(|p| p.into_owned())
    }
}

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::model::{Credential, Model, ModelInstance, Worker};
use crate::routing::RoutingSnapshot;

pub(crate) use self::error::SessionError;
pub(crate) use self::http::Api;
pub(crate) use self::http::{base_url, client};
use self::merger::Merger;
use self::resource::{Message, Resource, ResourceKind};
use self::task::ResourceTask;
use net::backoff::Backoff;

/// Capacity of the channel from resource tasks to the merger. When the merger lags, resource
/// tasks wait, stop reading their streams, and TCP pushes back on the server: nothing grows.
const UPDATE_CHANNEL_CAPACITY: usize = 256;

/// A yes-or-no read when it is needed, such as whether the synced server is a GPUStack server
/// ([`SyncHandle::offers_credentials`] may still change it).
pub type Probe = Arc<dyn Fn() -> bool + Send + Sync>;

/// Where and how to sync from.
#[derive(Clone)]
pub struct SyncConfig {
    /// The management API, e.g. `http://127.0.0.1:30080` (a path prefix is kept); `https` needs
    /// [`SyncConfig::tls`] (else [`SyncError::HttpsNeedsTls`]). Several URLs (servers sharing
    /// one database) are tried in turn, from the first.
    pub base_urls: Vec<String>,
    /// API key sent as `Authorization: Bearer <token>` (no header when empty).
    pub token: String,
    /// First reconnect delays are drawn from `[0, backoff_min]`.
    pub backoff_min: Duration,
    /// Reconnect delays never exceed this.
    pub backoff_max: Duration,
    /// A watch stream silent this long (not even a heartbeat) is dropped and reconnected.
    pub idle_timeout: Duration,
    /// Bound on connecting plus a whole list answer, and on a watch's response head.
    pub request_timeout: Duration,
    /// TLS settings for an `https` base URL (see [`crate::tls::client_config`]).
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl SyncConfig {
    /// The defaults: backoff 100 ms – 10 s, idle timeout 45 s (three missed GPUStack
    /// heartbeats), request timeout 10 s.
    pub fn new(base_url: impl Into<String>, token: impl Into<String>) -> Self {
        Self::with_urls([base_url], token)
    }

    /// [`SyncConfig::new`] with several base URLs, tried in turn.
    pub fn with_urls<U: Into<String>>(
        base_urls: impl IntoIterator<Item = U>,
        token: impl Into<String>,
    ) -> Self {
        Self {
            base_urls: base_urls.into_iter().map(Into::into).collect(),
            token: token.into(),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(45),
            request_timeout: Duration::from_secs(10),
            tls: None,
        }
    }

    fn validate(&self) -> Result<(), SyncError> {
        if self.base_urls.is_empty() {
            return Err(SyncError::InvalidConfig("no management API URL given"));
        }
        let positive = [
            (self.backoff_min, "backoff_min must be positive"),
            (self.idle_timeout, "idle_timeout must be positive"),
            (self.request_timeout, "request_timeout must be positive"),
        ];
        if let Some((_, reason)) = positive.iter().find(|(d, _)| d.is_zero()) {
            return Err(SyncError::InvalidConfig(reason));
        }
        if self.backoff_max < self.backoff_min {
            return Err(SyncError::InvalidConfig(
                "backoff_max must not be below backoff_min",
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for SyncConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncConfig")
            .field("base_urls", &self.base_urls)
            .field("token", &"<redacted>")
            .field("backoff_min", &self.backoff_min)
            .field("backoff_max", &self.backoff_max)
            .field("idle_timeout", &self.idle_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

/// A configuration the sync client cannot start with.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("invalid management API URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("https management API URL {url} without TLS settings (a CA bundle)")]
    HttpsNeedsTls { url: String },
    #[error("unsupported URL scheme {scheme:?} in {url:?}; expected http or https")]
    UnsupportedScheme { url: String, scheme: String },
    #[error("the API token cannot be sent in an HTTP header")]
    InvalidToken,
    #[error("invalid sync configuration: {0}")]
    InvalidConfig(&'static str),
    #[error("crate::sync::spawn must be called within a Tokio runtime")]
    NoRuntime,
}

/// The raw objects the snapshot was built from, as last received.
///
/// Maps are shared copy-on-write with the merger: holding this is cheap, and the merger copies a
/// map only when it changes one a reader still holds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SyncedObjects {
    pub workers: Arc<BTreeMap<i64, Worker>>,
    pub instances: Arc<BTreeMap<i64, ModelInstance>>,
    pub models: Arc<BTreeMap<i64, Model>>,
    /// Empty when the server has no credential feed (GPUStack).
    pub credentials: Arc<BTreeMap<i64, Credential>>,
    /// The highest store revision seen (faden only).
    pub revision: Option<u64>,
}

/// State shared by the tasks and every [`SyncHandle`]: written by the tasks, read without locks.
#[derive(Debug)]
struct Shared {
    snapshot: ArcSwap<RoutingSnapshot>,
    objects: ArcSwap<SyncedObjects>,
    /// Time base of `last_byte`.
    epoch: Instant,
    /// Per resource ([`ResourceKind::index`]): nanoseconds from `epoch` to the last byte
    /// received for it, plus one (0: nothing yet; `u64::MAX`: not offered by the server).
    last_byte: [AtomicU64; ResourceKind::ALL.len()],
    /// Events and list items skipped because faden could not read them.
    skipped: AtomicU64,
    /// Sessions (a list and a watch) that failed, over every resource.
    failed_sessions: AtomicU64,
}

impl Shared {
    fn new() -> Self {
        Self {
            snapshot: ArcSwap::from_pointee(RoutingSnapshot::default()),
            objects: ArcSwap::from_pointee(SyncedObjects::default()),
            epoch: Instant::now(),
            last_byte: Default::default(),
            skipped: AtomicU64::new(0),
            failed_sessions: AtomicU64::new(0),
        }
    }

    /// Records that bytes for `kind` arrived now.
    fn touch(&self, kind: ResourceKind) {
        let nanos = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX - 2);
        self.last_byte[kind.index()].store(nanos.saturating_add(1), Ordering::Relaxed);
    }

    /// Records that the server does not offer `kind`: its age no longer counts.
    fn not_offered(&self, kind: ResourceKind) {
        self.last_byte[kind.index()].store(u64::MAX, Ordering::Relaxed);
    }

    /// Time since bytes last arrived for the resource heard from least recently (every offered
    /// resource must be live for the snapshot to be fresh: one stream that is down leaves its
    /// part of the snapshot stale, whatever the others say); `None` while one was never heard
    /// from.
    fn since_last_byte(&self) -> Option<Duration> {
        let mut oldest: Option<u64> = None;
        for slot in &self.last_byte {
            match slot.load(Ordering::Relaxed) {
                u64::MAX => {}
                0 => return None,
                stamp => oldest = Some(oldest.map_or(stamp - 1, |o| o.min(stamp - 1))),
            }
        }
        Some(
            self.epoch
                .elapsed()
                .saturating_sub(Duration::from_nanos(oldest?)),
        )
    }

    /// Whether the server offers `kind`: `None` until it answered a list of it.
    fn offers(&self, kind: ResourceKind) -> Option<bool> {
        match self.last_byte[kind.index()].load(Ordering::Relaxed) {
            0 => None,
            u64::MAX => Some(false),
            _ => Some(true),
        }
    }

    fn count_failed_session(&self) {
        self.failed_sessions.fetch_add(1, Ordering::Relaxed);
    }

    fn count_skipped(&self, n: usize) {
        let n = u64::try_from(n).unwrap_or(u64::MAX);
        self.skipped.fetch_add(n, Ordering::Relaxed);
    }
}

/// A handle on a running sync client. Cheap to clone; reads never block the sync tasks.
#[derive(Clone)]
pub struct SyncHandle {
    shared: Arc<Shared>,
    snapshots: watch::Receiver<Arc<RoutingSnapshot>>,
    synced: watch::Receiver<bool>,
}

impl SyncHandle {
    /// A receiver of published snapshots, marked as having seen the current one, so that
    /// `changed().await` waits for the next. It errors once the sync has stopped.
    ///
    /// Snapshots are published only once every resource is listed, and only when routes,
    /// credentials or the revision differ from the previous one.
    pub fn snapshots(&self) -> watch::Receiver<Arc<RoutingSnapshot>> {
        let mut receiver = self.snapshots.clone();
        receiver.mark_unchanged();
        receiver
    }

    /// The current snapshot: the hot-path read (an atomic load and an `Arc` clone, no lock).
    /// Empty until [`is_synced`](Self::is_synced).
    pub fn current(&self) -> Arc<RoutingSnapshot> {
        self.shared.snapshot.load_full()
    }

    /// The raw objects behind the snapshot (for status pages, debugging and tests). Unlike
    /// snapshots, this is updated before the first complete sync too.
    pub fn objects(&self) -> Arc<SyncedObjects> {
        self.shared.objects.load_full()
    }

    /// Time since the management API was last heard from, for the resource heard from least
    /// recently (list answers and watch streams; heartbeats count; a resource the server does
    /// not offer is left out); `None` before the first complete sync.
    pub fn staleness(&self) -> Option<Duration> {
        if !self.is_synced() {
            return None;
        }
        self.shared.since_last_byte()
    }

    /// Whether every resource has been listed at least once (a resource the server does not
    /// offer counts as listed and empty). Stays true across reconnects.
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Waits until [`is_synced`](Self::is_synced); [`current`](Self::current) then reflects
    /// every resource. Also returns if the sync stops first (cancelled): check `is_synced`.
    pub async fn wait_synced(&self) {
        let mut synced = self.synced.clone();
        let _stopped = synced.wait_for(|&synced| synced).await;
    }

    /// Whether the server publishes key digests (`/v2/credentials`: a faden server) or not (a
    /// GPUStack server answers 404: its keys must be checked with it, see
    /// [`crate::key_check`]); `None` until the server answered.
    pub fn offers_credentials(&self) -> Option<bool> {
        self.shared.offers(ResourceKind::Credentials)
    }

    /// Watch events and list items skipped because they did not fit faden's wire types (each
    /// also logged at warn). Such an object keeps its previous state until a later change.
    pub fn skipped_events(&self) -> u64 {
        self.shared.skipped.load(Ordering::Relaxed)
    }

    /// Sessions that failed so far, over every resource: a list or watch the server refused,
    /// could not be reached for, or broke off; each is followed by a backoff.
    pub fn failed_sessions(&self) -> u64 {
        self.shared.failed_sessions.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for SyncHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncHandle")
            .field("synced", &self.is_synced())
            .field("staleness", &self.staleness())
            .field("revision", &self.current().revision)
            .finish_non_exhaustive()
    }
}

/// Starts syncing: one task per resource plus the merger, on the current Tokio runtime. They
/// all end when `cancel` fires (or, for the merger, when the resource tasks are gone).
///
/// Fails only for a configuration that can never work; unreachable servers, refused tokens and
/// the like are retried forever with backoff and logged.
pub fn spawn(config: SyncConfig, cancel: CancellationToken) -> Result<SyncHandle, SyncError> {
    config.validate()?;
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| SyncError::NoRuntime)?;
    let api = Arc::new(Api::new(&config)?);
    let shared = Arc::new(Shared::new());
    let (snapshot_tx, snapshots) = watch::channel(shared.snapshot.load_full());
    let (synced_tx, synced) = watch::channel(false);
    let (updates, messages) = mpsc::channel(UPDATE_CHANNEL_CAPACITY);

    let merger = Merger::new(Arc::clone(&shared), snapshot_tx, synced_tx);
    runtime.spawn(
        cancel
            .clone()
            .run_until_cancelled_owned(merger.run(messages))
            .instrument(tracing::info_span!("sync_merger")),
    );
    let start = Start {
        runtime: &runtime,
        api: &api,
        shared: &shared,
        updates: &updates,
        config: &config,
        cancel: &cancel,
    };
    start.resource::<Worker>();
    start.resource::<ModelInstance>();
    start.resource::<Model>();
    start.resource::<Credential>();

    Ok(SyncHandle {
        shared,
        snapshots,
        synced,
    })
}

/// What every resource task is started with.
struct Start<'a> {
    runtime: &'a tokio::runtime::Handle,
    api: &'a Arc<Api>,
    shared: &'a Arc<Shared>,
    updates: &'a mpsc::Sender<Message>,
    config: &'a SyncConfig,
    cancel: &'a CancellationToken,
}

impl Start<'_> {
    fn resource<T: Resource>(&self) {
        let task = ResourceTask::<T>::new(
            Arc::clone(self.api),
            Arc::clone(self.shared),
            self.updates.clone(),
            Backoff::new(self.config.backoff_min, self.config.backoff_max),
            self.config.idle_timeout,
        );
        let span = tracing::info_span!("sync", resource = %T::KIND);
        self.runtime.spawn(
            self.cancel
                .clone()
                .run_until_cancelled_owned(task.run())
                .instrument(span),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_gpustack_liveness() {
        let c = SyncConfig::new("http://127.0.0.1:30080", "secret");
        assert_eq!(c.backoff_min, Duration::from_millis(100));
        assert_eq!(c.backoff_max, Duration::from_secs(10));
        assert_eq!(c.idle_timeout, Duration::from_secs(45));
        assert_eq!(c.request_timeout, Duration::from_secs(10));
        assert!(!format!("{c:?}").contains("secret"));
    }

    #[tokio::test]
    async fn refuses_configurations_that_cannot_work() {
        let cancel = CancellationToken::new();
        let spawn_with = |edit: fn(&mut SyncConfig)| {
            let mut c = SyncConfig::new("http://127.0.0.1:1", "t");
            edit(&mut c);
            spawn(c, cancel.clone())
        };
        assert!(matches!(
            spawn_with(|c| c.base_urls = vec!["https://cp:443".into()]),
            Err(SyncError::HttpsNeedsTls { .. })
        ));
        assert!(matches!(
            spawn_with(|c| c.base_urls = vec!["not a url".into()]),
            Err(SyncError::InvalidUrl { .. })
        ));
        let bad_second = spawn_with(|c| c.base_urls.push("ftp://cp".into()));
        assert!(
            matches!(&bad_second, Err(SyncError::UnsupportedScheme { url, .. }) if url == "ftp://cp"),
            "{bad_second:?}"
        );
        assert!(matches!(
            spawn_with(|c| c.base_urls.clear()),
            Err(SyncError::InvalidConfig(_))
        ));
        assert!(matches!(
            spawn_with(|c| c.token = "bad\r\ntoken".into()),
            Err(SyncError::InvalidToken)
        ));
        assert!(matches!(
            spawn_with(|c| c.backoff_min = Duration::ZERO),
            Err(SyncError::InvalidConfig(_))
        ));
        assert!(matches!(
            spawn_with(|c| c.backoff_max = Duration::from_millis(1)),
            Err(SyncError::InvalidConfig(_))
        ));
    }

    #[test]
    fn spawn_outside_a_runtime_is_an_error() {
        let c = SyncConfig::new("http://127.0.0.1:1", "t");
        assert!(matches!(
            spawn(c, CancellationToken::new()),
            Err(SyncError::NoRuntime)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn staleness_counts_from_the_last_byte() {
        let shared = Shared::new();
        assert_eq!(shared.since_last_byte(), None);
        for kind in ResourceKind::ALL {
            shared.touch(kind);
        }
        tokio::time::advance(Duration::from_millis(50)).await;
        let stale = shared.since_last_byte().unwrap();
        assert!(stale >= Duration::from_millis(50), "{stale:?}");
        for kind in ResourceKind::ALL {
            shared.touch(kind);
        }
        assert!(shared.since_last_byte().unwrap() < stale);
    }

    #[tokio::test(start_paused = true)]
    async fn staleness_is_that_of_the_least_recent_resource() {
        let shared = Shared::new();
        shared.touch(ResourceKind::Workers);
        // A resource never heard from: no age at all.
        assert_eq!(shared.since_last_byte(), None);
        for kind in ResourceKind::ALL {
            shared.touch(kind);
        }
        tokio::time::advance(Duration::from_millis(60)).await;
        // Three streams keep talking, the credentials one is down: the snapshot is stale.
        shared.touch(ResourceKind::Workers);
        shared.touch(ResourceKind::ModelInstances);
        shared.touch(ResourceKind::Models);
        assert!(shared.since_last_byte().unwrap() >= Duration::from_millis(60));
        // A resource the server does not offer (GPUStack's credentials) does not count.
        shared.not_offered(ResourceKind::Credentials);
        assert!(shared.since_last_byte().unwrap() < Duration::from_millis(60));
        shared.touch(ResourceKind::Credentials);
        assert!(shared.since_last_byte().unwrap() < Duration::from_millis(60));
    }

    #[tokio::test]
    async fn cancel_stops_every_task() {
        let cancel = CancellationToken::new();
        let handle = spawn(SyncConfig::new("http://127.0.0.1:1", "t"), cancel.clone()).unwrap();
        let mut snapshots = handle.snapshots();
        cancel.cancel();
        // The merger owns the sender: the channel closes once it has ended.
        let closed = tokio::time::timeout(Duration::from_secs(10), snapshots.changed()).await;
        assert!(closed.unwrap().is_err());
        handle.wait_synced().await;
        assert!(!handle.is_synced());
        assert_eq!(handle.staleness(), None);
    }
}
