//! Shared networking of faden's listeners and clients: what the gateway, the tunnel, the worker
//! and the control API all stand on, and nothing of what they do with it.
//!
//! - [`listener`]: the one accept loop (admission, header read timeout, TLS, HTTP/1 and HTTP/2,
//!   draining on shutdown), with [`admission`] (pending-connection caps, failed-auth limits) and
//!   [`events`] (what a listener reports);
//! - [`h1`]: the native HTTP/1 server and client codecs; [`framing`]: the `Content-Length` +
//!   `Transfer-Encoding` guard of connections served by hyper;
//! - [`pool`]: the upstream HTTP/1 connection pool over any byte stream;
//! - [`relay`]: byte relays of taken-over connections and their drain; [`stop`]: a stop signal
//!   cheap to poll;
//! - [`headers`]: hop-by-hop and header rules; [`tls`]: server and client TLS settings;
//!   [`task`]: the one untracked spawn; [`backoff`]: the one reconnect backoff.

pub mod admission;
pub mod backoff;
pub mod config;
pub mod cores;
pub mod events;
pub mod framing;
pub mod h1;
pub mod hash;
pub mod headers;
pub mod listener;
pub mod pool;
pub mod relay;
pub mod stop;
pub mod task;
pub mod tls;

use bytes::Bytes;

/// A boxed error, as bodies and clients report them.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The OpenAI error shape `{"error": {"message", "type", "code"}}`, which every faden listener
/// answers with.
pub fn error_body(message: &str, error_type: &str, code: &str) -> Bytes {
    let value = serde_json::json!({
        "error": {"message": message, "type": error_type, "code": code}
    });
    Bytes::from(value.to_string())
}
