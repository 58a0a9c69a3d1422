//! Exponential back-off: a sequence of delays doubling from a first one to a cap, for retrying one
//! thing ([`Backoff`]), many things each on its own ([`KeyedBackoff`]), or accepting connections
//! when the process is out of descriptors ([`AcceptBackoff`]).

use std::collections::HashMap;
use std::io;
use std::sync::Mutex;
use std::time::Duration;

use crate::throttle::Throttle;

/// `first`, `2·first`, `4·first`, … up to `cap`.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    next: Duration,
    cap: Duration,
}

impl Backoff {
    pub fn new(first: Duration, cap: Duration) -> Self {
        Backoff {
            first,
            next: first,
            cap: cap.max(first),
        }
    }

    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let now = self.next;
        self.next = self.next.saturating_mul(2).min(self.cap);
        now
    }

    /// After a success: start over.
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

/// A [`Backoff`] per key (an object that keeps failing backs off on its own without slowing the
/// others).
#[derive(Debug)]
pub struct KeyedBackoff {
    template: Backoff,
    keys: Mutex<HashMap<String, Backoff>>,
}

impl KeyedBackoff {
    pub fn new(first: Duration, cap: Duration) -> Self {
        KeyedBackoff {
            template: Backoff::new(first, cap),
            keys: Mutex::default(),
        }
    }

    /// Records a failure of `key` and returns the delay before its next attempt.
    pub fn next_delay(&self, key: &str) -> Duration {
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.to_owned())
            .or_insert_with(|| self.template.clone())
            .next_delay()
    }

    /// Forgets the failures of `key` after a success.
    pub fn reset(&self, key: &str) {
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }
}

/// Accept errors that mean "out of a resource" (fds, buffers, memory): the listener stays
/// readable, so retrying at once would spin.
pub fn is_exhaustion(e: &io::Error) -> bool {
    use rustix::io::Errno;
    Errno::from_io_error(e)
        .is_some_and(|n| [Errno::MFILE, Errno::NFILE, Errno::NOBUFS, Errno::NOMEM].contains(&n))
}

/// How an accept loop waits after a failed accept (10 ms doubling to 1 s when out of
/// resources, at once otherwise) and logs it (once per interval, with the count held back).
#[derive(Debug)]
pub struct AcceptBackoff {
    what: &'static str,
    delay: Backoff,
    log: Throttle,
}

impl AcceptBackoff {
    pub fn new(what: &'static str) -> Self {
        AcceptBackoff {
            what,
            delay: Backoff::new(Duration::from_millis(10), Duration::from_secs(1)),
            log: Throttle::new(Duration::from_secs(1)),
        }
    }

    /// After a failed accept: how long to wait before the next one (`ZERO`: retry now).
    pub fn failed(&mut self, e: &io::Error) -> Duration {
        let exhausted = is_exhaustion(e);
        if let Some(held_back) = self.log.allow() {
            tracing::warn!(socket = self.what, error = %e, held_back, backing_off = exhausted, "accept failed");
        }
        if exhausted {
            self.delay.next_delay()
        } else {
            Duration::ZERO
        }
    }

    pub fn succeeded(&mut self) {
        self.delay.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_starts_over() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(10));
        let d: Vec<_> = (0..6).map(|_| b.next_delay().as_secs()).collect();
        assert_eq!(d, [1, 2, 4, 8, 10, 10]);
        b.reset();
        assert_eq!(b.next_delay().as_secs(), 1);
    }

    #[test]
    fn keys_back_off_on_their_own() {
        let b = KeyedBackoff::new(Duration::from_secs(1), Duration::from_secs(10));
        let d: Vec<_> = (0..6).map(|_| b.next_delay("a").as_secs()).collect();
        assert_eq!(d, [1, 2, 4, 8, 10, 10]);
        assert_eq!(b.next_delay("b").as_secs(), 1, "other keys unaffected");
        b.reset("a");
        assert_eq!(b.next_delay("a").as_secs(), 1);
    }

    #[test]
    fn accepts_back_off_only_when_out_of_resources() {
        let mut b = AcceptBackoff::new("test");
        let emfile = io::Error::from_raw_os_error(rustix::io::Errno::MFILE.raw_os_error());
        let waits: Vec<Duration> = (0..10).map(|_| b.failed(&emfile)).collect();
        assert_eq!(waits[0], Duration::from_millis(10));
        assert_eq!(waits[1], Duration::from_millis(20));
        assert_eq!(*waits.last().unwrap(), Duration::from_secs(1));
        b.succeeded();
        assert_eq!(b.failed(&emfile), Duration::from_millis(10));
        let aborted = io::Error::from_raw_os_error(rustix::io::Errno::CONNABORTED.raw_os_error());
        assert_eq!(b.failed(&aborted), Duration::ZERO);
    }
}
