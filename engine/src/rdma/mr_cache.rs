//! Memory registrations by (region, NIC), made on first use and kept until the region is
//! deregistered. A registration that failed is remembered with its reason (a GPU region without
//! dma-buf or peer memory support fails the same way every time), so it is neither retried on
//! every descriptor nor silent.
//!
//! Generic over what a registration is, so the bookkeeping is tested without a device.

use std::collections::HashMap;

use crate::region::RegionId;

#[derive(Debug)]
enum Entry<M> {
    Registered(M),
    Failed(String),
}

#[derive(Debug)]
pub struct MrCache<M> {
    entries: HashMap<(RegionId, usize), Entry<M>>,
}

impl<M> Default for MrCache<M> {
    fn default() -> Self {
        MrCache {
            entries: HashMap::new(),
        }
    }
}

/// What `get_or_register` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup<M> {
    /// Registered before.
    Cached(M),
    /// Registered now.
    New(M),
    /// Registration failed just now, with the reason.
    FailedNow(String),
    /// Registration failed before (not retried), with the reason.
    Failed(String),
}

impl<M: Clone> MrCache<M> {
    /// The registration of `region` on NIC `nic`, made with `register` if there is none yet.
    /// `live` says whether the region is still registered with the engine once the
    /// registration exists: a region deregistered meanwhile is not cached (the registration is
    /// still returned, for the batch that holds the region, and dropped with it).
    pub fn get_or_register(
        &mut self,
        region: RegionId,
        nic: usize,
        register: impl FnOnce() -> Result<M, String>,
        live: impl FnOnce() -> bool,
    ) -> Lookup<M> {
        match self.entries.get(&(region, nic)) {
            Some(Entry::Registered(m)) => return Lookup::Cached(m.clone()),
            Some(Entry::Failed(r)) => return Lookup::Failed(r.clone()),
            None => {}
        }
        let made = register();
        if !live() {
            return match made {
                Ok(m) => Lookup::New(m),
                Err(r) => Lookup::FailedNow(r),
            };
        }
        match made {
            Ok(m) => {
                self.entries
                    .insert((region, nic), Entry::Registered(m.clone()));
                Lookup::New(m)
            }
            Err(r) => {
                self.entries.insert((region, nic), Entry::Failed(r.clone()));
                Lookup::FailedNow(r)
            }
        }
    }

    /// Forgets every registration of `region`; returns them so the caller drops them (deregisters)
    /// outside its lock.
    pub fn forget(&mut self, region: RegionId) -> Vec<M> {
        let keys: Vec<(RegionId, usize)> = self
            .entries
            .keys()
            .filter(|(r, _)| *r == region)
            .copied()
            .collect();
        keys.into_iter()
            .filter_map(|k| match self.entries.remove(&k) {
                Some(Entry::Registered(m)) => Some(m),
                _ => None,
            })
            .collect()
    }

    /// Registrations held (failures not counted).
    pub fn len(&self) -> usize {
        self.entries
            .values()
            .filter(|e| matches!(e, Entry::Registered(_)))
            .count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[test]
    fn registers_once_per_region_and_nic() {
        let mut c: MrCache<u32> = MrCache::default();
        let calls = Cell::new(0);
        let reg = |v| {
            calls.set(calls.get() + 1);
            Ok(v)
        };
        assert_eq!(
            c.get_or_register(RegionId(1), 0, || reg(10), || true),
            Lookup::New(10)
        );
        assert_eq!(
            c.get_or_register(RegionId(1), 0, || reg(99), || true),
            Lookup::Cached(10)
        );
        assert_eq!(
            c.get_or_register(RegionId(1), 1, || reg(11), || true),
            Lookup::New(11)
        );
        assert_eq!(calls.get(), 2);
        assert_eq!(c.len(), 2);
        let mut gone = c.forget(RegionId(1));
        gone.sort();
        assert_eq!(gone, [10, 11]);
        assert!(c.is_empty());
        assert_eq!(
            c.get_or_register(RegionId(1), 0, || reg(12), || true),
            Lookup::New(12),
            "registered again after being forgotten"
        );
    }

    #[test]
    fn failures_are_remembered_with_their_reason() {
        let mut c: MrCache<u32> = MrCache::default();
        let r = c.get_or_register(
            RegionId(2),
            0,
            || Err("no dma-buf; is nvidia-peermem loaded?".into()),
            || true,
        );
        assert!(matches!(&r, Lookup::FailedNow(why) if why.contains("peermem")));
        let again = c.get_or_register(RegionId(2), 0, || Ok(5), || true);
        assert!(
            matches!(&again, Lookup::Failed(why) if why.contains("peermem")),
            "not retried: {again:?}"
        );
        assert!(c.is_empty());
        assert!(c.forget(RegionId(2)).is_empty());
        assert_eq!(
            c.get_or_register(RegionId(2), 0, || Ok(5), || true),
            Lookup::New(5)
        );
    }

    #[test]
    fn a_region_deregistered_meanwhile_is_not_cached() {
        let mut c: MrCache<u32> = MrCache::default();
        assert_eq!(
            c.get_or_register(RegionId(3), 0, || Ok(7), || false),
            Lookup::New(7)
        );
        assert!(c.is_empty(), "nothing pins the memory of a dead region");
    }
}
