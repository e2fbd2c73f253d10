//! What this gateway routed to one instance, as an approximation of that engine's prefix
//! cache: the block hashes of the prompts sent there ([`crate::prompt`]), bounded like the
//! engine's cache and evicted the way it evicts, least recently used first.
//!
//! A prompt's blocks are put in from its last to its first, so that a prefix is always more
//! recent than what follows it: eviction then takes tails before heads, and what the index holds
//! of one chain of blocks is a prefix of it. That is what lets [`PrefixIndex::matched`] find the
//! longest cached prefix by bisection instead of one lookup per block.

use std::num::NonZeroUsize;

use lru::LruCache;

/// Blocks an index holds when the engine does not say how large its cache is: 16,384 blocks of
/// 64 tokens, a million tokens (an 80 GB GPU serving an 8B model holds a few hundred thousand).
pub const DEFAULT_BLOCKS: usize = 16_384;

/// One instance's index.
#[derive(Debug)]
pub struct PrefixIndex {
    blocks: LruCache<u64, ()>,
    /// The engine's epoch the index belongs to ([`control_client::engine_load::EngineLoad`]):
    /// another epoch means the engine lost its cache, and so does the index.
    epoch: u64,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new(DEFAULT_BLOCKS)
    }
}

impl PrefixIndex {
    pub fn new(capacity: usize) -> Self {
        Self {
            blocks: LruCache::new(NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN)),
            epoch: 0,
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// How many leading blocks of `chain` the index holds (without making them more recent).
    pub fn matched(&self, chain: &[u64]) -> usize {
        // The largest n with chain[n - 1] held: held blocks form a prefix of the chain.
        let (mut lo, mut hi) = (0, chain.len());
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.blocks.contains(&chain[mid - 1]) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// Records that `chain` was sent to the instance.
    pub fn insert(&mut self, chain: &[u64]) {
        for block in chain.iter().rev() {
            self.blocks.put(*block, ());
        }
    }

    /// Follows the engine: a new epoch (its cache was lost) empties the index, and the engine's
    /// cache size (in index blocks) bounds it.
    pub fn follow(&mut self, epoch: u64, capacity: Option<usize>) {
        if epoch != self.epoch {
            self.blocks.clear();
            self.epoch = epoch;
        }
        if let Some(capacity) = capacity.and_then(NonZeroUsize::new)
            && capacity != self.blocks.cap()
        {
            self.blocks.resize(capacity);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_longest_held_prefix() {
        let mut index = PrefixIndex::new(100);
        let chain: Vec<u64> = (1..=10).collect();
        assert_eq!(index.matched(&chain), 0);
        index.insert(&chain[..6]);
        assert_eq!(index.matched(&chain), 6);
        assert_eq!(index.matched(&chain[..3]), 3);
        let other: Vec<u64> = vec![1, 2, 99, 100];
        assert_eq!(index.matched(&other), 2);
        assert_eq!(index.matched(&[]), 0);
    }

    #[test]
    fn evicts_tails_before_heads() {
        let mut index = PrefixIndex::new(5);
        let a: Vec<u64> = (1..=4).collect();
        index.insert(&a);
        // A second chain sharing the first two blocks: two new blocks push out a's tail.
        index.insert(&[1, 2, 50, 51]);
        assert_eq!(index.len(), 5);
        assert_eq!(index.matched(&a), 3, "a's tail went first, its head stays");
        assert_eq!(index.matched(&[1, 2, 50, 51]), 4);
    }

    #[test]
    fn a_new_epoch_forgets_and_the_engine_sizes_it() {
        let mut index = PrefixIndex::new(10);
        index.insert(&[1, 2, 3]);
        index.follow(0, None);
        assert_eq!(index.len(), 3);
        index.follow(0, Some(2));
        assert_eq!(index.len(), 2);
        index.follow(7, None);
        assert!(index.is_empty());
    }
}
