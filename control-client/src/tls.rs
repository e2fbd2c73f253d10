//! TLS for the clients of the management API (the worker agent, the sync client): which server
//! certificates to trust, and a connector that speaks `http` and `https`.
//!
//! Trust comes from an explicit CA bundle (`--server-ca`), else from the platform's root store
//! (rustls-native-certs: the system bundle on Linux). A server's own in-process clients instead
//! pin the exact certificate the server presents ([`pinned_client_config`]). rustls with the
//! `ring` provider only; no OpenSSL.

use std::fmt;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// Why TLS client settings cannot be built, or a connection cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientTlsError {
    /// The CA bundle is unreadable, not PEM, or holds no usable certificate.
    #[error("server CA bundle {}: {reason}", path.display())]
    CaBundle { path: PathBuf, reason: String },
    /// No CA bundle was given and the platform's root store has no usable certificate.
    #[error(
        "no trusted root certificates: the platform root store is empty or unreadable ({0}); pass the server's CA bundle (--server-ca)"
    )]
    NoPlatformRoots(String),
    /// An `https` URL, but the client has no TLS settings.
    #[error("{0}: an https URL needs TLS settings")]
    NoTlsSettings(String),
    /// rustls refused the settings.
    #[error("TLS settings refused: {0}")]
    Rustls(#[from] rustls::Error),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Client settings trusting the certificates of the PEM bundle at `ca`, or the platform's root
/// store when `ca` is `None`. No ALPN: the management API and the tunnel speak HTTP/1.1.
pub fn client_config(ca: Option<&Path>) -> Result<Arc<ClientConfig>, ClientTlsError> {
    let roots = match ca {
        Some(path) => bundle_roots(path)?,
        None => platform_roots()?,
    };
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The TLS settings a client of `server_url` needs: `None` for an `http` (or `ws`) URL, else
/// [`client_config`] with `ca`.
pub fn for_server_url(
    server_url: &str,
    ca: Option<&Path>,
) -> Result<Option<Arc<ClientConfig>>, ClientTlsError> {
    let url = server_url.trim();
    let secure = ["https://", "wss://"].iter().any(|p| {
        url.get(..p.len())
            .is_some_and(|s| s.eq_ignore_ascii_case(p))
    });
    secure.then(|| client_config(ca)).transpose()
}

fn bundle_roots(path: &Path) -> Result<RootCertStore, ClientTlsError> {
    let err = |reason: String| ClientTlsError::CaBundle {
        path: path.to_owned(),
        reason,
    };
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path).map_err(|e| err(e.to_string()))? {
        let cert = cert.map_err(|e| err(e.to_string()))?;
        roots
            .add(cert)
            .map_err(|e| err(format!("not a usable CA certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(err("no CERTIFICATE section found".to_owned()));
    }
    Ok(roots)
}

fn platform_roots() -> Result<RootCertStore, ClientTlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let reason = match found.errors.first() {
            Some(e) => e.to_string(),
            None => "no certificate found".to_owned(),
        };
        return Err(ClientTlsError::NoPlatformRoots(reason));
    }
    Ok(roots)
}

/// [`pinned_client_config`] for the first certificate of the PEM chain at `chain` (the leaf
/// the server presents).
pub fn pinned_client_config_for(chain: &Path) -> Result<Arc<ClientConfig>, ClientTlsError> {
    let err = |reason: String| ClientTlsError::CaBundle {
        path: chain.to_owned(),
        reason,
    };
    let leaf = CertificateDer::pem_file_iter(chain)
        .map_err(|e| err(e.to_string()))?
        .next()
        .ok_or_else(|| err("no CERTIFICATE section found".to_owned()))?
        .map_err(|e| err(e.to_string()))?;
    pinned_client_config(leaf)
}

/// Client settings that accept exactly the server certificate `leaf` (whatever name is
/// dialled): for a server's own in-process clients of its API on loopback.
pub fn pinned_client_config(
    leaf: CertificateDer<'static>,
) -> Result<Arc<ClientConfig>, ClientTlsError> {
    let provider = provider();
    let verifier = Arc::new(PinnedCert {
        leaf,
        provider: provider.clone(),
    });
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// Accepts one certificate, byte for byte; the handshake signatures are still verified.
#[derive(Debug)]
struct PinnedCert {
    leaf: CertificateDer<'static>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if end_entity.as_ref() == self.leaf.as_ref() {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Connects the management API's clients: plain TCP for `http`, TLS for `https` (with the
/// settings given; without them an `https` URL is an error).
#[derive(Clone)]
pub struct ApiConnector {
    http: HttpConnector,
    tls: Option<tokio_rustls::TlsConnector>,
}

impl fmt::Debug for ApiConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiConnector")
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl ApiConnector {
    /// `http` is the TCP connector (timeouts, nodelay); `tls` the settings for `https`.
    pub fn new(mut http: HttpConnector, tls: Option<Arc<ClientConfig>>) -> Self {
        http.enforce_http(false);
        Self {
            http,
            tls: tls.map(tokio_rustls::TlsConnector::from),
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Uri> for ApiConnector {
    type Response = ApiStream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<ApiStream, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.http.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let secure = uri.scheme_str() == Some("https");
        let tls = self.tls.clone();
        let host = uri
            .host()
            .unwrap_or_default()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let connecting = self.http.call(uri.clone());
        Box::pin(async move {
            if !secure {
                return Ok(ApiStream::Plain(connecting.await?));
            }
            let tls = tls.ok_or_else(|| ClientTlsError::NoTlsSettings(uri.to_string()))?;
            let name = ServerName::try_from(host)?;
            let tcp = connecting.await?.into_inner();
            let stream = tls.connect(name, tcp).await?;
            Ok(ApiStream::Tls(Box::new(TokioIo::new(stream))))
        })
    }
}

/// A connection made by [`ApiConnector`].
#[derive(Debug)]
pub enum ApiStream {
    Plain(TokioIo<TcpStream>),
    Tls(Box<TokioIo<TlsStream<TcpStream>>>),
}

impl Connection for ApiStream {
    fn connected(&self) -> Connected {
        match self {
            ApiStream::Plain(s) => s.connected(),
            ApiStream::Tls(_) => Connected::new(),
        }
    }
}

impl Read for ApiStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ApiStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ApiStream::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl Write for ApiStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ApiStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ApiStream::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ApiStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ApiStream::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ApiStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ApiStream::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}
