//! The data plane's side of faden's control plane: what `gateway`, `worker` and `tunnel` need to
//! read the cluster's state, without the server (no store, no management API).
//!
//! - [`model`]: the GPUStack-compatible wire types.
//! - [`routing`]: the immutable routing snapshot the gateway reads on every request.
//! - [`sync`]: the client that keeps a [`routing::RoutingSnapshot`] current from a management
//!   API (faden's or GPUStack's).
//! - [`key_check`]: API keys checked against the management server (GPUStack's `/token-auth`),
//!   with a bounded cache of its verdicts.
//! - [`cluster_tokens`]: the credential each cluster's worker proxies take.
//! - [`engine_load`]: the engines' own load readings, as the routing policy reads them.
//! - [`client`]: a minimal JSON client of the management API (the worker agent's and `faden up`'s).
//! - [`tokens`]: key and token formats, generation and verification.
//! - [`tls`]: client TLS to the management API.

pub mod client;
pub mod cluster_tokens;
pub mod engine_load;
pub mod key_check;
pub mod model;
pub mod routing;
pub mod sync;
pub mod tls;
pub mod tokens;
