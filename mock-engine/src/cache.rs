//! The KV cache of the performance model: a bounded set of block hashes, evicted least recently
//! used first, whose blocks in use by a running request are pinned (never evicted).

use std::collections::{BTreeMap, HashMap};

/// Block hashes with pins and LRU eviction.
#[derive(Debug)]
pub(crate) struct BlockCache {
    capacity: usize,
    entries: HashMap<u64, Entry>,
    /// The unpinned entries by the tick of their release: the first is evicted first.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    /// Entries with at least one pin.
    pinned: usize,
    /// Bumped by [`BlockCache::clear`]: pins taken before it are void.
    epoch: u64,
}

#[derive(Debug)]
struct Entry {
    pins: u32,
    /// The entry's key in `lru` while unpinned.
    tick: u64,
}

impl BlockCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            pinned: 0,
            epoch: 0,
        }
    }

    /// Blocks cached.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Blocks pinned by running requests.
    pub(crate) fn pinned(&self) -> usize {
        self.pinned
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How many of the leading `hashes` are cached.
    pub(crate) fn leading_hits(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.entries.contains_key(h))
            .count()
    }

    /// Pins a cached block, or caches and pins it (evicting the least recently used unpinned
    /// block when full). False when it is not cached and every cached block is pinned.
    pub(crate) fn acquire(&mut self, hash: u64) -> bool {
        if let Some(entry) = self.entries.get_mut(&hash) {
            if entry.pins == 0 {
                self.lru.remove(&entry.tick);
                self.pinned += 1;
            }
            entry.pins += 1;
            return true;
        }
        if self.entries.len() >= self.capacity {
            let Some((_, evicted)) = self.lru.pop_first() else {
                return false;
            };
            self.entries.remove(&evicted);
        }
        self.entries.insert(hash, Entry { pins: 1, tick: 0 });
        self.pinned += 1;
        true
    }

    /// Drops one pin; a block without pins becomes the most recently used.
    pub(crate) fn release(&mut self, hash: u64) {
        let Some(entry) = self.entries.get_mut(&hash) else {
            return;
        };
        entry.pins = entry.pins.saturating_sub(1);
        if entry.pins == 0 {
            self.tick += 1;
            entry.tick = self.tick;
            self.lru.insert(self.tick, hash);
            self.pinned -= 1;
        }
    }

    /// Forgets every block (an engine restart); pins taken before are void.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.lru.clear();
        self.pinned = 0;
        self.epoch += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_recently_released_unpinned_block() {
        let mut c = BlockCache::new(2);
        assert!(c.acquire(1));
        assert!(c.acquire(2));
        // Full and all pinned: nothing can be cached.
        assert!(!c.acquire(3));
        c.release(2);
        c.release(1);
        assert_eq!(c.pinned(), 0);
        // 2 was released first: it goes first.
        assert!(c.acquire(3));
        assert_eq!(c.leading_hits(&[1, 3, 2]), 2);
        // A hit pins: 1 is not evicted while pinned.
        assert!(c.acquire(1));
        c.release(3);
        assert!(c.acquire(4));
        assert_eq!(c.leading_hits(&[1, 4]), 2);
        assert_eq!(c.len(), 2);
        c.clear();
        assert_eq!((c.len(), c.pinned(), c.epoch()), (0, 0, 1));
        // A stale release after the clear is harmless.
        c.release(1);
        assert_eq!(c.pinned(), 0);
    }
}
