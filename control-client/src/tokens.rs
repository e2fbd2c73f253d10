//! API keys, worker tokens and registration tokens: generation, parsing and verification.
//!
//! A key reads `<prefix>_<access-id>_<secret>` with a 16-hex-digit access id and a 32-hex-digit
//! secret, as GPUStack's keys do. Only the SHA-256 digest of the secret is stored; the access id
//! finds the row, and the digest is compared in constant time.

use rand::Rng;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Prefix of API keys.
pub const API_KEY_PREFIX: &str = "fdn";
/// Prefix of worker tokens.
pub const WORKER_TOKEN_PREFIX: &str = "fdnw";
/// Prefix of cluster registration tokens: GPUStack's own shape. GPUStack 2.2 workers take a
/// token with any other prefix for a legacy one and wrap it with the host's DMI uuid, and die on
/// a host without one before their first request.
pub const REGISTRATION_TOKEN_PREFIX: &str = "gpustack";
/// Prefix of the registration tokens issued before: still accepted.
pub const LEGACY_REGISTRATION_TOKEN_PREFIX: &str = "fdnr";
/// Prefix of a cluster's worker proxy credential ([`worker_proxy_credential`]).
pub const WORKER_PROXY_CREDENTIAL_PREFIX: &str = "fdnp";

const ACCESS_ID_LEN: usize = 16;
const SECRET_LEN: usize = 32;

/// A freshly generated key: the whole key is shown once, only `access_id` and `digest` are kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewKey {
    /// The whole key, to hand to its owner once.
    pub value: String,
    /// The public part, used to look the key up.
    pub access_id: String,
    /// SHA-256 of the secret part.
    pub digest: [u8; 32],
}

/// Generates a key with the given prefix.
pub fn generate(prefix: &str) -> NewKey {
    let mut rng = rand::rng();
    let access: [u8; ACCESS_ID_LEN / 2] = rng.random();
    let secret: [u8; SECRET_LEN / 2] = rng.random();
    let access_id = hex::encode(access);
    let secret = hex::encode(secret);
    NewKey {
        value: format!("{prefix}_{access_id}_{secret}"),
        digest: digest(&secret),
        access_id,
    }
}

/// The parts of a presented key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyParts<'a> {
    pub prefix: &'a str,
    pub access_id: &'a str,
    pub secret: &'a str,
}

/// Splits a presented key; `None` when it does not have the key shape.
///
/// The access id and the secret have fixed lengths and no `_`, so both separators sit at fixed
/// distances from the end: the key is checked there instead of searched for `_` (this runs on
/// every request).
pub fn parse(key: &str) -> Option<KeyParts<'_>> {
    const TAIL: usize = 1 + ACCESS_ID_LEN + 1 + SECRET_LEN;
    let bytes = key.as_bytes();
    let prefix_len = bytes.len().checked_sub(TAIL).filter(|&n| n > 0)?;
    let tail = bytes.get(prefix_len..)?;
    let (access_id, secret) = tail[1..].split_at(ACCESS_ID_LEN);
    let secret = secret.strip_prefix(b"_")?;
    if tail[0] != b'_' || !all_hex(access_id) || !all_hex(secret) {
        return None;
    }
    // ASCII at both cuts (`_` and hex digits), so every part is valid UTF-8 on its own.
    Some(KeyParts {
        prefix: key.get(..prefix_len)?,
        access_id: key.get(prefix_len + 1..prefix_len + 1 + ACCESS_ID_LEN)?,
        secret: key.get(bytes.len() - SECRET_LEN..)?,
    })
}

/// Whether every byte is a hex digit: checked without an early exit, so that the check is
/// vectorised (a valid key's parts are all hex; only a bad key stops early with `all`).
fn all_hex(bytes: &[u8]) -> bool {
    bytes.iter().fold(true, |ok, b| ok & b.is_ascii_hexdigit())
}

/// SHA-256 of a secret.
pub fn digest(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// Whether `secret` hashes to `expected`, compared in constant time.
pub fn verify(secret: &str, expected: &[u8; 32]) -> bool {
    digest(secret).ct_eq(expected).into()
}

/// The credential that opens the worker proxies of a cluster, and nothing else: derived one way
/// from the cluster's registration token, so that every worker of the cluster (which holds that
/// token) knows it without being told, while gateways, which read it with a data-plane key,
/// cannot register workers with it.
pub fn worker_proxy_credential(registration_token: &str) -> String {
    let mut hash = Sha256::new();
    hash.update(b"faden worker proxy credential v1\n");
    hash.update(registration_token.as_bytes());
    let digest = hash.finalize();
    format!(
        "{WORKER_PROXY_CREDENTIAL_PREFIX}_{}_{}",
        hex::encode(&digest[..ACCESS_ID_LEN / 2]),
        hex::encode(&digest[ACCESS_ID_LEN / 2..ACCESS_ID_LEN / 2 + SECRET_LEN / 2])
    )
}

/// Compares two byte strings in constant time (for tokens stored in the clear).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

/// Parses a lower- or upper-case hex digest.
pub fn digest_from_hex(text: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(text, &mut out).ok()?;
    Some(out)
}

pub use net::headers::bearer;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_parse_and_verify() {
        let key = generate(API_KEY_PREFIX);
        let parts = parse(&key.value).expect("shape");
        assert_eq!(parts.prefix, API_KEY_PREFIX);
        assert_eq!(parts.access_id, key.access_id);
        assert!(verify(parts.secret, &key.digest));
        assert!(!verify("0".repeat(32).as_str(), &key.digest));
    }

    #[test]
    fn rejects_malformed_keys() {
        for bad in [
            "",
            "fdn",
            "fdn__",
            "fdn_zz_zz",
            "fdn_0123456789abcdef_short",
            "_0123456789abcdef_0123456789abcdef0123456789abcdef",
        ] {
            assert!(parse(bad).is_none(), "{bad}");
        }
        assert!(parse("gpustack_83c0063392972e20_e70ca22cda60176779e3e0b40b96eaae").is_some());
        // The prefix is whatever comes before the last two parts, `_` and non-ASCII included.
        let parts = parse("a_é_83c0063392972e20_e70ca22cda60176779e3e0b40b96eaae").expect("shape");
        assert_eq!(
            (parts.prefix, parts.access_id, parts.secret),
            (
                "a_é",
                "83c0063392972e20",
                "e70ca22cda60176779e3e0b40b96eaae"
            )
        );
    }

    /// The reading `parse` had before it checked fixed positions: split at the last two `_`.
    fn parse_by_splitting(key: &str) -> Option<KeyParts<'_>> {
        let (rest, secret) = key.rsplit_once('_')?;
        let (prefix, access_id) = rest.rsplit_once('_')?;
        let hex_of = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        (!prefix.is_empty() && hex_of(access_id, ACCESS_ID_LEN) && hex_of(secret, SECRET_LEN))
            .then_some(KeyParts {
                prefix,
                access_id,
                secret,
            })
    }

    proptest::proptest! {
        /// Keys near the shape (prefixes with `_` and non-ASCII, hex and non-hex, separators
        /// moved by one) and arbitrary strings split as the last two `_` would split them.
        #[test]
        fn parse_matches_splitting_at_the_last_two_underscores(
            prefix in "[a-z_é]{0,6}",
            id in "[0-9a-fA-F]{16}|[0-9a-f_g]{15,17}",
            sep in "[_x]",
            secret in "[0-9a-fA-F]{32}|[0-9a-f_z]{31,33}",
            any in "\\PC{0,60}",
        ) {
            let key = format!("{prefix}_{id}{sep}{secret}");
            proptest::prop_assert_eq!(parse(&key), parse_by_splitting(&key));
            proptest::prop_assert_eq!(parse(&any), parse_by_splitting(&any));
        }
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer  abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer "), None);
    }
}
