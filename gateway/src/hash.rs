//! A fast, non-cryptographic hasher for the gateway's internal maps.
//!
//! The keys of these maps never come from clients (instance ids and model labels from routing
//! snapshots), so flooding them is not a concern, and SipHash (std's default, about 20 ns per
//! short key, twice per DashMap lookup) showed up in the per-request profile. This is the
//! multiply-rotate "Fx" hash of rustc.

use std::hash::{BuildHasherDefault, Hasher};

/// `BuildHasher` of [`FxHasher`].
pub(crate) type FxBuild = BuildHasherDefault<FxHasher>;

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

/// The Fx hasher: `hash = (hash.rotl(5) ^ word) * SEED` per word.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FxHasher {
    hash: u64,
}

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn spreads_small_keys() {
        let b = FxBuild::default();
        let hashes: HashSet<u64> = (0i64..10_000).map(|i| b.hash_one(i)).collect();
        assert_eq!(hashes.len(), 10_000);
        assert_ne!(b.hash_one("llama"), b.hash_one("llamb"));
    }
}
