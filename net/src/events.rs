//! What listeners report about connections (the gateway counts these in its metrics).

use crate::admission::Refusal;

/// Things a listener reports (the gateway counts them in its metrics).
pub trait ConnectionEvents: Send + Sync + 'static {
    /// A client's TLS handshake failed or timed out.
    fn tls_handshake_failed(&self, reason: HandshakeFailure);
    /// An HTTP/1 request with both `Content-Length` and `Transfer-Encoding` was refused.
    fn framing_conflict(&self);
    /// A connection was refused by a pending-connection cap.
    fn connection_refused(&self, _reason: Refusal) {}
    /// A connection was closed because its first request head was not complete in time.
    fn head_timeout(&self) {}
}

/// Why a client's TLS handshake failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandshakeFailure {
    /// Not finished within the header read timeout.
    Timeout,
    /// A certificate problem: no client certificate, or one that does not verify (or the
    /// client refused ours).
    Certificate,
    /// Another TLS error (no common version or cipher, no common ALPN, garbage).
    Protocol,
    /// The connection failed or closed mid-handshake.
    Io,
}

impl HandshakeFailure {
    pub const ALL: [HandshakeFailure; 4] = [
        HandshakeFailure::Timeout,
        HandshakeFailure::Certificate,
        HandshakeFailure::Protocol,
        HandshakeFailure::Io,
    ];

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            HandshakeFailure::Timeout => "timeout",
            HandshakeFailure::Certificate => "certificate",
            HandshakeFailure::Protocol => "protocol",
            HandshakeFailure::Io => "io",
        }
    }

    pub(crate) fn of(error: &std::io::Error) -> Self {
        use rustls::{AlertDescription as A, Error as E};
        match error.get_ref().and_then(|e| e.downcast_ref::<E>()) {
            Some(
                E::NoCertificatesPresented
                | E::InvalidCertificate(_)
                | E::AlertReceived(
                    A::BadCertificate
                    | A::UnsupportedCertificate
                    | A::CertificateRevoked
                    | A::CertificateExpired
                    | A::CertificateUnknown
                    | A::UnknownCA,
                ),
            ) => HandshakeFailure::Certificate,
            Some(_) => HandshakeFailure::Protocol,
            None => HandshakeFailure::Io,
        }
    }
}
