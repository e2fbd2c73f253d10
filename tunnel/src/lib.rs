//! faden tunnel: yamux over one outbound WebSocket per worker.
//!
//! A worker that cannot accept inbound connections dials the server's management API at
//! `ws(s)://<server>/connect` (subprotocol [`protocol::SUBPROTOCOL`]) and keeps that one
//! connection up. The server opens one yamux stream per upstream connection; the worker serves
//! its reverse proxy (HTTP/1.1) on each stream, which relays the stream to one of that worker's
//! own instances after a `CONNECT model-<m>-<i>.static:0` (or forwards per request), so the
//! tunnel only ever reaches those. See `docs/protocol.md`.
//!
//! - [`ws_io`]: a WebSocket (binary messages, RFC 6455 framing done here) as a byte stream, with
//!   ping and dead-peer timeout; its buffers exist only while the tunnel is busy.
//! - [`mux`]: the yamux connection driven in its own task; streams handed out over channels.
//! - [`client`]: the worker end ([`TunnelClient`]): dial, authenticate, serve, reconnect.
//! - [`server`]: the server end ([`TunnelServer`]): the `/connect` handler and the registry.
//! - [`connector`]: one way to a worker's proxy or instance, whichever dialect its tunnel
//!   speaks: a stream, or requests on kept-alive ones.
//! - [`proxy_port`]: the HTTP proxy on the proxy port (30079) that relays to tunnel workers.
//! - [`target`]: the instance names of `X-GPUStack-Model-Instance` and of relay `CONNECT`s.
//! - [`http`]: serving HTTP/1.1 on a single stream, and a client connection on one.
//! - [`tls`]: rustls client settings from an explicit CA bundle.
//! - [`error`]: typed errors; reconnects back off with `net::backoff`.
//! - [`gpustack_message`]: GPUStack's own tunnel messages (its workers' tunnel client).
//! - [`gpustack_link`]: the server end of a GPUStack worker's tunnel, its sessions as streams.
//!
//! # Wiring
//!
//! Worker (`faden worker`, tunnel mode): build a [`TunnelClient`] from the server URL and the
//! worker token (plus [`tls::client_config`] for `https`), and run it with a
//! [`http::StreamHandler`] that serves each stream; the worker crate's `worker::tunnel::serve`
//! does this with the worker proxy ([`http::HttpHandler`] over a `service_fn`).
//!
//! Server (`faden server`): build a [`TunnelServer`] with the token check, the address lookup
//! and the up/down callback, answer `/connect` with [`TunnelServer::handle_connect`] (the
//! management API serves that route), pass
//! the gateway's `TunnelUpstream` (a [`connector::Connector`] over [`TunnelServer`]) to
//! `GatewayBuilder::tunnel`, and serve a [`ProxyPort`] (the same connector) on the proxy port.
//! The gateway's side of the tunnel lives in the gateway crate; this crate knows nothing of it.
#![forbid(unsafe_code)]

pub mod client;
pub mod connector;
pub mod error;
pub mod gpustack_link;
pub mod gpustack_message;
pub mod http;
pub mod mux;
pub mod protocol;
pub mod proxy_port;
pub mod server;
pub mod target;
pub mod tls;
pub mod ws_io;

pub use crate::client::{Leaving, TunnelClient, TunnelClientConfig, TunnelStatus};
pub use crate::error::TunnelError;
pub use crate::mux::{MuxConfig, TunnelStream};
pub use crate::proxy_port::{ProxyPort, ProxyPortConfig};
pub use crate::server::{
    Dialect, TunnelServer, TunnelServerConfig, TunnelUp, WorkerAddress, WorkerIdentity,
};
