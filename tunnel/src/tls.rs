//! TLS for `wss://` server URLs: rustls with the `ring` provider and an explicit CA bundle.
//! (`faden worker` builds its settings with `control_client::tls::client_config`, which also falls back
//! to the platform roots; [`TunnelClientConfig::tls`](crate::TunnelClientConfig::tls) takes
//! either.)

use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;

use crate::error::TunnelError;

/// Client settings trusting exactly the certificates of `ca_pem` (one or more PEM blocks).
pub fn client_config(ca_pem: &[u8]) -> Result<Arc<rustls::ClientConfig>, TunnelError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        let cert = cert.map_err(|e| TunnelError::Tls(format!("CA bundle: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| TunnelError::Tls(format!("CA bundle: {e}")))?;
    }
    if roots.is_empty() {
        return Err(TunnelError::Tls(
            "the CA bundle holds no certificate".into(),
        ));
    }
    client_config_with_roots(roots)
}

/// Client settings trusting `roots`.
pub fn client_config_with_roots(
    roots: rustls::RootCertStore,
) -> Result<Arc<rustls::ClientConfig>, TunnelError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TunnelError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
