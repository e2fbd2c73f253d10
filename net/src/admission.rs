//! Admission control shared by every listener (gateway, worker proxy, management API with the
//! tunnel's `/connect`, proxy port): bounds on connections that have not yet finished their
//! request head, and a rate limit on failed authentication, both per source address.
//!
//! **Pending connections.** A connection is *pending* from the moment it is accepted until the
//! listener has a complete request head (its service is called for the first time), TLS
//! handshake included. [`Admission`] caps pending connections in total and per source, and each
//! [`Pending`] slot carries a deadline: a connection still pending at its deadline is closed
//! ([`Pending::guard`]). Slow-header clients (slowloris) therefore hold at most
//! `max_pending_per_source` slots of one address for at most the deadline each, and can never
//! take the slots of the connections already past their head. A connection refused by a cap gets
//! a short canned answer on plain listeners ([`Refusal::http_response`]: 429 per source, 503 in
//! total, with `Retry-After` and `Connection: close`) and is closed.
//!
//! **Failed authentication.** [`AuthLimiter`] counts failed credential checks per source in a
//! fixed window. After `max_failures` failures within `window` of the first one, the source is
//! [`Blocked`] until that window ends: every further failed check from it is answered 429 with
//! `Retry-After` instead of 401, telling a client that retries a stale credential in a loop to
//! back off. A valid credential is always served, from a blocked source too: keys carry 128
//! random bits, so guessing is hopeless whatever the rate, and checking a key costs what refusing
//! it would. Successes are not counted. The table is bounded (`max_sources`): windows that ended
//! are dropped first, then the oldest window.
//!
//! **Sources.** An IPv4 address is a source; an IPv4-mapped IPv6 address counts as its IPv4
//! address; another IPv6 address counts as its /64 (one host usually owns a whole /64). Behind a
//! load balancer every client has the balancer's address: raise the per-source limits there, or
//! turn them off (`0`). Forwarded-for headers are never trusted.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use http::{HeaderValue, StatusCode};
use parking_lot::Mutex;
use tokio::time::Instant;

/// Default: pending connections per listener, in total.
pub const DEFAULT_MAX_PENDING: usize = 1024;
/// Default: pending connections per listener from one source.
pub const DEFAULT_MAX_PENDING_PER_SOURCE: usize = 128;
/// Default: failed authentications per source within [`DEFAULT_AUTH_FAILURE_WINDOW`].
pub const DEFAULT_AUTH_FAILURES: u32 = 10;
/// Default: the window of [`DEFAULT_AUTH_FAILURES`].
pub const DEFAULT_AUTH_FAILURE_WINDOW: Duration = Duration::from_secs(60);
/// Default: sources tracked by one [`AuthLimiter`] at most.
pub const DEFAULT_AUTH_SOURCES: usize = 65_536;

/// The address limits are counted by: IPv4 as is, IPv4-mapped IPv6 as IPv4, other IPv6 by /64.
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(bits))
        }
    }
}

/// Caps on pending connections (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingLimits {
    /// Pending connections at most, in total (at least 1).
    pub max_pending: usize,
    /// Pending connections at most from one source; 0: no per-source cap.
    pub max_pending_per_source: usize,
}

impl Default for PendingLimits {
    fn default() -> Self {
        Self {
            max_pending: DEFAULT_MAX_PENDING,
            max_pending_per_source: DEFAULT_MAX_PENDING_PER_SOURCE,
        }
    }
}

/// Why a connection (or handshake) was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The total cap is reached.
    #[error("too many connections are waiting to complete their request; retry later")]
    Total,
    /// The cap of the source address is reached.
    #[error("too many connections from this address are waiting to complete their request")]
    PerSource,
}

impl Refusal {
    /// 503 for the total cap, 429 for the per-source cap.
    pub fn status(self) -> StatusCode {
        match self {
            Refusal::Total => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::PerSource => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// The error code in JSON answers.
    pub fn code(self) -> &'static str {
        "too_many_pending_connections"
    }

    /// A complete HTTP/1.1 answer (OpenAI-shaped JSON, `Retry-After: 1`, `Connection: close`)
    /// for a connection refused before anything was read from it.
    pub fn http_response(self) -> Vec<u8> {
        let status = self.status();
        let error_type = if status.is_server_error() {
            "server_error"
        } else {
            "rate_limit_error"
        };
        let body = serde_json::json!({
            "error": {"message": self.to_string(), "type": error_type, "code": self.code()}
        })
        .to_string();
        format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            status.as_u16(),
            status.canonical_reason().unwrap_or(""),
            body.len()
        )
        .into_bytes()
    }

    /// Writes [`Refusal::http_response`] without waiting (best effort: a full socket buffer
    /// just drops it); the caller then drops the stream. Only for plain (non-TLS) listeners.
    pub fn answer(self, stream: &tokio::net::TcpStream) {
        let _ = stream.try_write(&self.http_response());
    }
}

#[derive(Debug)]
struct AdmissionInner {
    limits: PendingLimits,
    total: AtomicUsize,
    per_source: Mutex<HashMap<IpAddr, usize>>,
}

/// Counts pending connections of one listener. Cheap to clone; clones share the counts.
#[derive(Clone, Debug)]
pub struct Admission {
    inner: Arc<AdmissionInner>,
}

impl Admission {
    pub fn new(limits: PendingLimits) -> Self {
        Self {
            inner: Arc::new(AdmissionInner {
                limits: PendingLimits {
                    max_pending: limits.max_pending.max(1),
                    ..limits
                },
                total: AtomicUsize::new(0),
                per_source: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> PendingLimits {
        self.inner.limits
    }

    /// Takes a pending slot for a connection from `source` (`None`: unknown, only the total
    /// applies) that must complete its request head by `deadline`.
    pub fn try_admit(&self, source: Option<IpAddr>, deadline: Instant) -> Result<Pending, Refusal> {
        let inner = &self.inner;
        let taken = inner
            .total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < inner.limits.max_pending).then_some(n + 1)
            });
        if taken.is_err() {
            return Err(Refusal::Total);
        }
        let per_source = inner.limits.max_pending_per_source;
        let source = match source {
            Some(ip) if per_source > 0 => {
                let key = source_key(ip);
                let mut map = inner.per_source.lock();
                let n = map.entry(key).or_insert(0);
                if *n >= per_source {
                    drop(map);
                    inner.total.fetch_sub(1, Ordering::AcqRel);
                    return Err(Refusal::PerSource);
                }
                *n += 1;
                Some(key)
            }
            _ => None,
        };
        Ok(Pending {
            inner: self.inner.clone(),
            source,
            deadline,
            released: AtomicBool::new(false),
        })
    }

    /// Pending connections now.
    pub fn pending(&self) -> usize {
        self.inner.total.load(Ordering::Acquire)
    }
}

/// One pending connection's slot: released by [`Pending::release`] (the request head is
/// complete) or on drop.
#[derive(Debug)]
pub struct Pending {
    inner: Arc<AdmissionInner>,
    source: Option<IpAddr>,
    deadline: Instant,
    released: AtomicBool,
}

impl Pending {
    /// The connection is past its request head (or handshake): frees the slot. Idempotent.
    pub fn release(&self) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        self.inner.total.fetch_sub(1, Ordering::AcqRel);
        if let Some(key) = self.source {
            let mut map = self.inner.per_source.lock();
            if let Some(n) = map.get_mut(&key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    map.remove(&key);
                }
            }
        }
    }

    /// Whether the slot was released.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// When the connection must be past its request head.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Resolves at the deadline if the slot is still held then; never otherwise.
    pub async fn expired(&self) {
        tokio::time::sleep_until(self.deadline).await;
        if self.is_released() {
            std::future::pending::<()>().await;
        }
    }

    /// Runs `connection` until it ends, or drops it (closing the connection) when the deadline
    /// passes before the slot was released. `None`: closed at the deadline.
    pub async fn guard<F: Future>(&self, connection: F) -> Option<F::Output> {
        tokio::select! {
            out = connection => Some(out),
            () = self.expired() => None,
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.release();
    }
}

/// Limits of an [`AuthLimiter`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthLimits {
    /// Failed authentications from one source that block it until the window ends; 0: off.
    pub max_failures: u32,
    /// The window, from the first failure counted in it.
    pub window: Duration,
    /// Sources tracked at most (memory bound).
    pub max_sources: usize,
}

impl Default for AuthLimits {
    fn default() -> Self {
        Self {
            max_failures: DEFAULT_AUTH_FAILURES,
            window: DEFAULT_AUTH_FAILURE_WINDOW,
            max_sources: DEFAULT_AUTH_SOURCES,
        }
    }
}

/// A source that failed authentication too often: refuse without checking the credential.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("too many failed authentication attempts from this address; retry in {} s", self.retry_after_secs())]
pub struct Blocked {
    /// Until the window ends.
    pub retry_after: Duration,
}

impl Blocked {
    /// Whole seconds to wait (rounded up, at least 1), for `Retry-After`.
    pub fn retry_after_secs(&self) -> u64 {
        let secs = self.retry_after.as_secs() + u64::from(self.retry_after.subsec_nanos() > 0);
        secs.max(1)
    }

    /// The `Retry-After` header value.
    pub fn retry_after_header(&self) -> HeaderValue {
        HeaderValue::from(self.retry_after_secs())
    }

    /// The error code in JSON answers.
    pub const CODE: &'static str = "too_many_auth_failures";
}

#[derive(Clone, Copy, Debug)]
struct Window {
    start: Instant,
    failures: u32,
}

/// Failed authentications per source in fixed windows (see the module documentation).
#[derive(Debug)]
pub struct AuthLimiter {
    limits: AuthLimits,
    windows: DashMap<IpAddr, Window>,
}

impl Default for AuthLimiter {
    fn default() -> Self {
        Self::new(AuthLimits::default())
    }
}

impl AuthLimiter {
    pub fn new(limits: AuthLimits) -> Self {
        Self {
            limits: AuthLimits {
                max_sources: limits.max_sources.max(1),
                ..limits
            },
            windows: DashMap::new(),
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> AuthLimits {
        self.limits
    }

    /// Whether `ip` is past its limit at `now`.
    fn check_at(&self, ip: IpAddr, now: Instant) -> Result<(), Blocked> {
        if self.limits.max_failures == 0 {
            return Ok(());
        }
        let Some(w) = self.windows.get(&source_key(ip)).map(|w| *w) else {
            return Ok(());
        };
        let end = w.start + self.limits.window;
        if w.failures >= self.limits.max_failures && now < end {
            return Err(Blocked {
                retry_after: end - now,
            });
        }
        Ok(())
    }

    /// Counts a failed authentication from `ip`; `Err` when `ip` is now past its limit (the
    /// refusal is then a 429 with `Retry-After` rather than a 401).
    pub fn failed(&self, ip: IpAddr) -> Result<(), Blocked> {
        self.failed_at(ip, Instant::now())
    }

    /// [`AuthLimiter::failed`] at a given time.
    pub fn failed_at(&self, ip: IpAddr, now: Instant) -> Result<(), Blocked> {
        if self.limits.max_failures == 0 {
            return Ok(());
        }
        // Past the limit before this failure: the first `max_failures` get their 401.
        let blocked = self.check_at(ip, now);
        self.count_failure(ip, now);
        blocked
    }

    fn count_failure(&self, ip: IpAddr, now: Instant) {
        let key = source_key(ip);
        let window = self.limits.window;
        if let Some(mut w) = self.windows.get_mut(&key) {
            if now >= w.start + window {
                *w = Window {
                    start: now,
                    failures: 1,
                };
            } else {
                w.failures = w.failures.saturating_add(1);
            }
            return;
        }
        if self.windows.len() >= self.limits.max_sources {
            self.windows.retain(|_, w| now < w.start + window);
            while self.windows.len() >= self.limits.max_sources {
                let oldest = self
                    .windows
                    .iter()
                    .min_by_key(|e| e.value().start)
                    .map(|e| *e.key());
                match oldest {
                    Some(k) => {
                        self.windows.remove(&k);
                    }
                    None => break,
                }
            }
        }
        self.windows
            .entry(key)
            .and_modify(|w| w.failures = w.failures.saturating_add(1))
            .or_insert(Window {
                start: now,
                failures: 1,
            });
    }

    /// Sources tracked now.
    pub fn tracked(&self) -> usize {
        self.windows.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn sources_group_mapped_v4_and_v6_prefixes() {
        assert_eq!(source_key(ip("10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(source_key(ip("::ffff:10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(source_key(ip("2001:db8:1:2:aaaa::1")), ip("2001:db8:1:2::"));
        assert_eq!(
            source_key(ip("2001:db8:1:2:ffff::9")),
            source_key(ip("2001:db8:1:2::1"))
        );
        assert_ne!(
            source_key(ip("2001:db8:1:3::1")),
            source_key(ip("2001:db8:1:2::1"))
        );
    }

    #[tokio::test]
    async fn pending_caps_total_and_per_source() {
        let a = Admission::new(PendingLimits {
            max_pending: 3,
            max_pending_per_source: 2,
        });
        let d = Instant::now() + Duration::from_secs(5);
        let (x, y) = (Some(ip("10.0.0.1")), Some(ip("10.0.0.2")));
        let p1 = a.try_admit(x, d).unwrap();
        let p2 = a.try_admit(x, d).unwrap();
        assert_eq!(a.try_admit(x, d).unwrap_err(), Refusal::PerSource);
        // A refused admission takes nothing.
        assert_eq!(a.pending(), 2);
        let p3 = a.try_admit(y, d).unwrap();
        assert_eq!(a.try_admit(y, d).unwrap_err(), Refusal::Total);
        assert_eq!(a.try_admit(None, d).unwrap_err(), Refusal::Total);
        // Release is idempotent, and drop after release frees nothing twice.
        p1.release();
        p1.release();
        assert_eq!(a.pending(), 2);
        drop(p1);
        assert_eq!(a.pending(), 2);
        let p4 = a.try_admit(x, d).unwrap();
        drop((p2, p3, p4));
        assert_eq!(a.pending(), 0);
        assert!(a.inner.per_source.lock().is_empty());
        // Per-source cap 0: only the total.
        let a = Admission::new(PendingLimits {
            max_pending: 2,
            max_pending_per_source: 0,
        });
        let _k = (a.try_admit(x, d).unwrap(), a.try_admit(x, d).unwrap());
        assert_eq!(a.try_admit(x, d).unwrap_err(), Refusal::Total);
    }

    #[tokio::test(start_paused = true)]
    async fn pending_guard_closes_only_unreleased_connections() {
        let a = Admission::new(PendingLimits::default());
        let d = Instant::now() + Duration::from_millis(100);
        let slow = a.try_admit(None, d).unwrap();
        let out = slow.guard(std::future::pending::<()>()).await;
        assert_eq!(out, None);
        let fast = a.try_admit(None, d).unwrap();
        fast.release();
        let out = fast
            .guard(tokio::time::sleep(Duration::from_millis(300)))
            .await;
        assert_eq!(out, Some(()));
    }

    #[test]
    fn refusal_answers_are_complete_http() {
        let text = String::from_utf8(Refusal::PerSource.http_response()).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 429 Too Many Requests\r\n"),
            "{text}"
        );
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())));
        assert!(head.contains("retry-after: 1"));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_pending_connections");
        assert!(Refusal::Total.http_response().starts_with(b"HTTP/1.1 503 "));
    }

    #[test]
    fn blocks_after_n_failures_until_the_window_ends() {
        let l = AuthLimiter::new(AuthLimits {
            max_failures: 3,
            window: Duration::from_secs(10),
            max_sources: 100,
        });
        let t0 = Instant::now();
        let (bad, good) = (ip("10.0.0.1"), ip("10.0.0.2"));
        for i in 0..3 {
            assert!(
                l.failed_at(bad, t0 + Duration::from_secs(i)).is_ok(),
                "attempt {i}"
            );
        }
        // Past the limit: the next failure is refused as blocked.
        assert!(l.failed_at(bad, t0 + Duration::from_secs(3)).is_err());
        let blocked = l
            .check_at(bad, t0 + Duration::from_millis(3500))
            .unwrap_err();
        assert_eq!(blocked.retry_after, Duration::from_millis(6500));
        assert_eq!(blocked.retry_after_secs(), 7);
        assert_eq!(blocked.retry_after_header(), "7");
        // Another source is not affected; successes are never recorded.
        assert!(l.check_at(good, t0 + Duration::from_secs(4)).is_ok());
        // The window ends: allowed again, and the next failure opens a new window.
        assert!(l.check_at(bad, t0 + Duration::from_secs(10)).is_ok());
        assert!(l.failed_at(bad, t0 + Duration::from_secs(11)).is_ok());
        assert!(l.check_at(bad, t0 + Duration::from_secs(11)).is_ok());
        // The same /64 is one source.
        let v6 = AuthLimiter::new(AuthLimits {
            max_failures: 1,
            ..AuthLimits::default()
        });
        assert!(v6.failed_at(ip("2001:db8::1"), t0).is_ok());
        assert!(v6.check_at(ip("2001:db8::2"), t0).is_err());
        assert!(v6.check_at(ip("2001:db8:0:1::2"), t0).is_ok());
    }

    #[test]
    fn zero_failures_turns_the_limiter_off() {
        let l = AuthLimiter::new(AuthLimits {
            max_failures: 0,
            ..AuthLimits::default()
        });
        let t0 = Instant::now();
        for _ in 0..100 {
            assert!(l.failed_at(ip("10.0.0.1"), t0).is_ok());
        }
        assert!(l.check_at(ip("10.0.0.1"), t0).is_ok());
        assert_eq!(l.tracked(), 0);
    }

    #[test]
    fn the_table_stays_bounded() {
        let l = AuthLimiter::new(AuthLimits {
            max_failures: 2,
            window: Duration::from_secs(10),
            max_sources: 4,
        });
        let t0 = Instant::now();
        let addr = |i: u32| IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i));
        // Four live windows; the oldest is evicted for a fifth source.
        for i in 0..4 {
            let _ = l.failed_at(addr(i), t0 + Duration::from_secs(u64::from(i)));
            let _ = l.failed_at(addr(i), t0 + Duration::from_secs(u64::from(i)));
        }
        assert_eq!(l.tracked(), 4);
        let _ = l.failed_at(addr(9), t0 + Duration::from_secs(5));
        assert_eq!(l.tracked(), 4);
        assert!(l.check_at(addr(0), t0 + Duration::from_secs(5)).is_ok());
        assert!(l.check_at(addr(1), t0 + Duration::from_secs(5)).is_err());
        // Ended windows go first: after they all end, a burst of new sources replaces them.
        let later = t0 + Duration::from_secs(60);
        let at = |i: u32| later + Duration::from_millis(u64::from(i));
        for i in 100..110 {
            let _ = l.failed_at(addr(i), at(i));
        }
        assert_eq!(l.tracked(), 4);
        for i in 106..110 {
            let _ = l.failed_at(addr(i), at(i));
            assert!(l.check_at(addr(i), at(110)).is_err(), "{i}");
        }
    }
}
