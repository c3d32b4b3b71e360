//! The certificate the workers serve: loaded from the operator's PEM files and checked at start
//! and at every reload (so a bad file is refused by the demux, naming it, rather than by every
//! worker), or a fresh self-signed one for local use. Workers receive the PEM text in the
//! hand-off. The reading, checking and making are `ringmux_proto::certs`, which the worker
//! library reads the hand-off's text with too.

pub use ringmux_proto::certs::{CertError, CertPem, SELF_SIGNED_NAMES};
