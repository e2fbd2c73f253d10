//! Hardening flags shared by every command that listens: pending-connection caps and the
//! failed-authentication rate limit (see `net::admission` and docs/security.md).

use std::time::Duration;

use clap::Args;
use net::admission::{
    AuthLimits, DEFAULT_AUTH_FAILURE_WINDOW, DEFAULT_AUTH_FAILURES, DEFAULT_AUTH_SOURCES,
    DEFAULT_MAX_PENDING, DEFAULT_MAX_PENDING_PER_SOURCE, PendingLimits,
};

/// Limits applied to each listener of the process.
#[derive(Debug, Args, Clone)]
pub struct LimitArgs {
    /// Connections per listener that have not yet completed their first request head (or TLS
    /// handshake); more are refused at once (503).
    #[arg(long, env = "FADEN_MAX_PENDING_CONNECTIONS", default_value_t = DEFAULT_MAX_PENDING)]
    pub max_pending_connections: usize,
    /// Such pending connections per listener from one source address (IPv6: per /64); more are
    /// refused at once (429). 0: no per-source cap (behind a load balancer, every client has the
    /// balancer's address).
    #[arg(long, env = "FADEN_MAX_PENDING_PER_SOURCE", default_value_t = DEFAULT_MAX_PENDING_PER_SOURCE)]
    pub max_pending_per_source: usize,
    /// Failed authentications from one source address within --auth-failure-window after which
    /// it gets 429 (with Retry-After) until the window ends. 0: no limit.
    #[arg(long, env = "FADEN_AUTH_FAILURE_LIMIT", default_value_t = DEFAULT_AUTH_FAILURES)]
    pub auth_failure_limit: u32,
    /// The window of --auth-failure-limit, from the first failure counted in it.
    #[arg(long, env = "FADEN_AUTH_FAILURE_WINDOW", default_value = "60s", value_parser = humantime::parse_duration)]
    pub auth_failure_window: Duration,
}

impl Default for LimitArgs {
    fn default() -> Self {
        Self {
            max_pending_connections: DEFAULT_MAX_PENDING,
            max_pending_per_source: DEFAULT_MAX_PENDING_PER_SOURCE,
            auth_failure_limit: DEFAULT_AUTH_FAILURES,
            auth_failure_window: DEFAULT_AUTH_FAILURE_WINDOW,
        }
    }
}

impl LimitArgs {
    /// Problems with the values, one line each.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.max_pending_connections == 0 {
            problems.push("--max-pending-connections must be at least 1".to_owned());
        }
        if self.auth_failure_limit > 0 && self.auth_failure_window.is_zero() {
            problems.push("--auth-failure-window must be more than 0".to_owned());
        }
        problems
    }

    pub fn pending(&self) -> PendingLimits {
        PendingLimits {
            max_pending: self.max_pending_connections,
            max_pending_per_source: self.max_pending_per_source,
        }
    }

    pub fn auth(&self) -> AuthLimits {
        AuthLimits {
            max_failures: self.auth_failure_limit,
            window: self.auth_failure_window,
            max_sources: DEFAULT_AUTH_SOURCES,
        }
    }
}
