//! The one certificate verifier of the tests and benchmarks that talk to self-signed servers:
//! [`AnyCertificate`] takes any server certificate and still checks the handshake's signature
//! with the certificate's key, so each exchange is a real TLS handshake; only the identity check
//! is skipped. Never part of a deployment.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, SubjectPublicKeyInfoDer, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// The `id-pe-acmeIdentifier` extension (RFC 8737 §6.1: 1.3.6.1.5.5.7.1.31), critical in every
/// TLS-ALPN-01 certificate.
const ACME_IDENTIFIER: &str = "1.3.6.1.5.5.7.1.31";

/// Takes any server certificate, checking only the handshake's signatures: the tests look at
/// which certificate they got, and the load generators talk to self-signed servers.
///
/// webpki (which rustls checks signatures through) refuses to read a TLS-ALPN-01 certificate,
/// for its critical `acmeIdentifier` extension. For such a leaf a TLS 1.3 handshake is checked
/// against the leaf's key read with x509-parser, and a TLS 1.2 one is not checked (rustls has
/// no check of a TLS 1.2 signature by a bare key); any other leaf is checked by webpki.
#[derive(Debug)]
pub struct AnyCertificate;

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        if is_tls_alpn_01(cert) {
            return Ok(HandshakeSignatureValid::assertion());
        }
        rustls::crypto::verify_tls12_signature(message, cert, dss, &algorithms())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        if !is_tls_alpn_01(cert) {
            return rustls::crypto::verify_tls13_signature(message, cert, dss, &algorithms());
        }
        let (_, leaf) = x509_parser::parse_x509_certificate(cert)
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        let spki = SubjectPublicKeyInfoDer::from(leaf.public_key().raw);
        rustls::crypto::verify_tls13_signature_with_raw_key(message, &spki, dss, &algorithms())
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        algorithms().supported_schemes()
    }
}

/// The signature algorithms of the ring provider, the one the workspace uses throughout.
fn algorithms() -> WebPkiSupportedAlgorithms {
    rustls::crypto::ring::default_provider().signature_verification_algorithms
}

/// Whether `cert` carries the `acmeIdentifier` extension (an unreadable certificate does not:
/// webpki then refuses it with its own error).
fn is_tls_alpn_01(cert: &CertificateDer<'_>) -> bool {
    x509_parser::parse_x509_certificate(cert).is_ok_and(|(_, c)| {
        c.extensions()
            .iter()
            .any(|e| e.oid.to_id_string() == ACME_IDENTIFIER)
    })
}
