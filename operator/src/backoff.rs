//! Per-object exponential requeue delays for failed reconciles.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// Consecutive failures per object, turned into a capped exponential delay. An object that keeps
/// failing backs off on its own without slowing down the others.
#[derive(Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    failures: Mutex<HashMap<String, u32>>,
}

impl Backoff {
    /// Delays `base`, `2*base`, `4*base`, … up to `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Records a failure of `key` and returns the delay before its next attempt.
    pub fn next_delay(&self, key: &str) -> Duration {
        let mut map = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(key.to_owned()).or_insert(0);
        *n = n.saturating_add(1);
        let factor = 2u32.saturating_pow(n.saturating_sub(1).min(20));
        self.base.saturating_mul(factor).min(self.max)
    }

    /// Forgets the failures of `key` after a success.
    pub fn reset(&self, key: &str) {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new(Duration::from_secs(5), Duration::from_secs(300))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_per_object_and_caps() {
        let b = Backoff::new(Duration::from_secs(1), Duration::from_secs(10));
        let d: Vec<_> = (0..6).map(|_| b.next_delay("a").as_secs()).collect();
        assert_eq!(d, vec![1, 2, 4, 8, 10, 10]);
        assert_eq!(b.next_delay("b").as_secs(), 1, "other objects unaffected");
        b.reset("a");
        assert_eq!(b.next_delay("a").as_secs(), 1);
        for _ in 0..100 {
            b.next_delay("c");
        }
        assert_eq!(b.next_delay("c").as_secs(), 10, "no overflow");
    }
}
