//! API keys the routing snapshot does not hold, checked against the management server, with a
//! bounded cache of its verdicts.
//!
//! A GPUStack server publishes no key digests: its own gateway asks `GET /token-auth` for every
//! new (key, model) pair. faden does the same through a [`KeyAuthority`] and keeps each verdict
//! for a short time:
//!
//! - **allowed**: served from the cache for `allowed_ttl` (default 5 s), then checked again, so
//!   a key revoked or expired in GPUStack is refused at most that long after;
//! - **refused**: kept for `refused_ttl` (default 1 s), so a flood of one bad key costs the
//!   server one check a second, and a key created a moment ago works a second later;
//! - **one check per (key, model) at a time**: 1,000 requests arriving with a new key wait for
//!   the one check the first of them started (and take it over if that request goes away);
//! - **server unreachable**: a pair allowed by the server within `outage_grace` (default
//!   5 min) stays allowed; any other pair gets [`CheckError::Unavailable`] (503), never a
//!   refusal the server did not give.
//!
//! Entries are keyed by the SHA-256 of the key and the model name, never the key itself, and
//! the cache holds at most `max_entries`: past that, entries that can no longer answer are
//! dropped, and if none can be, the check is made without being cached.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the server said of a (key, model) pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The key may call the model.
    Allowed,
    /// Not a valid key (unknown, revoked, expired, its owner deactivated), with the server's
    /// reason.
    Unauthorized(String),
    /// A valid key that may not call this model (scope, model not granted to it or its owner).
    Forbidden(String),
}

impl Verdict {
    fn is_allowed(&self) -> bool {
        matches!(self, Verdict::Allowed)
    }
}

/// The server could not give a verdict (down, timed out, an answer that is neither yes nor no).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unreachable(pub String);

/// Where verdicts come from: [`TokenAuth`] asks a GPUStack server.
pub trait KeyAuthority: Send + Sync + fmt::Debug + 'static {
    /// Whether `key` may call `model` (`None`: whether the key is valid for inference at all).
    fn verify<'a>(
        &'a self,
        key: &'a str,
        model: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Verdict, Unreachable>>;
}

/// Why a request's key was not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    /// Not a valid key (401 to the client).
    #[error("{0}")]
    Unauthorized(String),
    /// A valid key that may not call this model (403).
    #[error("{0}")]
    Forbidden(String),
    /// The server is unreachable and has not allowed this pair recently (503).
    #[error("the management server cannot verify this API key now: {0}")]
    Unavailable(String),
}

/// Lifetimes and bounds of the verdict cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyCheckConfig {
    /// How long an allowed pair is served from the cache before it is checked again: the
    /// longest a revoked key keeps working.
    pub allowed_ttl: Duration,
    /// How long a refusal is kept.
    pub refused_ttl: Duration,
    /// While the server is unreachable, pairs it allowed at most this long ago stay allowed.
    pub outage_grace: Duration,
    /// Most (key, model) pairs kept.
    pub max_entries: usize,
}

impl Default for KeyCheckConfig {
    fn default() -> Self {
        Self {
            allowed_ttl: Duration::from_secs(5),
            refused_ttl: Duration::from_secs(1),
            outage_grace: Duration::from_secs(300),
            max_entries: 65_536,
        }
    }
}

impl KeyCheckConfig {
    /// How long `verdict` is served from the cache.
    fn ttl(&self, verdict: &Verdict) -> Duration {
        if verdict.is_allowed() {
            self.allowed_ttl
        } else {
            self.refused_ttl
        }
    }
}

/// The cache key: SHA-256 over the key, a separator the key cannot contain, and the model.
type PairId = [u8; 32];

fn pair_id(key: &str, model: Option<&str>) -> PairId {
    let mut hash = Sha256::new();
    hash.update(key.as_bytes());
    // A key is a header value (no NUL); the model marker keeps `None` apart from `Some("")`.
    match model {
        Some(m) => {
            hash.update(b"\0m");
            hash.update(m.as_bytes());
        }
        None => hash.update(b"\0-"),
    }
    hash.finalize().into()
}

/// What is known of one pair.
#[derive(Clone, Debug, Default)]
struct Known {
    /// The last verdict and when it was given.
    verdict: Option<(Verdict, Instant)>,
    /// When the server last allowed the pair, unless it refused it since.
    allowed_at: Option<Instant>,
    /// The server was found unreachable at this time, with this error: further requests
    /// within `refused_ttl` get the same answer without asking again.
    unreachable: Option<(Instant, String)>,
}

#[derive(Debug, Default)]
struct Entry {
    known: parking_lot::Mutex<Known>,
    /// Held while the pair is being checked: the single flight.
    checking: tokio::sync::Mutex<()>,
}

/// Key verdicts from a [`KeyAuthority`], cached. Cheap to clone; clones share the cache.
#[derive(Clone, Debug)]
pub struct KeyCheck {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    authority: Arc<dyn KeyAuthority>,
    config: KeyCheckConfig,
    entries: DashMap<PairId, Arc<Entry>, foldhash::fast::RandomState>,
}

impl KeyCheck {
    pub fn new(authority: Arc<dyn KeyAuthority>, config: KeyCheckConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                authority,
                config,
                entries: DashMap::default(),
            }),
        }
    }

    /// Whether `key` may call `model` (`None`: any model it is granted), from the cache when
    /// the verdict there is fresh, else from one check shared by every concurrent caller.
    pub async fn check(&self, key: &str, model: Option<&str>) -> Result<(), CheckError> {
        let id = pair_id(key, model);
        let entry = match self.entry(id) {
            Some(entry) => entry,
            // Full of live entries: check without caching (still bounded by the server's pace).
            None => Arc::new(Entry::default()),
        };
        if let Some(answer) = self.fresh(&entry, Instant::now()) {
            return answer;
        }
        let _checking = entry.checking.lock().await;
        // Whoever held the lock before may have just answered.
        if let Some(answer) = self.fresh(&entry, Instant::now()) {
            return answer;
        }
        let asked = self.inner.authority.verify(key, model).await;
        let now = Instant::now();
        let mut known = entry.known.lock();
        match asked {
            Ok(verdict) => {
                // A refusal ends the outage grace too: a key revoked before an outage must not
                // come back during it.
                known.allowed_at = verdict.is_allowed().then_some(now);
                known.unreachable = None;
                known.verdict = Some((verdict.clone(), now));
                to_answer(verdict)
            }
            Err(Unreachable(error)) => {
                tracing::warn!(%error, "cannot verify an API key with the management server");
                known.unreachable = Some((now, error.clone()));
                self.during_outage(&known, now, error)
            }
        }
    }

    /// The cached answer, if it may still be given at `now`.
    fn fresh(&self, entry: &Entry, now: Instant) -> Option<Result<(), CheckError>> {
        let config = &self.inner.config;
        let known = entry.known.lock();
        if let Some((at, error)) = &known.unreachable
            && now.saturating_duration_since(*at) < config.refused_ttl
        {
            return Some(self.during_outage(&known, now, error.clone()));
        }
        let (verdict, at) = known.verdict.as_ref()?;
        (now.saturating_duration_since(*at) < config.ttl(verdict))
            .then(|| to_answer(verdict.clone()))
    }

    /// The answer while the server cannot be reached.
    fn during_outage(&self, known: &Known, now: Instant, error: String) -> Result<(), CheckError> {
        let grace = self.inner.config.outage_grace;
        match known.allowed_at {
            Some(at) if now.saturating_duration_since(at) < grace => Ok(()),
            _ => Err(CheckError::Unavailable(error)),
        }
    }

    /// The pair's entry, created when missing; `None` when the cache is full of entries that
    /// can still answer.
    fn entry(&self, id: PairId) -> Option<Arc<Entry>> {
        if let Some(entry) = self.inner.entries.get(&id) {
            return Some(Arc::clone(&entry));
        }
        if self.inner.entries.len() >= self.inner.config.max_entries {
            self.sweep(Instant::now());
            if self.inner.entries.len() >= self.inner.config.max_entries {
                return None;
            }
        }
        Some(Arc::clone(&self.inner.entries.entry(id).or_default()))
    }

    /// Drops the entries that can answer nothing any more: no fresh verdict and no allowance
    /// within the outage grace, and no check running.
    fn sweep(&self, now: Instant) {
        let config = &self.inner.config;
        self.inner.entries.retain(|_, entry| {
            if Arc::strong_count(entry) > 1 {
                return true; // in use by a request
            }
            let known = entry.known.lock();
            let verdict_live = known
                .verdict
                .as_ref()
                .is_some_and(|(v, at)| now.saturating_duration_since(*at) < config.ttl(v));
            let grace_live = known
                .allowed_at
                .is_some_and(|at| now.saturating_duration_since(at) < config.outage_grace);
            verdict_live || grace_live
        });
    }

    /// Pairs cached now (for tests and metrics).
    pub fn len(&self) -> usize {
        self.inner.entries.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.inner.entries.is_empty()
    }
}

fn to_answer(verdict: Verdict) -> Result<(), CheckError> {
    match verdict {
        Verdict::Allowed => Ok(()),
        Verdict::Unauthorized(reason) => Err(CheckError::Unauthorized(reason)),
        Verdict::Forbidden(reason) => Err(CheckError::Forbidden(reason)),
    }
}

mod token_auth;
pub use token_auth::TokenAuth;

#[cfg(test)]
mod tests;
