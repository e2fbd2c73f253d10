//! The hasher of the gateway's internal maps (balancer states, metric series, idle pools).
//!
//! Their keys never come from clients (instance ids, model labels and upstream addresses from
//! routing snapshots), and SipHash, std's default, showed up in the per-request profile
//! (twice per `DashMap` lookup: the shard, then the entry). foldhash, seeded per map, is the
//! one the routing snapshot uses too (`control_client::routing::SnapshotHasher`).

/// `BuildHasher` of the gateway's maps.
pub type FastBuild = foldhash::fast::RandomState;

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn spreads_small_keys() {
        let b = FastBuild::default();
        let hashes: HashSet<u64> = (0i64..10_000).map(|i| b.hash_one(i)).collect();
        assert_eq!(hashes.len(), 10_000);
        assert_ne!(b.hash_one("llama"), b.hash_one("llamb"));
    }
}
