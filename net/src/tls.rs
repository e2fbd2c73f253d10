//! TLS material: PEM files read into rustls configurations, for the client-facing listener
//! ([`server_config`]) and for upstream mutual TLS ([`client_config`]).
//!
//! Both use the `ring` provider explicitly (never a process-wide default) and rustls' safe
//! default protocol versions (TLS 1.2 and 1.3). Trust comes only from the configured bundles:
//! no system or webpki roots. Every error names the file it comes from.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::config::{ServerTlsConfig, UpstreamTls};

/// ALPN protocols offered by the listener, in order of preference.
pub const SERVER_ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// A TLS setting that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    /// A file is unreadable, is not PEM, or holds nothing usable.
    #[error("{what} {}: {reason}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    /// rustls refused a certificate with its key (say, they do not match).
    #[error("certificate {} with key {}: {reason}", cert.display(), key.display())]
    KeyPair {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
    /// A client certificate without its key, or the reverse.
    #[error("upstream TLS ({scope}): client_cert and client_key must be set together")]
    IncompleteClientIdentity { scope: String },
    /// The server name override is not a DNS name or an IP address.
    #[error("upstream TLS ({scope}): invalid server name {name:?}")]
    ServerName { scope: String, name: String },
    /// rustls refused the settings as a whole.
    #[error("TLS settings refused: {0}")]
    Rustls(#[from] rustls::Error),
    /// The client CA bundle cannot verify client certificates.
    #[error("client CA bundle {}: {reason}", path.display())]
    ClientVerifier { path: PathBuf, reason: String },
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn file_error(what: &'static str, path: &Path, reason: impl ToString) -> TlsConfigError {
    TlsConfigError::File {
        what,
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

/// Every certificate in a PEM file (at least one).
fn load_certs(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(what, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(what, path, e))?;
    if certs.is_empty() {
        return Err(file_error(what, path, "no CERTIFICATE section found"));
    }
    Ok(certs)
}

/// The first private key in a PEM file.
fn load_key(what: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsConfigError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            file_error(what, path, "no PRIVATE KEY section found")
        }
        e => file_error(what, path, e),
    })
}

/// A root store of every certificate in a PEM bundle.
fn load_roots(what: &'static str, path: &Path) -> Result<RootCertStore, TlsConfigError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(what, path)? {
        roots
            .add(cert)
            .map_err(|e| file_error(what, path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

/// The listener's rustls configuration: ALPN `h2` and `http/1.1`; client certificates
/// required and verified against `client_ca` when it is set.
pub fn server_config(tls: &ServerTlsConfig) -> Result<Arc<ServerConfig>, TlsConfigError> {
    let chain = load_certs("TLS certificate chain", &tls.cert_chain)?;
    let key = load_key("TLS private key", &tls.private_key)?;
    let builder =
        ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let builder = match &tls.client_ca {
        Some(path) => {
            let roots = load_roots("client CA bundle", path)?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| TlsConfigError::ClientVerifier {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| TlsConfigError::KeyPair {
            cert: tls.cert_chain.clone(),
            key: tls.private_key.clone(),
            reason: e.to_string(),
        })?;
    config.alpn_protocols = SERVER_ALPN.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// An upstream's rustls configuration (ALPN `http/1.1`: the upstream pool speaks HTTP/1.1)
/// and its server name override. `scope` names the entry in errors (`default`, `cluster 3`).
pub fn client_config(
    tls: &UpstreamTls,
    scope: &str,
) -> Result<(Arc<ClientConfig>, Option<ServerName<'static>>), TlsConfigError> {
    let roots = load_roots("upstream CA bundle", &tls.ca_bundle)?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut config = match (&tls.client_cert, &tls.client_key) {
        (Some(cert), Some(key)) => {
            let chain = load_certs("upstream client certificate", cert)?;
            let key_der = load_key("upstream client key", key)?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| TlsConfigError::KeyPair {
                    cert: cert.clone(),
                    key: key.clone(),
                    reason: e.to_string(),
                })?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => {
            return Err(TlsConfigError::IncompleteClientIdentity {
                scope: scope.to_owned(),
            });
        }
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let name =
        match &tls.server_name {
            Some(name) => Some(ServerName::try_from(name.clone()).map_err(|_| {
                TlsConfigError::ServerName {
                    scope: scope.to_owned(),
                    name: name.clone(),
                }
            })?),
            None => None,
        };
    Ok((Arc::new(config), name))
}
