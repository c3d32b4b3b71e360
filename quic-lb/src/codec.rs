//! The QUIC-LB connection-ID codec (draft-ietf-quic-load-balancers-21 §3 and §5): first octet,
//! plaintext mode, single-pass AES-128-ECB and the four-pass Feistel network.
//!
//! This module owns the byte layout `first octet ‖ E(server ID ‖ nonce)` and nothing else: it
//! knows neither instances nor packets, never allocates and never calls the OS. The AES key
//! schedule is expanded once in [`CidCodec::new`]; encoding and decoding are pure functions of the
//! codec and their input.

use aes::cipher::{BlockDecrypt, BlockEncrypt, KeyInit};
use aes::Aes128;
use quinn_proto::ConnectionId;

use crate::config::{ConfigError, Mode, MAX_CONFIG_ID};
pub use crate::config::{MAX_CID_LEN, MAX_PLAINTEXT_LEN, MIN_NONCE_LEN, SINGLE_PASS_LEN};

/// Config rotation codepoint meaning "unroutable, fall back to 4-tuple routing" (draft-21 §3.1).
pub const UNROUTABLE_CONFIG_ID: u8 = 0b111;

/// Encoder and decoder for one QUIC-LB configuration: config rotation codepoint, server-ID
/// length, nonce length and optional AES-128 key.
///
/// ringmux's own configuration uses `server_id_len = node_id.len() + 1` (the instance byte); an
/// external load balancer's view of the same CIDs is `CidCodec::new(config_id, node_id.len(),
/// nonce_len + 1, key)`, which decodes to the node ID alone.
#[derive(Clone)]
pub struct CidCodec {
    first_octet: u8,
    server_id_len: u8,
    nonce_len: u8,
    cipher: Cipher,
}

/// The plaintext block of a decoded CID: server ID followed by nonce.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Plaintext {
    block: [u8; MAX_PLAINTEXT_LEN],
    len: u8,
    server_id_len: u8,
}

/// A decoded server ID (up to 18 octets), kept inline so decoding never allocates.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ServerId {
    bytes: [u8; MAX_PLAINTEXT_LEN],
    len: u8,
}

/// An [`CidCodec::encode`] argument whose length does not match the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{field} is {found} bytes, the configuration needs {expected}")]
pub struct EncodeError {
    /// `"server_id"` or `"nonce"`.
    pub field: &'static str,
    /// The configured length.
    pub expected: usize,
    /// The length passed in.
    pub found: usize,
}

#[derive(Clone)]
enum Cipher {
    Plaintext,
    SinglePass(Aes128),
    FourPass(Aes128),
}

impl CidCodec {
    /// Builds a codec; lengths follow draft-21 §5.2 (server ID ≥ 1, nonce ≥ 4, sum ≤ 19).
    pub fn new(
        config_id: u8,
        server_id_len: usize,
        nonce_len: usize,
        key: Option<[u8; 16]>,
    ) -> Result<Self, ConfigError> {
        if config_id > MAX_CONFIG_ID {
            return Err(ConfigError::ConfigId { value: config_id });
        }
        let max_sid = MAX_PLAINTEXT_LEN - MIN_NONCE_LEN;
        if server_id_len == 0 || server_id_len > max_sid {
            return Err(ConfigError::ServerIdLength {
                value: server_id_len,
                max: max_sid,
            });
        }
        let max_nonce = MAX_PLAINTEXT_LEN - server_id_len;
        if !(MIN_NONCE_LEN..=max_nonce).contains(&nonce_len) {
            return Err(ConfigError::NonceLength {
                value: u8::try_from(nonce_len).unwrap_or(u8::MAX),
                min: MIN_NONCE_LEN,
                max: max_nonce,
                node_id_len: server_id_len,
            });
        }
        let plaintext_len = server_id_len + nonce_len;
        let cipher = match key {
            None => Cipher::Plaintext,
            Some(k) if plaintext_len == SINGLE_PASS_LEN => {
                Cipher::SinglePass(Aes128::new(&k.into()))
            }
            Some(k) => Cipher::FourPass(Aes128::new(&k.into())),
        };
        // Length self-description: the 5 low bits carry the CID length minus the first octet
        // (draft-21 §3.2); always ≤ 19, so it fits.
        let first_octet = (config_id << 5) | plaintext_len as u8;
        Ok(Self {
            first_octet,
            server_id_len: server_id_len as u8,
            nonce_len: nonce_len as u8,
            cipher,
        })
    }

    /// Total CID length: first octet + server ID + nonce.
    pub fn cid_len(&self) -> usize {
        1 + self.plaintext_len()
    }

    /// The first octet of every CID this codec produces and accepts: config ID and length.
    pub fn first_octet(&self) -> u8 {
        self.first_octet
    }

    /// Server-ID length in octets.
    pub fn server_id_len(&self) -> usize {
        usize::from(self.server_id_len)
    }

    /// Nonce length in octets.
    pub fn nonce_len(&self) -> usize {
        usize::from(self.nonce_len)
    }

    /// The algorithm in use.
    pub fn mode(&self) -> Mode {
        match self.cipher {
            Cipher::Plaintext => Mode::Plaintext,
            Cipher::SinglePass(_) => Mode::SinglePass,
            Cipher::FourPass(_) => Mode::FourPass,
        }
    }

    /// Builds `first octet ‖ E(server_id ‖ nonce)`.
    pub fn encode(&self, server_id: &[u8], nonce: &[u8]) -> Result<ConnectionId, EncodeError> {
        if server_id.len() != self.server_id_len() {
            return Err(EncodeError {
                field: "server_id",
                expected: self.server_id_len(),
                found: server_id.len(),
            });
        }
        if nonce.len() != self.nonce_len() {
            return Err(EncodeError {
                field: "nonce",
                expected: self.nonce_len(),
                found: nonce.len(),
            });
        }
        let n = self.plaintext_len();
        let mut cid = [0u8; MAX_CID_LEN];
        cid[0] = self.first_octet;
        cid[1..1 + server_id.len()].copy_from_slice(server_id);
        cid[1 + server_id.len()..1 + n].copy_from_slice(nonce);
        let block = &mut cid[1..1 + n];
        match &self.cipher {
            Cipher::Plaintext => {}
            Cipher::SinglePass(aes) => aes.encrypt_block(block.into()),
            Cipher::FourPass(aes) => Feistel::new(aes, n).encrypt(block),
        }
        Ok(ConnectionId::new(&cid[..1 + n]))
    }

    /// Decodes the whole plaintext block, or `None` if `cid` does not have this configuration's
    /// length and first octet (other config ID, `0b111`, other length, client-chosen CID).
    pub fn decode(&self, cid: &[u8]) -> Option<Plaintext> {
        let ciphertext = self.ciphertext(cid)?;
        let n = ciphertext.len();
        let mut block = [0u8; MAX_PLAINTEXT_LEN];
        block[..n].copy_from_slice(ciphertext);
        match &self.cipher {
            Cipher::Plaintext => {}
            Cipher::SinglePass(aes) => aes.decrypt_block((&mut block[..n]).into()),
            Cipher::FourPass(aes) => Feistel::new(aes, n).decrypt(&mut block[..n], n),
        }
        Some(Plaintext {
            block,
            len: n as u8,
            server_id_len: self.server_id_len,
        })
    }

    /// Decodes only the server ID: what a load balancer does per packet. Four-pass decoding
    /// stops after three AES passes when the nonce is at least as long as the server ID
    /// (draft-21 §5.5.2). `None` as for [`CidCodec::decode`].
    #[inline]
    pub fn decode_server_id(&self, cid: &[u8]) -> Option<ServerId> {
        let ciphertext = self.ciphertext(cid)?;
        let n = ciphertext.len();
        let sid_len = self.server_id_len();
        let mut block = [0u8; MAX_PLAINTEXT_LEN];
        block[..n].copy_from_slice(ciphertext);
        match &self.cipher {
            Cipher::Plaintext => {}
            Cipher::SinglePass(aes) => aes.decrypt_block((&mut block[..n]).into()),
            Cipher::FourPass(aes) => Feistel::new(aes, n).decrypt(&mut block[..n], sid_len),
        }
        let mut bytes = [0u8; MAX_PLAINTEXT_LEN];
        bytes[..sid_len].copy_from_slice(&block[..sid_len]);
        Some(ServerId {
            bytes,
            len: self.server_id_len,
        })
    }

    fn plaintext_len(&self) -> usize {
        usize::from(self.server_id_len) + usize::from(self.nonce_len)
    }

    /// The encrypted block of `cid` if its length and first octet are ours.
    #[inline]
    fn ciphertext<'a>(&self, cid: &'a [u8]) -> Option<&'a [u8]> {
        match cid.split_first() {
            Some((&first, rest))
                if first == self.first_octet && rest.len() == self.plaintext_len() =>
            {
                Some(rest)
            }
            _ => None,
        }
    }
}

impl std::fmt::Debug for CidCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CidCodec")
            .field("first_octet", &format_args!("{:#04x}", self.first_octet))
            .field("server_id_len", &self.server_id_len)
            .field("nonce_len", &self.nonce_len)
            .field("mode", &self.mode())
            .finish()
    }
}

impl Plaintext {
    /// The server ID part.
    pub fn server_id(&self) -> &[u8] {
        &self.block[..usize::from(self.server_id_len)]
    }

    /// The nonce part.
    pub fn nonce(&self) -> &[u8] {
        &self.block[usize::from(self.server_id_len)..usize::from(self.len)]
    }

    /// Server ID followed by nonce.
    pub fn as_bytes(&self) -> &[u8] {
        &self.block[..usize::from(self.len)]
    }
}

impl std::fmt::Debug for Plaintext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Plaintext({} ‖ {})",
            hex::encode(self.server_id()),
            hex::encode(self.nonce())
        )
    }
}

impl std::ops::Deref for ServerId {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl std::fmt::Debug for ServerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ServerId({})", hex::encode(&**self))
    }
}

/// Applies a pseudo-random permutation keyed by `aes` to `bytes` (1..=19 octets) in place:
/// one AES block when `bytes` is 16 octets, the draft's four-pass Feistel network otherwise.
/// The generator uses it to turn a nonce counter into unlinkable plaintext-mode nonces.
pub(crate) fn permute(aes: &Aes128, bytes: &mut [u8]) {
    let n = bytes.len();
    if n == SINGLE_PASS_LEN {
        aes.encrypt_block(bytes.into());
    } else if (1..=MAX_PLAINTEXT_LEN).contains(&n) {
        Feistel::new(aes, n).encrypt(bytes);
    }
}

/// Half of the Feistel state: at most `ceil(19 / 2) = 10` octets used, zero beyond `half`.
type Half = [u8; 16];

/// The four-pass algorithm of draft-21 §5.4.2 for a plaintext of `len` octets (odd lengths split
/// the middle octet by nibbles: the left half keeps its high nibble, the right half its low one).
struct Feistel<'a> {
    aes: &'a Aes128,
    len: usize,
    half: usize,
    odd: bool,
}

impl<'a> Feistel<'a> {
    fn new(aes: &'a Aes128, len: usize) -> Self {
        debug_assert!((1..=MAX_PLAINTEXT_LEN).contains(&len));
        Self {
            aes,
            len,
            half: len.div_ceil(2),
            odd: len % 2 == 1,
        }
    }

    fn encrypt(&self, block: &mut [u8]) {
        let (mut left, mut right) = self.split(block);
        self.pass(1, &left, &mut right);
        self.clear_right(&mut right);
        self.pass(2, &right, &mut left);
        self.clear_left(&mut left);
        self.pass(3, &left, &mut right);
        self.clear_right(&mut right);
        self.pass(4, &right, &mut left);
        self.clear_left(&mut left);
        self.join(&left, &right, block);
    }

    /// Decrypts until the first `needed` octets are plaintext: three passes suffice when they
    /// lie inside left_0 (draft-21 §5.5.2), four otherwise. Octets past `needed` are undefined.
    fn decrypt(&self, block: &mut [u8], needed: usize) {
        let (mut left, mut right) = self.split(block);
        self.pass(4, &right, &mut left);
        self.clear_left(&mut left);
        self.pass(3, &left, &mut right);
        self.clear_right(&mut right);
        self.pass(2, &right, &mut left);
        self.clear_left(&mut left);
        // left_0 holds `len / 2` whole octets (the middle octet's low nibble is in right_0).
        if needed > self.len / 2 {
            self.pass(1, &left, &mut right);
            self.clear_right(&mut right);
        }
        self.join(&left, &right, block);
    }

    /// `target ^= truncate(AES(expand(len, pass, input)), half)`.
    #[inline]
    fn pass(&self, pass: u8, input: &Half, target: &mut Half) {
        let mut block = self.expand(pass, input);
        self.aes.encrypt_block((&mut block).into());
        for (t, m) in target[..self.half].iter_mut().zip(&block[..self.half]) {
            *t ^= m;
        }
    }

    /// expand(len, pass, input) = input ‖ zero pad ‖ len(8) ‖ pass(8), 16 octets.
    #[inline]
    fn expand(&self, pass: u8, input: &Half) -> [u8; 16] {
        let mut block = [0u8; 16];
        block[..self.half].copy_from_slice(&input[..self.half]);
        block[14] = self.len as u8;
        block[15] = pass;
        block
    }

    fn clear_left(&self, left: &mut Half) {
        if self.odd {
            left[self.half - 1] &= 0xf0;
        }
    }

    fn clear_right(&self, right: &mut Half) {
        if self.odd {
            right[0] &= 0x0f;
        }
    }

    fn split(&self, block: &[u8]) -> (Half, Half) {
        let mut left = [0u8; 16];
        let mut right = [0u8; 16];
        left[..self.half].copy_from_slice(&block[..self.half]);
        right[..self.half].copy_from_slice(&block[self.len - self.half..self.len]);
        self.clear_left(&mut left);
        self.clear_right(&mut right);
        (left, right)
    }

    fn join(&self, left: &Half, right: &Half, block: &mut [u8]) {
        block[..self.half].copy_from_slice(&left[..self.half]);
        if self.odd {
            block[self.half - 1] |= right[0];
            block[self.half..self.len].copy_from_slice(&right[1..self.half]);
        } else {
            block[self.half..self.len].copy_from_slice(&right[..self.half]);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The draft's own test vectors (draft-21 Appendix B and the §5.4.2 worked example).
    use super::*;

    const KEY: &str = "8f95f09245765f80256934e50c66207f";

    fn h(s: &str) -> Vec<u8> {
        hex::decode(s).unwrap()
    }

    fn key(s: &str) -> [u8; 16] {
        h(s).try_into().unwrap()
    }

    /// Encodes, compares with the vector, and decodes back both ways.
    fn check(config_id: u8, sid: &str, nonce: &str, key: Option<[u8; 16]>, cid: &str, mode: Mode) {
        let (sid, nonce, want) = (h(sid), h(nonce), h(cid));
        let codec = CidCodec::new(config_id, sid.len(), nonce.len(), key).unwrap();
        assert_eq!(codec.mode(), mode);
        assert_eq!(codec.cid_len(), want.len());
        let got = codec.encode(&sid, &nonce).unwrap();
        assert_eq!(hex::encode(&got[..]), hex::encode(&want), "encode");
        let pt = codec.decode(&want).unwrap();
        assert_eq!(pt.server_id(), &sid[..], "decode server id");
        assert_eq!(pt.nonce(), &nonce[..], "decode nonce");
        assert_eq!(&*codec.decode_server_id(&want).unwrap(), &sid[..]);
    }

    #[test]
    fn draft_unencrypted_vector() {
        check(
            0,
            "c4605e",
            "4504cc4f",
            None,
            "07c4605e4504cc4f",
            Mode::Plaintext,
        );
    }

    /// The draft prints this row as `1 350d28b420 3487d970b 20a350d28b4203487d970b`: the nonce
    /// has 9 hex digits and the CID 11 octets for a 10-octet block, so a digit is misplaced.
    /// With config 1 and 10 following octets the first octet must be `0x2a`; plaintext mode
    /// leaves the rest as `sid ‖ nonce`. We check that reading with nonce `3487d9700b`.
    #[test]
    fn draft_unencrypted_vector_2_corrected() {
        check(
            1,
            "350d28b420",
            "3487d9700b",
            None,
            "2a350d28b4203487d9700b",
            Mode::Plaintext,
        );
    }

    /// sid 3 + nonce 4 = 7 octets: four-pass with an odd length (nibble split).
    #[test]
    fn draft_encrypted_vector_four_pass_odd() {
        check(
            0,
            "ed793a",
            "ee080dbf",
            Some(key(KEY)),
            "0720b1d07b359d3c",
            Mode::FourPass,
        );
    }

    /// sid 10 > nonce 5: the load balancer needs the fourth decryption pass.
    #[test]
    fn draft_encrypted_vector_four_pass_long_server_id() {
        check(
            1,
            "ed793a51d49b8f5fab65",
            "ee080dbf48",
            Some(key(KEY)),
            "2fcc381bc74cb4fbad2823a3d1f8fed2",
            Mode::FourPass,
        );
    }

    /// sid 8 + nonce 8 = 16: the single-pass special case.
    #[test]
    fn draft_encrypted_vector_single_pass() {
        check(
            2,
            "ed793a51d49b8f5f",
            "ee080dbf48c0d1e5",
            Some(key(KEY)),
            "504dd2d05a7b0de9b2b9907afb5ecf8cc3",
            Mode::SinglePass,
        );
    }

    /// sid 9 + nonce 9 = 18, even four-pass. The draft labels this row cr_bits 3 but prints
    /// first octet 0x12 (config 0, length 18); the first octet is not encrypted, so both
    /// readings share the remaining 18 octets. We check config 0 as printed, and config 3 with
    /// first octet 0x72.
    #[test]
    fn draft_encrypted_vector_four_pass_even() {
        let tail = "5779c9cc86beb3a3a4a3ca96fce4bfe0cdbc";
        for (config_id, first) in [(0, "12"), (3, "72")] {
            check(
                config_id,
                "ed793a51d49b8f5fab",
                "ee080dbf48c0d1e55d",
                Some(key(KEY)),
                &format!("{first}{tail}"),
                Mode::FourPass,
            );
        }
    }

    /// The worked example of draft-21 §5.4.2 "Encryption Example". Its intermediate lines have
    /// typos (step 10 XORs `b3e4357c` although AES printed `b334357c`), but the final CID is
    /// consistent with the algorithm; we check the final value and the first intermediate steps.
    #[test]
    fn draft_worked_example() {
        let k = key("fdf726a9893ec05c0632d3956680baf0");
        check(
            0,
            "31441a",
            "9c69c275",
            Some(k),
            "0767947d29be054a",
            Mode::FourPass,
        );
        let aes = Aes128::new(&k.into());
        let f = Feistel::new(&aes, 7);
        let (left, mut right) = f.split(&h("31441a9c69c275"));
        assert_eq!(hex::encode(&left[..4]), "31441a90");
        assert_eq!(hex::encode(&right[..4]), "0c69c275");
        f.pass(1, &left, &mut right);
        assert_eq!(hex::encode(&right[..4]), "ae3c1ff9");
        f.clear_right(&mut right);
        assert_eq!(hex::encode(&right[..4]), "0e3c1ff9");
    }

    #[test]
    fn expand_matches_the_draft_example() {
        // draft-21: expand(0x06, 0x02, 0xaaba3c) = 0xaaba3c00000000000000000000000602
        let aes = Aes128::new(&[0u8; 16].into());
        let mut input = [0u8; 16];
        input[..3].copy_from_slice(&h("aaba3c"));
        let block = Feistel::new(&aes, 6).expand(2, &input);
        assert_eq!(hex::encode(block), "aaba3c00000000000000000000000602");
    }

    #[test]
    fn wrong_first_octet_or_length_does_not_decode() {
        let codec = CidCodec::new(0, 3, 4, Some(key(KEY))).unwrap();
        assert!(codec.decode(&h("2720b1d07b359d3c")).is_none(), "config 1");
        assert!(codec.decode(&h("e720b1d07b359d3c")).is_none(), "0b111");
        assert!(
            codec.decode(&h("0620b1d07b359d3c")).is_none(),
            "length bits"
        );
        assert!(codec.decode(&h("0720b1d07b359d")).is_none(), "short");
        assert!(codec.decode(&h("0720b1d07b359d3c00")).is_none(), "long");
        assert!(codec.decode(&[]).is_none(), "empty");
    }

    #[test]
    fn encode_rejects_wrong_lengths() {
        let codec = CidCodec::new(0, 3, 4, None).unwrap();
        let e = codec.encode(&[1, 2], &[0; 4]).unwrap_err();
        assert_eq!((e.field, e.expected, e.found), ("server_id", 3, 2));
        let e = codec.encode(&[1, 2, 3], &[0; 5]).unwrap_err();
        assert_eq!((e.field, e.expected, e.found), ("nonce", 4, 5));
    }

    #[test]
    fn codec_limits() {
        assert!(CidCodec::new(7, 3, 4, None).is_err());
        assert!(CidCodec::new(0, 0, 4, None).is_err());
        assert!(CidCodec::new(0, 16, 4, None).is_err());
        assert!(CidCodec::new(0, 3, 3, None).is_err());
        assert!(CidCodec::new(0, 3, 17, None).is_err());
        assert_eq!(CidCodec::new(6, 15, 4, None).unwrap().cid_len(), 20);
        assert_eq!(CidCodec::new(6, 15, 4, None).unwrap().first_octet(), 0xd3);
    }

    #[test]
    fn permute_is_a_bijection_on_small_sample() {
        let aes = Aes128::new(&[3u8; 16].into());
        for n in [4usize, 5, 9, 16, 17] {
            let mut seen = std::collections::HashSet::new();
            for i in 0u32..2000 {
                let mut b = [0u8; 19];
                b[n - 4..n].copy_from_slice(&i.to_be_bytes());
                permute(&aes, &mut b[..n]);
                assert!(seen.insert(b[..n].to_vec()), "collision at n={n} i={i}");
            }
        }
    }
}
