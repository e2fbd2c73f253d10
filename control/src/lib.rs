//! faden control plane: the management API server.
//!
//! - [`store`]: the store (SQLite or PostgreSQL) with its event history.
//! - [`api`]: the management API (`/v2/...`) and its watch streams.
//! - [`server`]: serving the API with bootstrap and graceful shutdown.
//! - [`worker_config`] and [`helm`]: validators for cluster configuration.
//! - [`join`]: the commands and manifests that add a worker to a cluster.
//!
//! What the data plane reads of it (wire types, the routing snapshot, the sync client, token
//! formats) is the `control-client` crate.

pub mod api;
pub mod helm;
pub mod join;
pub mod server;
pub mod store;
pub mod worker_config;
