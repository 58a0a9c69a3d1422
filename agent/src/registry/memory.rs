//! The embedded registry: one in-process store, shared by every agent of the process.
//!
//! [`MemoryStore`] holds the entries and broadcasts every change; [`MemoryRegistry`] is one
//! agent's handle on it. A handle remembers the keys it wrote, so [`Registry::shutdown`] deletes
//! exactly those (an entry another handle has since overwritten belongs to that handle). There
//! are no leases: a handle dropped without `shutdown` leaves its entries in the store.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use async_trait::async_trait;
use parking_lot::{Mutex, RwLock};
use tokio::sync::broadcast;

use super::{AgentEntry, Event, Registry, RegistryState, SegmentEntry, check_name};
use crate::error::{Error, Result};

/// Events a subscriber may fall behind by before it sees `Lagged`.
const EVENT_CAPACITY: usize = 1024;

/// Agents and segments of one in-process fabric. Cheap to clone: clones share the same store.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<StoreInner>,
}

#[derive(Debug)]
struct StoreInner {
    maps: RwLock<Maps>,
    events: broadcast::Sender<Event>,
    next_handle: AtomicU64,
}

/// Every entry with the handle that wrote it last.
#[derive(Debug, Default)]
struct Maps {
    agents: BTreeMap<String, (u64, AgentEntry)>,
    segments: BTreeMap<String, (u64, SegmentEntry)>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        MemoryStore {
            inner: Arc::new(StoreInner {
                maps: RwLock::new(Maps::default()),
                events,
                next_handle: AtomicU64::new(1),
            }),
        }
    }

    /// A new agent's handle on this store.
    pub fn registry(&self) -> Arc<MemoryRegistry> {
        Arc::new(MemoryRegistry::new(self))
    }

    fn emit(&self, event: Event) {
        // No receivers is fine: nobody is watching.
        let _ = self.inner.events.send(event);
    }
}

/// One agent's handle on a [`MemoryStore`].
#[derive(Debug)]
pub struct MemoryRegistry {
    store: MemoryStore,
    id: u64,
    /// Keys this handle wrote (and has not deleted).
    owned: Mutex<Owned>,
    shut_down: AtomicBool,
}

#[derive(Debug, Default)]
struct Owned {
    agents: BTreeSet<String>,
    segments: BTreeSet<String>,
}

impl MemoryRegistry {
    pub fn new(store: &MemoryStore) -> Self {
        MemoryRegistry {
            store: store.clone(),
            id: store.inner.next_handle.fetch_add(1, Ordering::Relaxed),
            owned: Mutex::new(Owned::default()),
            shut_down: AtomicBool::new(false),
        }
    }

    /// A registry on a store of its own (the default of a single agent without etcd).
    pub fn standalone() -> Arc<Self> {
        MemoryStore::new().registry()
    }

    /// The store this handle writes to (to hand to another agent of the same process).
    pub fn store(&self) -> &MemoryStore {
        &self.store
    }

    fn check_open(&self, op: &str) -> Result<()> {
        if self.shut_down.load(Ordering::Acquire) {
            return Err(Error::Registry {
                op: op.to_string(),
                endpoints: "memory".into(),
                reason: "this registry handle was shut down".into(),
            });
        }
        Ok(())
    }
}

#[async_trait]
impl Registry for MemoryRegistry {
    async fn register_agent(&self, entry: AgentEntry) -> Result<()> {
        check_name("agent.name", &entry.name)?;
        self.check_open("register agent")?;
        let mut owned = self.owned.lock();
        owned.agents.insert(entry.name.clone());
        // Emitted under the write lock, so events are in the order of the writes.
        let mut maps = self.store.inner.maps.write();
        maps.agents
            .insert(entry.name.clone(), (self.id, entry.clone()));
        self.store.emit(Event::AgentPut(entry));
        Ok(())
    }

    async fn put_segment(&self, entry: SegmentEntry) -> Result<()> {
        check_name("segment.name", &entry.name)?;
        self.check_open("put segment")?;
        let mut owned = self.owned.lock();
        owned.segments.insert(entry.name.clone());
        // Emitted under the write lock, so events are in the order of the writes.
        let mut maps = self.store.inner.maps.write();
        maps.segments
            .insert(entry.name.clone(), (self.id, entry.clone()));
        self.store.emit(Event::SegmentPut(entry));
        Ok(())
    }

    async fn delete_segment(&self, name: &str) -> Result<()> {
        self.check_open("delete segment")?;
        let mut owned = self.owned.lock();
        if !owned.segments.remove(name) {
            return Err(Error::UnknownSegment { name: name.into() });
        }
        let mut maps = self.store.inner.maps.write();
        if maps
            .segments
            .get(name)
            .is_some_and(|(by, _)| *by == self.id)
        {
            maps.segments.remove(name);
            self.store.emit(Event::SegmentDeleted(name.into()));
        }
        Ok(())
    }

    fn segment(&self, name: &str) -> Option<SegmentEntry> {
        let maps = self.store.inner.maps.read();
        maps.segments.get(name).map(|(_, e)| e.clone())
    }

    fn agent(&self, name: &str) -> Option<AgentEntry> {
        let maps = self.store.inner.maps.read();
        maps.agents.get(name).map(|(_, e)| e.clone())
    }

    fn segments(&self) -> BTreeMap<String, SegmentEntry> {
        let maps = self.store.inner.maps.read();
        maps.segments
            .iter()
            .map(|(k, (_, e))| (k.clone(), e.clone()))
            .collect()
    }

    fn agents(&self) -> BTreeMap<String, AgentEntry> {
        let maps = self.store.inner.maps.read();
        maps.agents
            .iter()
            .map(|(k, (_, e))| (k.clone(), e.clone()))
            .collect()
    }

    fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.store.inner.events.subscribe()
    }

    fn state(&self) -> RegistryState {
        let maps = self.store.inner.maps.read();
        RegistryState {
            backend: "memory".into(),
            endpoints: Vec::new(),
            connected: !self.shut_down.load(Ordering::Acquire),
            lease_id: 0,
            lease_ttl_secs: 0,
            reregistrations: 0,
            resyncs: 0,
            watch_resumes: 0,
            agents: maps.agents.len(),
            segments: maps.segments.len(),
            last_error: None,
        }
    }

    async fn shutdown(&self) -> Result<()> {
        if self.shut_down.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let owned = std::mem::take(&mut *self.owned.lock());
        let mut maps = self.store.inner.maps.write();
        for name in owned.segments {
            if maps
                .segments
                .get(&name)
                .is_some_and(|(by, _)| *by == self.id)
            {
                maps.segments.remove(&name);
                self.store.emit(Event::SegmentDeleted(name));
            }
        }
        for name in owned.agents {
            if maps.agents.get(&name).is_some_and(|(by, _)| *by == self.id) {
                maps.agents.remove(&name);
                self.store.emit(Event::AgentDeleted(name));
            }
        }
        Ok(())
    }
}
