//! The watcher: one full read of the fabric, then a watch from the next revision, feeding the cache.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, GetOptions, KeyValue, WatchOptions};
use kvfabric_rt::Backoff;

use super::super::{AgentEntry, Event, SegmentEntry};
use super::{Cache, Inner, PAGE, classify, prefix_end};
use crate::error::Result;

impl Inner {
    /// Reads every entry of the fabric (paged, at one revision) and replaces the cache.
    pub(super) async fn full_read(&self) -> Result<i64> {
        let end = prefix_end(&self.root);
        let mut kv = self.client.kv_client();
        let mut agents = HashMap::new();
        let mut segments = HashMap::new();
        let mut from = self.root.clone().into_bytes();
        let mut rev = 0;
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
            if rev != 0 {
                options = options.with_revision(rev);
            }
            let resp = self
                .call("read fabric", kv.get(from.clone(), Some(options)))
                .await?;
            if rev == 0 {
                rev = resp.header().map_or(0, |h| h.revision());
            }
            for kv in resp.kvs() {
                match self.decode(kv) {
                    Some(Entry::Agent(a)) => {
                        agents.insert(a.name.clone(), a);
                    }
                    Some(Entry::Segment(s)) => {
                        segments.insert(s.name.clone(), s);
                    }
                    None => {}
                }
            }
            match resp.kvs().last() {
                Some(last) if resp.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        *self.cache.write() = Cache { agents, segments };
        self.cache_rev.send_modify(|r| *r = (*r).max(rev));
        Ok(rev)
    }

    pub(super) async fn watcher(self: Arc<Self>, mut rev: i64) {
        let mut backoff = Backoff::new(Duration::from_millis(50), self.backoff_cap());
        let mut resync = false;
        loop {
            if resync {
                match self.full_read().await {
                    Ok(r) => {
                        rev = r;
                        self.status.lock().resyncs += 1;
                        let _ = self.events.send(Event::Resynced);
                        tracing::info!(revision = rev, "registry cache resynced");
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "registry resync failed; retrying");
                        tokio::time::sleep(backoff.next_delay()).await;
                        continue;
                    }
                }
            }
            // Whatever ends this watch, the next one starts from a full read.
            resync = true;
            let options = WatchOptions::new()
                .with_prefix()
                .with_start_revision(rev + 1);
            let mut client = self.client.watch_client();
            let mut stream = match self
                .call(
                    "watch fabric",
                    client.watch(self.root.clone(), Some(options)),
                )
                .await
            {
                Ok(stream) => stream,
                Err(_) => {
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            };
            loop {
                match stream.message().await {
                    Ok(Some(resp)) => {
                        if resp.canceled() || resp.compact_revision() > 0 {
                            tracing::warn!(
                                compact_revision = resp.compact_revision(),
                                reason = resp.cancel_reason(),
                                "registry watch canceled; resyncing"
                            );
                            break;
                        }
                        backoff.reset();
                        self.ok();
                        let mut applied = rev;
                        for event in resp.events() {
                            let Some(kv) = event.kv() else { continue };
                            applied = applied.max(kv.mod_revision());
                            if let Some(event) = self.apply(event.event_type(), kv) {
                                let _ = self.events.send(event);
                            }
                        }
                        if let Some(h) = resp.header() {
                            applied = applied.max(h.revision());
                        }
                        rev = applied;
                        self.cache_rev.send_modify(|r| *r = (*r).max(rev));
                    }
                    Ok(None) => {
                        self.failed(&self.unavailable("watch fabric", "watch stream closed"));
                        break;
                    }
                    Err(e) => {
                        self.failed(&classify("watch fabric", &self.endpoints_str, e));
                        break;
                    }
                }
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    /// Applies one watch event to the cache.
    pub(super) fn apply(&self, kind: EventType, kv: &KeyValue) -> Option<Event> {
        match kind {
            EventType::Put => match self.decode(kv)? {
                Entry::Agent(a) => {
                    self.cache.write().agents.insert(a.name.clone(), a.clone());
                    Some(Event::AgentPut(a))
                }
                Entry::Segment(s) => {
                    self.cache
                        .write()
                        .segments
                        .insert(s.name.clone(), s.clone());
                    Some(Event::SegmentPut(s))
                }
            },
            EventType::Delete => {
                let key = std::str::from_utf8(kv.key()).ok()?;
                let rest = key.strip_prefix(&self.root)?;
                if let Some(name) = rest.strip_prefix("agents/") {
                    self.cache.write().agents.remove(name)?;
                    Some(Event::AgentDeleted(name.into()))
                } else if let Some(name) = rest.strip_prefix("segments/") {
                    self.cache.write().segments.remove(name)?;
                    Some(Event::SegmentDeleted(name.into()))
                } else {
                    None
                }
            }
        }
    }

    /// An entry from a key and value under the root; anything else (unknown key, bad JSON) is
    /// logged and skipped: another agent's bug must not stop this one's watch.
    fn decode(&self, kv: &KeyValue) -> Option<Entry> {
        let key = std::str::from_utf8(kv.key()).ok()?;
        let rest = key.strip_prefix(&self.root)?;
        let entry = if rest.starts_with("agents/") {
            serde_json::from_slice(kv.value()).map(Entry::Agent)
        } else if rest.starts_with("segments/") {
            serde_json::from_slice(kv.value()).map(Entry::Segment)
        } else {
            return None;
        };
        match entry {
            Ok(entry) => Some(entry),
            Err(e) => {
                tracing::warn!(key, error = %e, "registry: skipping an entry that does not parse");
                None
            }
        }
    }
}

enum Entry {
    Agent(AgentEntry),
    Segment(SegmentEntry),
}
