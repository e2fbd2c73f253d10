//! Full-jitter exponential backoff: the n-th retry waits a uniformly random time in
//! `[0, min(max, min * 2^n)]`, so that a fleet of workers does not reconnect in lockstep after a
//! server restart, while the first retries stay short (a restarted server is found again within
//! about a second).

use std::time::Duration;

use rand::Rng as _;

/// Backoff state.
#[derive(Clone, Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max: max.max(min),
            attempt: 0,
        }
    }

    /// The upper bound of the next delay.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(31)).unwrap_or(u32::MAX);
        self.min.saturating_mul(factor).min(self.max)
    }

    /// The next delay; each call raises the ceiling until it reaches `max`.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rand::rng().random_range(0..=nanos))
    }

    /// Starts over (after a connection that stayed up).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let mut ceilings = Vec::new();
        for _ in 0..8 {
            ceilings.push(b.ceiling().as_millis());
            let d = b.next_delay();
            assert!(d <= Duration::from_secs(2));
        }
        assert_eq!(ceilings, [100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        for _ in 0..100 {
            b.next_delay();
        }
        assert_eq!(b.ceiling(), Duration::from_secs(2));
        b.reset();
        assert_eq!(b.ceiling(), Duration::from_millis(100));
    }
}
