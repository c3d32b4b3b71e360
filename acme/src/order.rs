//! One order (RFC 8555 §7.4) for one site, from new-order to a stored certificate, and the
//! account it is made with (§7.3). Runs on the engine's thread while the engine holds the
//! site's lock; knows nothing of schedules (`schedule.rs`) or of the view (`engine.rs`), which
//! it reaches only by writing challenge files and ringing [`Job::challenges_changed`].
//!
//! Pebble, like Boulder, refuses some nonces on purpose (`badNonce`, RFC 8555 §6.5):
//! instant-acme retries a refused request twice itself; each step here retries three more
//! times before the order fails.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use instant_acme::{
    Account, AccountCredentials, AuthorizationStatus, ChallengeType, Error, ExternalAccountKey,
    Identifier, NewAccount, NewOrder, OrderStatus, Problem, RetryPolicy,
};
use tokio::sync::Notify;

use ringmux_proto::one_line;

use super::challenge::{ChallengeFile, Kind};
use super::https::CaClient;
use super::store::{self, Certificate, Store};
use super::{AcmeSettings, ChallengeKind, STATE_POLL_INTERVAL};

/// A challenge file outlives its order by this at most (a node that dies mid-order leaves
/// its files; every node ignores them after this).
const CHALLENGE_LIFETIME: Duration = Duration::from_secs(15 * 60);
/// The longest text kept of a CA's error.
const MAX_ERROR: usize = 1000;

/// What an order needs; the engine makes one per order.
pub struct Job {
    pub label: String,
    pub names: Vec<String>,
    pub kind: ChallengeKind,
    pub store: Arc<Store>,
    pub account: Account,
    pub client: CaClient,
    /// Rung when this order wrote or removed challenge files: the engine re-reads them at
    /// once rather than at its next poll.
    pub challenges_changed: Arc<Notify>,
    /// How long the challenges are published before the CA is told to validate: every node
    /// re-reads the state directory each [`STATE_POLL_INTERVAL`], and the workers must have
    /// them too.
    pub settle: Duration,
}

/// A failed order (or account): what went wrong, as the CA or the network said it, and when
/// the CA asked to be asked again.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{text}")]
pub struct Failure {
    pub text: String,
    pub retry_after: Option<SystemTime>,
    /// The CA refused a nonce more often than the retries allowed: the whole order is tried
    /// again at once.
    bad_nonce: bool,
}

impl Failure {
    pub fn new(text: impl Into<String>) -> Failure {
        let mut text = text.into();
        if text.len() > MAX_ERROR {
            let mut end = MAX_ERROR;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            text.push('…');
        }
        Failure {
            text,
            retry_after: None,
            bad_nonce: false,
        }
    }
}

/// The default [`Job::settle`]: four polls of every node (2 s). Every node must have read a
/// new challenge file and sent it to its workers before the CA's validators connect, which may
/// reach any node; a node busy with other work, or a shared file system slow to show a new
/// file, still makes it. Seconds against an order that takes seconds anyway.
pub const SETTLE: Duration = STATE_POLL_INTERVAL.saturating_mul(4);

/// How an order's status is polled: from a quarter second, growing by half each time, for
/// two minutes (a CA validates from several places; Let's Encrypt takes seconds).
fn polling() -> RetryPolicy {
    RetryPolicy::new()
        .initial_delay(Duration::from_millis(250))
        .backoff(1.5)
        .timeout(Duration::from_secs(120))
}

/// Runs the order and stores its certificate; the challenge files it wrote are gone when it
/// returns (or is dropped). An order that failed on refused nonces alone is made again, up to
/// twice: instant-acme's retries do not cover every request (fetching an authorization,
/// polling), and at Pebble's 5 % one order in a few hundred would fail for nothing.
pub async fn run(job: &Job) -> Result<Certificate, Failure> {
    let mut tries = 3;
    loop {
        tries -= 1;
        match order(job).await {
            Err(f) if f.bad_nonce && tries > 0 => {
                tracing::debug!(site = %job.label, error = %f.text, "ACME: order again after a refused nonce");
            }
            Err(mut f) => {
                f.retry_after = job.client.take_retry_after();
                return Err(f);
            }
            Ok(cert) => return Ok(cert),
        }
    }
}

async fn order(job: &Job) -> Result<Certificate, Failure> {
    let names: Vec<String> = job.names.iter().map(|n| n.to_ascii_lowercase()).collect();
    let ids: Vec<Identifier> = names.iter().cloned().map(Identifier::Dns).collect();
    let new_order = NewOrder::new(&ids);
    let mut order = again(async || job.account.new_order(&new_order).await)
        .await
        .map_err(|e| failure("new order", &e))?;
    let (kind, challenge_type) = match job.kind {
        ChallengeKind::Http01 => (Kind::Http01, ChallengeType::Http01),
        ChallengeKind::TlsAlpn01 => (Kind::TlsAlpn01, ChallengeType::TlsAlpn01),
    };

    // Publish an answer for every pending authorization (one whose name the account has
    // proved lately is valid already, RFC 8555 §7.1.4).
    let mut published = Published {
        store: &job.store,
        tokens: Vec::new(),
        changed: &job.challenges_changed,
    };
    let expires = store::unix_secs(SystemTime::now() + CHALLENGE_LIFETIME);
    let mut authorizations = order.authorizations();
    while let Some(authz) = authorizations.next().await {
        let mut authz = authz.map_err(|e| failure("authorization", &e))?;
        let name = authz.identifier().to_string();
        match authz.status {
            AuthorizationStatus::Pending => {}
            AuthorizationStatus::Valid => continue,
            other => {
                return Err(Failure::new(format!(
                    "the CA's authorization for {name} is {other:?}"
                )))
            }
        }
        let Some(challenge) = authz.challenge(challenge_type.clone()) else {
            return Err(Failure::new(format!(
                "the CA offers no {} challenge for {name}",
                kind_name(kind)
            )));
        };
        let file = ChallengeFile {
            kind,
            name: name.to_ascii_lowercase(),
            token: challenge.token.clone(),
            key_authorization: challenge.key_authorization().as_str().to_owned(),
            expires,
        };
        job.store
            .write_challenge(&file.token, &file.to_json())
            .map_err(|e| {
                Failure::new(format!(
                    "writing the challenge for {name} into {}: {e}",
                    job.store.root().display()
                ))
            })?;
        published.tokens.push(file.token);
    }
    if !published.tokens.is_empty() {
        job.challenges_changed.notify_one();
        tokio::time::sleep(job.settle).await;
    }

    // Tell the CA to validate.
    let mut authorizations = order.authorizations();
    while let Some(authz) = authorizations.next().await {
        let mut authz = authz.map_err(|e| failure("authorization", &e))?;
        if authz.status != AuthorizationStatus::Pending {
            continue;
        }
        if let Some(mut challenge) = authz.challenge(challenge_type.clone()) {
            again(async || challenge.set_ready().await)
                .await
                .map_err(|e| failure("challenge", &e))?;
        }
    }
    match order.poll_ready(&polling()).await {
        Ok(OrderStatus::Ready) => {}
        Ok(_) => return Err(Failure::new(invalid_authorizations(&mut order).await)),
        Err(e) => return Err(failure("validation", &e)),
    }
    drop(published);

    // A fresh key (ECDSA P-256) and its CSR for every name.
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
        .map_err(|e| Failure::new(format!("making a key: {e}")))?;
    let csr = rcgen::CertificateParams::new(names.clone())
        .and_then(|mut params| {
            params.distinguished_name = rcgen::DistinguishedName::new();
            params.serialize_request(&key)
        })
        .map_err(|e| Failure::new(format!("making the CSR: {e}")))?;
    again(async || order.finalize_csr(csr.der()).await)
        .await
        .map_err(|e| failure("finalize", &e))?;
    let chain = order
        .poll_certificate(&polling())
        .await
        .map_err(|e| failure("certificate", &e))?;

    let cert = store::examine(chain, key.serialize_pem())
        .map_err(|why| Failure::new(format!("the CA's certificate: {why}")))?;
    cert.fits(&names, SystemTime::now())
        .map_err(|why| Failure::new(format!("the CA's certificate: {why}")))?;
    job.store
        .write_cert(&job.label, &cert.issued)
        .map_err(|e| {
            Failure::new(format!(
                "storing the certificate in {}: {e}",
                job.store.root().display()
            ))
        })?;
    Ok(cert)
}

/// Why an order became invalid: each failed challenge's error, as the CA wrote it.
async fn invalid_authorizations(order: &mut instant_acme::Order) -> String {
    let mut reasons = Vec::new();
    let mut authorizations = order.authorizations();
    while let Some(authz) = authorizations.next().await {
        let Ok(mut authz) = authz else { continue };
        let name = authz.identifier().to_string();
        if let Ok(state) = authz.refresh().await {
            for c in &state.challenges {
                if let Some(p) = &c.error {
                    reasons.push(format!("{name}: {}", problem_text(p)));
                }
            }
            if reasons.is_empty() && state.status != AuthorizationStatus::Valid {
                reasons.push(format!("{name}: {:?}", state.status));
            }
        }
    }
    let mut text = String::from("the CA refused the order");
    if let Some(p) = &order.state().error {
        text.push_str(": ");
        text.push_str(&problem_text(p));
    }
    if !reasons.is_empty() {
        text.push_str(": ");
        text.push_str(&reasons.join("; "));
    }
    text
}

/// The account for `settings.directory`: the stored one, or a new one (stored at once).
/// Creating takes the state directory's account lock, so that nodes sharing it make one
/// account, not one each. Ordering accepts the CA's terms of service (RFC 8555 §7.3), as the
/// operator did by naming the CA.
pub async fn account(
    store: &Store,
    settings: &AcmeSettings,
    client: &CaClient,
) -> Result<Account, Failure> {
    if let Some(account) = stored_account(store, settings, client).await? {
        return Ok(account);
    }
    // Wait for the lock (another node may be making the account right now), bounded.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let _lock = loop {
        match store.try_lock(".account") {
            Ok(Some(lock)) => break lock,
            Ok(None) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(None) => {
                return Err(Failure::new(
                    "another process holds the account lock (locks/.account.lock) for a minute",
                ))
            }
            Err(e) => return Err(Failure::new(format!("the account lock: {e}"))),
        }
    };
    if let Some(account) = stored_account(store, settings, client).await? {
        return Ok(account);
    }
    let contact = settings.email.as_ref().map(|e| format!("mailto:{e}"));
    let contacts: Vec<&str> = contact.iter().map(String::as_str).collect();
    let eab = settings
        .eab
        .as_ref()
        .map(|e| ExternalAccountKey::new(e.kid.clone(), &e.hmac_key));
    let new = NewAccount {
        contact: &contacts,
        terms_of_service_agreed: true,
        only_return_existing: false,
    };
    let (account, credentials) = again(async || {
        instant_acme::Account::builder_with_http(client.boxed())
            .create(&new, settings.directory.clone(), eab.as_ref())
            .await
    })
    .await
    .map_err(|e| failure("new account", &e))?;
    let json = serde_json::to_value(&credentials)
        .map_err(|e| Failure::new(format!("the account's credentials: {e}")))?;
    store
        .write_account(&settings.directory, json)
        .map_err(|e| {
            Failure::new(format!(
                "storing the account in {}: {e}",
                store.root().display()
            ))
        })?;
    tracing::info!(directory = %settings.directory, id = account.id(), "ACME account created");
    Ok(account)
}

/// The stored account, if there is one; `Ok(None)` also for an entry this version cannot read
/// (it is replaced by a new account, and said so).
pub async fn stored_account(
    store: &Store,
    settings: &AcmeSettings,
    client: &CaClient,
) -> Result<Option<Account>, Failure> {
    let stored = store.read_account(&settings.directory).unwrap_or_else(|why| {
        tracing::warn!(error = %why, "ACME: the stored accounts cannot be read; making a new one");
        None
    });
    let Some(json) = stored else {
        return Ok(None);
    };
    let credentials: AccountCredentials = match serde_json::from_value(json) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "ACME: the stored account cannot be read; making a new one");
            return Ok(None);
        }
    };
    let account = instant_acme::Account::builder_with_http(client.boxed())
        .from_credentials(credentials)
        .await
        .map_err(|e| failure("directory", &e))?;
    Ok(Some(account))
}

/// Runs `step` again when the CA refused its nonce (RFC 8555 §6.5: a client retries with the
/// fresh nonce the refusal carries), up to three more times.
async fn again<T>(mut step: impl AsyncFnMut() -> Result<T, Error>) -> Result<T, Error> {
    let mut retries = 3;
    loop {
        match step().await {
            Err(Error::Api(p)) if retries > 0 && is_bad_nonce(&p) => retries -= 1,
            other => return other,
        }
    }
}

fn is_bad_nonce(p: &Problem) -> bool {
    p.r#type.as_deref() == Some("urn:ietf:params:acme:error:badNonce")
}

/// One line for an error of `step`, with the CA's problem document when there is one.
fn failure(step: &str, e: &Error) -> Failure {
    let mut f = Failure::new(match e {
        Error::Api(p) => format!("{step}: {}", problem_text(p)),
        Error::Timeout(_) => format!("{step}: the CA did not move the order on in time"),
        e => format!("{step}: {}", one_line(e)),
    });
    f.bad_nonce = matches!(e, Error::Api(p) if is_bad_nonce(p));
    f
}

/// A problem document (RFC 7807) as one line: its detail, its type, its subproblems.
fn problem_text(p: &Problem) -> String {
    let mut text = p.detail.clone().unwrap_or_else(|| "no detail".into());
    if let Some(t) = &p.r#type {
        text.push_str(&format!(" ({t})"));
    }
    for sp in &p.subproblems {
        text.push_str(&format!("; {sp}"));
    }
    text
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Http01 => "http-01",
        Kind::TlsAlpn01 => "tls-alpn-01",
    }
}

/// The challenge files of a running order: removed when the order no longer needs them
/// (validation is over) or ends any other way, including being dropped.
struct Published<'a> {
    store: &'a Store,
    tokens: Vec<String>,
    changed: &'a Notify,
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        if self.tokens.is_empty() {
            return;
        }
        for t in &self.tokens {
            self.store.remove_challenge(t);
        }
        self.changed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_read_as_one_line_with_their_type() {
        let p: Problem = serde_json::from_str(
            r#"{"type":"urn:ietf:params:acme:error:rejectedIdentifier","detail":"no","status":400,
                "subproblems":[{"type":"urn:ietf:params:acme:error:malformed","detail":"bad name",
                "identifier":{"type":"dns","value":"x.test"}}]}"#,
        )
        .unwrap();
        let text = problem_text(&p);
        assert!(
            text.starts_with("no (urn:ietf:params:acme:error:rejectedIdentifier)"),
            "{text}"
        );
        assert!(text.contains("bad name"), "{text}");
        let f = failure("new order", &Error::Api(p));
        assert!(f.text.starts_with("new order: no"), "{}", f.text);
    }

    #[test]
    fn an_error_that_prints_its_source_is_not_repeated() {
        let json = serde_json::from_str::<u8>("x").unwrap_err();
        let text = json.to_string();
        let line = one_line(&Error::Json(json));
        assert_eq!(line.matches(&text).count(), 1, "{line}");
        let other = Error::Other(Box::new(std::io::Error::other("deep")));
        assert_eq!(one_line(&other), "deep");
    }

    #[test]
    fn long_errors_are_cut_on_a_character() {
        let f = Failure::new("é".repeat(MAX_ERROR));
        assert!(f.text.len() <= MAX_ERROR + '…'.len_utf8());
        assert!(f.text.ends_with('…'));
    }

    #[tokio::test]
    async fn a_refused_nonce_is_retried_and_other_errors_are_not() {
        let bad_nonce = || {
            Error::Api(
                serde_json::from_str(r#"{"type":"urn:ietf:params:acme:error:badNonce"}"#).unwrap(),
            )
        };
        let mut calls = 0;
        let r = again(async || {
            calls += 1;
            if calls < 3 {
                Err(bad_nonce())
            } else {
                Ok(calls)
            }
        })
        .await;
        assert_eq!(r.unwrap(), 3);
        let mut calls = 0;
        let r: Result<(), _> = again(async || {
            calls += 1;
            Err(bad_nonce())
        })
        .await;
        assert!(r.is_err());
        assert_eq!(calls, 4);
        let mut calls = 0;
        let r: Result<(), _> = again(async || {
            calls += 1;
            Err(Error::Str("other"))
        })
        .await;
        assert!(r.is_err());
        assert_eq!(calls, 1);
    }
}
