//! Test helpers shared by faden's integration tests: a small HTTP client over real loopback
//! sockets, test certificates and TLS helpers ([`certs`]), helpers to run the `faden` binary and
//! read its bound addresses from its log, a bounded poll for a condition ([`wait`]), and a
//! throwaway PostgreSQL cluster ([`postgres`]).
//!
//! Test code: panics on setup failures are the desired behaviour here.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

pub mod certs;
pub mod http_client;
#[cfg(unix)]
pub mod postgres;
pub mod process;
pub mod raw;
pub mod wait;

pub use http_client::{Client, Reply};
pub use wait::{wait_until, wait_until_async};

/// A port that was free a moment ago on 127.0.0.1, for a child process that must keep the same
/// port across restarts (prefer port 0 wherever a restart does not matter).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
