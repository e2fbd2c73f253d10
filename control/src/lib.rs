//! faden control plane.
//!
//! - [`client`]: a minimal JSON client of the management API (the worker agent's and `faden up`'s).
//! - [`model`]: the GPUStack-compatible wire types.
//! - [`store`]: the embedded SQLite store with its event history.
//! - [`api`]: the management API (`/v2/...`) and its watch streams.
//! - [`server`]: serving the API with bootstrap and graceful shutdown.
//! - [`sync`]: the client that keeps a data-plane [`routing::RoutingSnapshot`] current.
//! - [`key_check`]: API keys checked against the management server (GPUStack's `/token-auth`),
//!   with a bounded cache of its verdicts.
//! - [`cluster_tokens`]: GPUStack clusters' registration tokens, the credential its worker proxies
//!   take.
//! - [`worker_config`] and [`helm`]: validators for cluster configuration.
//! - [`join`]: the commands and manifests that add a worker to a cluster.

pub mod api;
pub mod client;
pub mod cluster_tokens;
pub mod helm;
pub mod join;
pub mod key_check;
pub mod model;
pub mod routing;
pub mod server;
pub mod store;
pub mod sync;
pub mod tls;
pub mod tokens;
pub mod worker_config;
