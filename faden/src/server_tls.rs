//! TLS of the clients that call the management server (`--server-ca`).

use anyhow::Context as _;

/// TLS settings for a client of the management API at `server_url`: for `https`, the `ca`
/// bundle (`--server-ca`), else the platform's root certificates; `None` for `http`.
pub fn server_tls(
    server_url: &str,
    ca: Option<&std::path::Path>,
) -> anyhow::Result<Option<std::sync::Arc<rustls::ClientConfig>>> {
    let tls = control::tls::for_server_url(server_url, ca)
        .context("the server's TLS settings (--server-ca)")?;
    if tls.is_none() && ca.is_some() {
        tracing::warn!("--server-ca is not used: the server URL is not https");
    }
    Ok(tls)
}
