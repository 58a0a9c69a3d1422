//! Who keeps a slot when a listener is full: the one table of live connections behind the
//! engine's data ports and the agent's peer API, local API and fd socket.
//!
//! A connection is *unproven* from accept until it proves itself (a handshake, an authenticated
//! request, a request at all — what counts is the listener's choice), and again whenever the
//! listener says it waits for nothing of value (the fd socket between two requests). A stranger
//! can open connections far faster than any deadline closes them, so a full listener never waits
//! and never turns the newcomer away while an unproven connection holds a slot: it sheds one.
//! Which one decides who a flood hurts:
//!
//! - a source at its own quota of unproven connections loses its oldest one, so one address or
//!   one process floods only itself;
//! - at the listener's caps, the oldest unproven connection of the *heaviest* source (most
//!   unproven connections) goes: a flood spread over many sources still sheds the flood's
//!   connections before a lone legitimate newcomer's;
//! - a proven connection is never shed; when every slot holds one, the newcomer is refused
//!   ([`Full`]).
//!
//! Deadlines (how long a connection may stay unproven) belong to the listener: the table only
//! decides who goes when room is needed.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// Closes a connection from outside the code serving it: that code sees the connection end
/// (EOF, an error) and drops its [`Admission`].
pub trait Shed: Send + 'static {
    fn shed(&self);
}

/// A duplicate of a blocking socket: shutting it down wakes the thread blocked on the original.
impl Shed for std::net::TcpStream {
    fn shed(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl Shed for std::os::unix::net::UnixStream {
    fn shed(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

/// No handle (duplicating the socket failed): the connection runs into its own deadline.
impl<T: Shed> Shed for Option<T> {
    fn shed(&self) {
        if let Some(t) = self {
            t.shed();
        }
    }
}

/// An async connection's task waits on the notification next to its I/O. `notify_one` keeps
/// the wake-up for a task that is not waiting yet.
impl Shed for Arc<tokio::sync::Notify> {
    fn shed(&self) {
        self.notify_one();
    }
}

/// How many connections a listener holds. Each is at least 1 (a 0 would refuse everyone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections held at once, proven or not.
    pub total: usize,
    /// Of those, unproven.
    pub unproven: usize,
    /// Unproven from one source (an address, a process).
    pub unproven_per_source: usize,
}

/// The listener is full of proven connections: the newcomer is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("every connection slot is held by a proven connection")
    }
}

impl std::error::Error for Full {}

/// A newcomer let in, and how many connections were shed to make its room.
#[derive(Debug)]
pub struct Admitted<K: Eq + Hash + Clone + Send + 'static, C: Shed> {
    pub admission: Admission<K, C>,
    pub shed: usize,
}

#[derive(Debug)]
struct Live<K, C> {
    source: K,
    closer: C,
    /// Unproven since then (None: proven).
    unproven_since: Option<Instant>,
    /// Shed to make room: no longer counted, its code is on its way out.
    shed: bool,
}

#[derive(Debug)]
struct Inner<K, C> {
    live: HashMap<u64, Live<K, C>>,
    next: u64,
    /// Live and not shed.
    counted: usize,
    unproven: usize,
    unproven_by_source: HashMap<K, usize>,
}

impl<K: Eq + Hash + Clone, C: Shed> Inner<K, C> {
    fn unproven_of(&self, source: &K) -> usize {
        self.unproven_by_source.get(source).copied().unwrap_or(0)
    }

    fn count_unproven(&mut self, source: &K) {
        self.unproven += 1;
        *self.unproven_by_source.entry(source.clone()).or_default() += 1;
    }

    fn uncount_unproven(&mut self, source: &K) {
        self.unproven -= 1;
        if let Some(n) = self.unproven_by_source.get_mut(source) {
            *n -= 1;
            if *n == 0 {
                self.unproven_by_source.remove(source);
            }
        }
    }

    /// Sheds the oldest unproven connection of `source`, or when None of the heaviest source;
    /// false when there is none to shed.
    fn shed_one(&mut self, source: Option<&K>) -> bool {
        let by_source = &self.unproven_by_source;
        let victim = self
            .live
            .iter()
            .filter(|(_, l)| !l.shed && source.is_none_or(|s| *s == l.source))
            .filter_map(|(id, l)| {
                let since = l.unproven_since?;
                let weight = by_source.get(&l.source).copied().unwrap_or(0);
                Some(((weight, std::cmp::Reverse(since)), *id))
            })
            .max_by_key(|(rank, _)| *rank)
            .map(|(_, id)| id);
        let Some(id) = victim else {
            return false;
        };
        let Some(l) = self.live.get_mut(&id) else {
            return false;
        };
        l.shed = true;
        l.closer.shed();
        let source = l.source.clone();
        self.counted -= 1;
        self.uncount_unproven(&source);
        true
    }
}

/// The live connections of one listener.
#[derive(Debug)]
pub struct Table<K, C> {
    inner: Arc<Mutex<Inner<K, C>>>,
    limits: Limits,
}

fn lock<K, C>(m: &Mutex<Inner<K, C>>) -> MutexGuard<'_, Inner<K, C>> {
    // The table stays consistent between statements; a panic elsewhere must not stop accepts.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<K: Eq + Hash + Clone + Send + 'static, C: Shed> Table<K, C> {
    pub fn new(limits: Limits) -> Self {
        Table {
            inner: Arc::new(Mutex::new(Inner {
                live: HashMap::new(),
                next: 0,
                counted: 0,
                unproven: 0,
                unproven_by_source: HashMap::new(),
            })),
            limits: Limits {
                total: limits.total.max(1),
                unproven: limits.unproven.max(1),
                unproven_per_source: limits.unproven_per_source.max(1),
            },
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Lets a new, unproven connection from `source` in, shedding what must go to make its room
    /// (see the module comment); `closer` closes it should it be shed in turn.
    pub fn admit(&self, source: K, closer: C) -> Result<Admitted<K, C>, Full> {
        let limits = self.limits;
        let mut t = lock(&self.inner);
        let mut shed = 0;
        // Loops, not ifs: connections that went back to unproven (Admission::idle) may have
        // put a source or the listener over its quota.
        while t.unproven_of(&source) >= limits.unproven_per_source && t.shed_one(Some(&source)) {
            shed += 1;
        }
        while t.counted >= limits.total || t.unproven >= limits.unproven {
            if !t.shed_one(None) {
                return Err(Full);
            }
            shed += 1;
        }
        t.next += 1;
        let id = t.next;
        t.counted += 1;
        t.count_unproven(&source);
        t.live.insert(
            id,
            Live {
                source,
                closer,
                unproven_since: Some(Instant::now()),
                shed: false,
            },
        );
        Ok(Admitted {
            admission: Admission {
                id,
                proven: AtomicBool::new(false),
                inner: self.inner.clone(),
            },
            shed,
        })
    }

    /// Connections held now (shed ones on their way out not counted).
    pub fn len(&self) -> usize {
        lock(&self.inner).counted
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Unproven connections held now.
    pub fn unproven(&self) -> usize {
        lock(&self.inner).unproven
    }

    /// Closes every connection (the listener stops).
    pub fn shed_all(&self) {
        let t = lock(&self.inner);
        for l in t.live.values() {
            l.closer.shed();
        }
    }
}

/// A connection's place in its listener's table, given back when dropped.
#[derive(Debug)]
pub struct Admission<K: Eq + Hash + Clone + Send + 'static, C: Shed> {
    id: u64,
    /// What [`Admission::proven`] last said, read without the lock.
    proven: AtomicBool,
    inner: Arc<Mutex<Inner<K, C>>>,
}

impl<K: Eq + Hash + Clone + Send + 'static, C: Shed> Admission<K, C> {
    /// The connection proved itself: it is never shed from now on (until [`Admission::idle`]).
    /// False when it was shed first: it is closing, and the proof came too late.
    pub fn proven(&self) -> bool {
        if self.proven.load(Ordering::Acquire) {
            return true;
        }
        let mut t = lock(&self.inner);
        let Some(l) = t.live.get_mut(&self.id) else {
            return false;
        };
        if l.shed {
            return false;
        }
        if l.unproven_since.take().is_some() {
            let source = l.source.clone();
            t.uncount_unproven(&source);
        }
        // Under the lock: no shedding can come between the table's state and this flag.
        self.proven.store(true, Ordering::Release);
        true
    }

    /// Whether [`Admission::proven`] took effect (and no [`Admission::idle`] came since): a
    /// read without the lock, for every read of a connection's bytes.
    pub fn is_proven(&self) -> bool {
        self.proven.load(Ordering::Acquire)
    }

    /// The connection waits for nothing of value again (between two requests): sheddable like a
    /// newcomer, its age counted from now.
    pub fn idle(&self) {
        let mut t = lock(&self.inner);
        self.proven.store(false, Ordering::Release);
        let Some(l) = t.live.get_mut(&self.id) else {
            return;
        };
        if l.shed || l.unproven_since.is_some() {
            return;
        }
        l.unproven_since = Some(Instant::now());
        let source = l.source.clone();
        t.count_unproven(&source);
    }
}

impl<K: Eq + Hash + Clone + Send + 'static, C: Shed> Drop for Admission<K, C> {
    fn drop(&mut self) {
        let mut t = lock(&self.inner);
        let Some(l) = t.live.remove(&self.id) else {
            return;
        };
        if l.shed {
            return;
        }
        t.counted -= 1;
        if l.unproven_since.is_some() {
            t.uncount_unproven(&l.source);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Records that it was shed.
    #[derive(Debug, Clone, Default)]
    struct Flag(Arc<AtomicUsize>);

    impl Shed for Flag {
        fn shed(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    impl Flag {
        fn is_shed(&self) -> bool {
            self.0.load(Ordering::Relaxed) > 0
        }
    }

    fn limits(total: usize, unproven: usize, per_source: usize) -> Limits {
        Limits {
            total,
            unproven,
            unproven_per_source: per_source,
        }
    }

    fn admit(
        t: &Table<&'static str, Flag>,
        source: &'static str,
    ) -> (Admission<&'static str, Flag>, Flag, usize) {
        let f = Flag::default();
        let a = t.admit(source, f.clone()).expect("admitted");
        (a.admission, f, a.shed)
    }

    #[test]
    fn a_source_at_its_quota_sheds_its_own_oldest() {
        let t = Table::new(limits(100, 100, 2));
        let (_a1, f1, _) = admit(&t, "flood");
        let (_a2, f2, _) = admit(&t, "flood");
        let (_b, fb, _) = admit(&t, "peer");
        let (_a3, f3, shed) = admit(&t, "flood");
        assert_eq!(shed, 1);
        assert!(f1.is_shed() && !f2.is_shed() && !f3.is_shed() && !fb.is_shed());
        assert_eq!(t.len(), 3);
        assert_eq!(t.unproven(), 3);
    }

    #[test]
    fn at_the_cap_the_heaviest_source_loses_its_oldest_and_proven_ones_stay() {
        let t = Table::new(limits(4, 4, 4));
        let (old, fold, _) = admit(&t, "peer");
        old.proven();
        let (_lone, flone, _) = admit(&t, "other");
        let (_x1, fx1, _) = admit(&t, "flood");
        let (_x2, fx2, _) = admit(&t, "flood");
        // Full: "other"'s connection is older than the flood's, but the flood is heavier.
        let (_n, fnew, shed) = admit(&t, "newcomer");
        assert_eq!(shed, 1);
        assert!(fx1.is_shed());
        assert!(!fx2.is_shed() && !flone.is_shed() && !fold.is_shed() && !fnew.is_shed());
        // Ties: the oldest goes ("other" before "flood"'s second, "newcomer").
        let (_m, _, shed) = admit(&t, "more");
        assert_eq!(shed, 1);
        assert!(flone.is_shed() && !fx2.is_shed());
        assert!(!fold.is_shed());
    }

    #[test]
    fn full_of_proven_connections_refuses_the_newcomer() {
        let t = Table::new(limits(2, 2, 2));
        let (a, fa, _) = admit(&t, "a");
        let (b, fb, _) = admit(&t, "b");
        a.proven();
        b.proven();
        assert_eq!(t.admit("c", Flag::default()).unwrap_err(), Full);
        assert!(!fa.is_shed() && !fb.is_shed());
        // One leaves: room again.
        drop(a);
        let (_c, _, shed) = admit(&t, "c");
        assert_eq!(shed, 0);
    }

    #[test]
    fn the_unproven_cap_sheds_before_the_total_is_reached() {
        let t = Table::new(limits(10, 2, 10));
        let (p, fp, _) = admit(&t, "p");
        p.proven();
        let (_u1, fu1, _) = admit(&t, "u");
        let (_u2, _, _) = admit(&t, "v");
        let (_u3, _, shed) = admit(&t, "w");
        assert_eq!(shed, 1);
        assert!(fu1.is_shed() && !fp.is_shed());
        assert_eq!((t.len(), t.unproven()), (3, 2));
    }

    #[test]
    fn an_idle_connection_is_sheddable_again_and_drops_give_slots_back() {
        let t = Table::new(limits(2, 2, 1));
        let (a, fa, _) = admit(&t, "p");
        a.proven();
        // A busy connection of the same source does not count against its unproven quota.
        let (b, fb, shed) = admit(&t, "p");
        assert_eq!(shed, 0);
        assert!(b.proven() && b.is_proven());
        a.idle();
        b.idle();
        // Two unproven of one source with a quota of one: both go for the newcomer.
        let (_c, fc, shed) = admit(&t, "p");
        assert_eq!(shed, 2);
        assert!(fa.is_shed() && fb.is_shed() && !fc.is_shed());
        // Proving a shed connection changes nothing.
        assert!(!a.proven());
        assert_eq!((t.len(), t.unproven()), (1, 1));
        drop((a, b));
        assert_eq!((t.len(), t.unproven()), (1, 1));
    }

    #[test]
    fn limits_of_zero_still_admit_one() {
        let t: Table<&'static str, Flag> = Table::new(limits(0, 0, 0));
        assert_eq!(t.limits(), limits(1, 1, 1));
        let (_a, _, _) = admit(&t, "a");
    }
}
