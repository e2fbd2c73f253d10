//! The worker side of faden, in one place: everything a GPU worker runs beside its inference
//! engines, and nothing of the OpenAI gateway.
//!
//! - [`agent`]: registration with the management server (the worker token kept under the data
//!   directory and reused after a restart), heartbeats, and the instances it reports with
//!   their health;
//! - [`proxy`]: the worker reverse proxy on the worker port (10150), which forwards to this
//!   worker's own instances only, per request or as a byte relay after `CONNECT`; on a tunnel
//!   worker it serves the tunnel's streams instead of a port (`tunnel::client`);
//! - [`tunnel`]: a tunnel worker's serving: the proxy on the streams of the tunnel it dials;
//! - [`engine_load`]: the engines' load, read from their metrics every 100 ms and streamed to
//!   every server;
//! - [`metrics`]: the worker's Prometheus endpoint.
//!
//! `faden worker` wires them: the agent's instance updates feed [`proxy::LocalInstances`], and
//! in `tunnel` mode [`tunnel::serve`] carries the proxy over the server's `/connect`.

pub mod agent;
pub mod engine_load;
pub mod metrics;
pub mod proxy;
pub mod tunnel;
