//! Integration tests of the management API: a real server on 127.0.0.1 (ephemeral port) over a
//! real SQLite store in a temporary directory.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bad_input;
mod clusters;
mod common;
mod drain;
mod hostile;
mod join;
mod keys;
mod orphans;
mod tls;
mod watch;
mod worker_load;
mod workers;
