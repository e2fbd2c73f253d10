//! Test certificates made at test time with rcgen, rustls configurations built from them, PEM
//! files in a temporary directory, and a TLS front for plain test servers.
//!
//! Every configuration uses the `ring` provider explicitly (never a process-wide default), and
//! trusts only the test CA it is given: no system or webpki roots.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The `ring` provider, shared.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A test certificate authority.
#[derive(Debug)]
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A leaf certificate and its key.
#[derive(Debug)]
pub struct TestCert {
    /// The leaf certificate (PEM).
    pub cert_pem: String,
    /// The PKCS#8 private key (PEM).
    pub key_pem: String,
    cert_der: CertificateDer<'static>,
    key_der: Vec<u8>,
}

impl TestCert {
    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.cert_der.clone()
    }

    pub fn key_der(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }
}

impl TestCa {
    /// A new self-signed CA whose common name is `name`.
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        Self {
            issuer: CertifiedIssuer::self_signed(params, key).unwrap(),
        }
    }

    /// The CA certificate (PEM), for a trust bundle.
    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.issuer.der().clone()
    }

    /// Roots holding only this CA.
    pub fn roots(&self) -> RootCertStore {
        let mut roots = RootCertStore::empty();
        roots.add(self.cert_der()).unwrap();
        roots
    }

    /// A server certificate for `127.0.0.1` and `localhost`.
    pub fn server_cert(&self) -> TestCert {
        self.leaf(
            "test server",
            &["127.0.0.1", "localhost"],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A server certificate for the given names (IP addresses or DNS names).
    pub fn server_cert_for(&self, names: &[&str]) -> TestCert {
        self.leaf("test server", names, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate whose common name is `name`.
    pub fn client_cert(&self, name: &str) -> TestCert {
        self.leaf(name, &[], ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn leaf(&self, cn: &str, names: &[&str], usage: ExtendedKeyUsagePurpose) -> TestCert {
        let names: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![usage];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        TestCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert_der: cert.der().clone(),
            key_der: key.serialize_der(),
        }
    }
}

/// A temporary directory for PEM files, removed on drop.
#[derive(Debug)]
pub struct PemDir {
    dir: tempfile::TempDir,
}

impl Default for PemDir {
    fn default() -> Self {
        Self::new()
    }
}

impl PemDir {
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// Writes `contents` to `name` in the directory and returns its path.
    pub fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }

    /// Writes a certificate and its key as `<name>.crt` and `<name>.key`.
    pub fn write_cert(&self, name: &str, cert: &TestCert) -> (PathBuf, PathBuf) {
        (
            self.write(&format!("{name}.crt"), &cert.cert_pem),
            self.write(&format!("{name}.key"), &cert.key_pem),
        )
    }

    /// Writes a CA certificate as `<name>.pem`.
    pub fn write_ca(&self, name: &str, ca: &TestCa) -> PathBuf {
        self.write(&format!("{name}.pem"), ca.cert_pem())
    }

    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

/// A rustls server configuration presenting `cert`; with `client_ca`, client certificates
/// signed by it are required.
pub fn server_config(
    cert: &TestCert,
    client_ca: Option<&TestCa>,
    alpn: &[&[u8]],
) -> Arc<ServerConfig> {
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match client_ca {
        Some(ca) => builder.with_client_cert_verifier(
            WebPkiClientVerifier::builder_with_provider(Arc::new(ca.roots()), provider())
                .build()
                .unwrap(),
        ),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(vec![cert.cert_der()], cert.key_der())
        .unwrap();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// A rustls client configuration trusting only `ca`, presenting `client` when given.
pub fn client_config(ca: &TestCa, client: Option<&TestCert>, alpn: &[&[u8]]) -> Arc<ClientConfig> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(ca.roots());
    let mut config = match client {
        Some(c) => builder
            .with_client_auth_cert(vec![c.cert_der()], c.key_der())
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// Connects to `addr` over TLS with `config`, verifying the name `127.0.0.1`.
pub async fn connect(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
}

/// A TLS-terminating front on `127.0.0.1:<ephemeral>`: each accepted TLS connection is
/// forwarded, decrypted, to a plain TCP `backend` (say, a mock engine). Connections whose
/// handshake fails never reach the backend.
#[derive(Debug)]
pub struct TlsFront {
    pub addr: SocketAddr,
    /// Handshakes that failed.
    pub handshake_failures: Arc<AtomicU64>,
    /// Handshakes that succeeded.
    pub handshakes: Arc<AtomicU64>,
    _task: CancelOnDrop,
}

impl TlsFront {
    pub async fn start(config: Arc<ServerConfig>, backend: SocketAddr) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let failures = Arc::new(AtomicU64::new(0));
        let ok = Arc::new(AtomicU64::new(0));
        let (f, o) = (failures.clone(), ok.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                let (f, o) = (f.clone(), o.clone());
                tokio::spawn(async move {
                    let mut tls = match acceptor.accept(tcp).await {
                        Ok(s) => s,
                        Err(_) => {
                            f.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    };
                    o.fetch_add(1, Ordering::SeqCst);
                    let Ok(mut plain) = TcpStream::connect(backend).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        Self {
            addr,
            handshake_failures: failures,
            handshakes: ok,
            _task: CancelOnDrop(task),
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }
}

/// Aborts the task when dropped.
#[derive(Debug)]
struct CancelOnDrop(JoinHandle<()>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
