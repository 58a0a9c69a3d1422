// TEMPORARY STUB (replaced by the registry branch).
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::sync::broadcast;

use super::{AgentEntry, Event, Registry, RegistryState, SegmentEntry};
use crate::error::Result;

#[derive(Debug, Clone)]
pub struct MemoryStore(Arc<Inner>);
#[derive(Debug)]
struct Inner {
    agents: Mutex<BTreeMap<String, AgentEntry>>,
    segments: Mutex<BTreeMap<String, SegmentEntry>>,
    tx: broadcast::Sender<Event>,
}
impl MemoryStore {
    pub fn new() -> Self {
        MemoryStore(Arc::new(Inner {
            agents: Default::default(),
            segments: Default::default(),
            tx: broadcast::channel(1024).0,
        }))
    }
}
#[derive(Debug)]
pub struct MemoryRegistry(MemoryStore);
impl MemoryRegistry {
    pub fn new(store: MemoryStore) -> Self {
        MemoryRegistry(store)
    }
}
#[async_trait]
impl Registry for MemoryRegistry {
    async fn register_agent(&self, entry: AgentEntry) -> Result<()> {
        self.0
            .0
            .agents
            .lock()
            .unwrap()
            .insert(entry.name.clone(), entry.clone());
        let _ = self.0.0.tx.send(Event::AgentPut(entry));
        Ok(())
    }
    async fn put_segment(&self, entry: SegmentEntry) -> Result<()> {
        self.0
            .0
            .segments
            .lock()
            .unwrap()
            .insert(entry.name.clone(), entry.clone());
        let _ = self.0.0.tx.send(Event::SegmentPut(entry));
        Ok(())
    }
    async fn delete_segment(&self, name: &str) -> Result<()> {
        self.0.0.segments.lock().unwrap().remove(name);
        let _ = self.0.0.tx.send(Event::SegmentDeleted(name.into()));
        Ok(())
    }
    fn segment(&self, name: &str) -> Option<SegmentEntry> {
        self.0.0.segments.lock().unwrap().get(name).cloned()
    }
    fn agent(&self, name: &str) -> Option<AgentEntry> {
        self.0.0.agents.lock().unwrap().get(name).cloned()
    }
    fn segments(&self) -> BTreeMap<String, SegmentEntry> {
        self.0.0.segments.lock().unwrap().clone()
    }
    fn agents(&self) -> BTreeMap<String, AgentEntry> {
        self.0.0.agents.lock().unwrap().clone()
    }
    fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.0.0.tx.subscribe()
    }
    fn state(&self) -> RegistryState {
        RegistryState {
            backend: "memory".into(),
            ..Default::default()
        }
    }
    async fn shutdown(&self) -> Result<()> {
        Ok(())
    }
}
