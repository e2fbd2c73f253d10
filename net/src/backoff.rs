//! Full-jitter exponential backoff.
//!
//! Every data-plane node reconnects when the control plane restarts; sleeping a uniformly random
//! time in `[0, min(max, min · 2^attempt)]` ("full jitter") spreads those reconnects out instead
//! of having them arrive in waves, while the first retry stays near-immediate (within `min`).

use std::time::Duration;

use rand::Rng;

/// Retry delays for one reconnect loop.
#[derive(Clone, Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    /// Delays start below `min` and are capped at `max` (`max` is raised to `min` if smaller).
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max: max.max(min),
            attempt: 0,
        }
    }

    /// Failures since the last [`reset`](Self::reset).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Forgets past failures: called once a connection proved good.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// The upper bound of the next delay: `min(max, min · 2^attempt)`.
    pub fn ceiling(&self) -> Duration {
        // 2^31 · min overflows nothing that matters: `checked_mul` saturates to `max`.
        let factor = 1u32.checked_shl(self.attempt.min(31)).unwrap_or(u32::MAX);
        self.min
            .checked_mul(factor)
            .map_or(self.max, |d| d.min(self.max))
    }

    /// The delay before the next retry, and one more failure counted.
    pub fn next_delay(&mut self) -> Duration {
        self.next_delay_with(&mut rand::rng())
    }

    /// [`next_delay`](Self::next_delay) with a given random source (for tests).
    pub fn next_delay_with(&mut self, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rng.random_range(0..=nanos))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn ceiling_doubles_up_to_the_cap() {
        let mut b = Backoff::new(100 * MS, 1000 * MS);
        let mut rng = StdRng::seed_from_u64(1);
        let mut ceilings = Vec::new();
        for _ in 0..6 {
            ceilings.push(b.ceiling());
            b.next_delay_with(&mut rng);
        }
        assert_eq!(
            ceilings,
            [100, 200, 400, 800, 1000, 1000].map(|ms| ms * MS).to_vec()
        );
        b.reset();
        assert_eq!(b.ceiling(), 100 * MS);
        assert_eq!(b.attempt(), 0);
    }

    #[test]
    fn survives_many_failures() {
        let mut b = Backoff::new(100 * MS, Duration::from_secs(10));
        for _ in 0..1000 {
            assert!(b.next_delay() <= Duration::from_secs(10));
        }
        assert_eq!(b.ceiling(), Duration::from_secs(10));
    }

    proptest! {
        #[test]
        fn delays_stay_within_bounds(
            min_ms in 1u64..1000,
            max_ms in 0u64..100_000,
            failures in 0usize..80,
            seed in any::<u64>(),
        ) {
            let (min, max) = (Duration::from_millis(min_ms), Duration::from_millis(max_ms));
            let mut b = Backoff::new(min, max);
            let mut rng = StdRng::seed_from_u64(seed);
            for _ in 0..failures {
                let ceiling = b.ceiling();
                let delay = b.next_delay_with(&mut rng);
                prop_assert!(delay <= ceiling);
                prop_assert!(ceiling <= max.max(min));
                prop_assert!(ceiling >= min.min(max.max(min)));
            }
        }
    }
}
