//! The watcher: one full read of the fabric, then a watch from the next revision, feeding the
//! cache.
//!
//! A watch stream that ends — its member died, its connection dropped, its member lost its
//! leader (requests ask for one, so such a member cancels the stream rather than go quiet), or
//! it stayed silent past its deadline — is opened again from the first revision not yet
//! applied: a *resume*. etcd replays what happened meanwhile; nothing is read twice, however
//! many agents lose their member at once. Only when etcd no longer has that revision is
//! everything read again, once, and watched from there: a *relist* (`resyncs`, broadcast as
//! [`Event::Resynced`]). That is when it compacted the revision away (it answers the new watch
//! "compacted"), or lost its data (wiped, restored: its revision, read before each resume, is
//! behind the cache's).
//!
//! The revision applied is the last event's, never a response header's: a header carries the
//! store's revision when it was sent, which in the answer creating a watch, or in one batch of
//! a resumed watch catching up (etcd sends up to 1000 revisions at a time), lies ahead of the
//! events delivered so far. Resuming from it would skip the rest.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, GetOptions, KeyValue, WatchOptions};
use kvfabric_rt::Backoff;

use super::super::{AgentEntry, Event, SegmentEntry};
use super::{Cache, Inner, PAGE, classify, prefix_end};
use crate::error::{Error, Result};

/// Times a full read starts over because compaction overtook the revision it was reading at
/// (between two pages); then it fails, and the watcher backs off before the next.
const READ_ATTEMPTS: usize = 3;

/// How one watch stream ended.
enum WatchEnd {
    /// etcd dropped revisions the watch still needed: only a full read catches up.
    Compacted(Error),
    /// Anything else: watch again from the first revision not applied.
    Broken(Error),
}

impl Inner {
    /// Reads every entry of the fabric (paged, at one revision) and replaces the cache. A
    /// compaction between two pages makes the read start over at the newest revision (at most
    /// [`READ_ATTEMPTS`] reads).
    pub(super) async fn full_read(&self) -> Result<i64> {
        let mut attempt = 1;
        loop {
            match self.read_all().await {
                Err(e @ Error::RegistryCompacted { .. }) if attempt < READ_ATTEMPTS => {
                    tracing::debug!(error = %e, "registry read overtaken by compaction; again");
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn read_all(&self) -> Result<i64> {
        let end = prefix_end(&self.root);
        let mut agents = HashMap::new();
        let mut segments = HashMap::new();
        let mut from = self.root.clone().into_bytes();
        let mut rev = 0;
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
            if rev != 0 {
                options = options.with_revision(rev);
            }
            let op = format!("read fabric at revision {rev}");
            let resp = self
                .call_retrying(&op, || {
                    let (mut kv, key, options) =
                        (self.client.kv_client(), from.clone(), options.clone());
                    async move { kv.get(key, Some(options)).await }
                })
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
        // Exactly the read's revision, even below an earlier one: after etcd lost its history
        // the revisions start over, and the cache reflects the new ones.
        self.cache_rev.send_modify(|r| *r = rev);
        Ok(rev)
    }

    /// Watches from the revision after `rev` (what the first full read reflects) for as long as
    /// the registry lives. See the module documentation.
    pub(super) async fn watcher(self: Arc<Self>, rev: i64) {
        let mut backoff = Backoff::new(Duration::from_millis(50), self.backoff_cap());
        // The first revision not yet applied to the cache.
        let mut next = rev.saturating_add(1);
        let mut relist = false;
        // Whether the next watch follows a full read (else it resumes a broken one).
        let mut after_read = true;
        loop {
            if relist {
                match self.full_read().await {
                    Ok(r) => {
                        next = r.saturating_add(1);
                        relist = false;
                        after_read = true;
                        self.status.lock().resyncs += 1;
                        let _ = self.events.send(Event::Resynced);
                        tracing::info!(revision = r, "registry read again");
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "registry relist failed; retrying");
                        tokio::time::sleep(backoff.next_delay()).await;
                        continue;
                    }
                }
            }
            match self.watch_from(&mut next, after_read, &mut backoff).await {
                WatchEnd::Compacted(e) => {
                    tracing::warn!(error = %e, "registry watch cannot resume; reading everything again");
                    relist = true;
                }
                WatchEnd::Broken(e) => {
                    self.failed(&e);
                    tracing::debug!(error = %e, from = next, "registry watch ended; resuming");
                    after_read = false;
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }

    /// One watch stream from `*next`, applying what it brings and moving `*next` past each
    /// event, until it ends. Silence is bounded: after one request timeout without a message
    /// it asks etcd for a progress report, and a stream that does not answer within another is
    /// given up (a frozen or unreachable member; the transport's own keepalive takes longer).
    async fn watch_from(
        &self,
        next: &mut i64,
        after_read: bool,
        backoff: &mut Backoff,
    ) -> WatchEnd {
        let from = *next;
        if !after_read && let Err(end) = self.history_kept(from.saturating_sub(1)).await {
            return end;
        }
        let op = format!("watch fabric from revision {from}");
        let options = WatchOptions::new().with_prefix().with_start_revision(from);
        let open = || {
            let (mut client, options) = (self.client.watch_client(), options.clone());
            async move { client.watch(self.root.clone(), Some(options)).await }
        };
        let mut stream = match self.call_retrying(&op, open).await {
            Ok(stream) => stream,
            Err(e) => return WatchEnd::Broken(e),
        };
        if !after_read {
            self.status.lock().watch_resumes += 1;
            tracing::info!(revision = from, "registry watch resumed");
        }
        let silence = self.request_timeout;
        let mut probed = false;
        loop {
            let message = match tokio::time::timeout(silence, stream.message()).await {
                Ok(message) => message,
                Err(_) if !probed => {
                    // Any answer proves the stream alive; its revision is not used (etcd 3.4
                    // reports its own even while this watch still catches up).
                    if let Err(e) = stream.request_progress().await {
                        return WatchEnd::Broken(classify(&op, &self.endpoints_str, e));
                    }
                    probed = true;
                    continue;
                }
                Err(_) => {
                    return WatchEnd::Broken(self.unavailable(
                        &op,
                        format!("no answer to a progress request within {silence:?}"),
                    ));
                }
            };
            probed = false;
            let resp = match message {
                Ok(Some(resp)) => resp,
                Ok(None) => return WatchEnd::Broken(self.unavailable(&op, "watch stream closed")),
                Err(e) => return WatchEnd::Broken(classify(&op, &self.endpoints_str, e)),
            };
            if resp.compact_revision() > 0 {
                return WatchEnd::Compacted(Error::RegistryCompacted {
                    op,
                    endpoints: self.endpoints_str.clone(),
                    reason: format!(
                        "history is compacted up to revision {}",
                        resp.compact_revision()
                    ),
                });
            }
            if resp.canceled() {
                return WatchEnd::Broken(
                    self.unavailable(&op, format!("canceled by etcd: {}", resp.cancel_reason())),
                );
            }
            self.ok();
            if !resp.created() {
                // The stream carried events or answered a probe: it works, so the next
                // failure starts backing off from the first pause again.
                backoff.reset();
            }
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                *next = (*next).max(kv.mod_revision().saturating_add(1));
                if let Some(event) = self.apply(event.event_type(), kv) {
                    let _ = self.events.send(event);
                }
            }
            let applied = next.saturating_sub(1);
            self.cache_rev.send_modify(|r| *r = (*r).max(applied));
        }
    }

    /// Before a resume: whether etcd still has the history up to `applied`, the last revision
    /// the cache applied. A linearizable read answers with a revision at least as high as
    /// anything etcd ever committed, so one below `applied` means etcd lost its data (wiped,
    /// restored from an older backup) and counts its revisions anew: a watch from `applied + 1`
    /// would wait for that revision and skip every change before it. Only a full read catches
    /// up then. (A store that lost its history and was written past `applied` before this
    /// check cannot be told apart; its agents' leases are gone, and they re-register.)
    async fn history_kept(&self, applied: i64) -> Result<(), WatchEnd> {
        let op = "read the fabric's revision before resuming its watch";
        let resp = self
            .call_retrying(op, || {
                let mut kv = self.client.kv_client();
                let options = GetOptions::new()
                    .with_prefix()
                    .with_count_only()
                    .with_limit(1);
                let root = self.root.clone();
                async move { kv.get(root, Some(options)).await }
            })
            .await
            .map_err(WatchEnd::Broken)?;
        let now = resp.header().map_or(0, |h| h.revision());
        if now < applied {
            return Err(WatchEnd::Compacted(Error::RegistryCompacted {
                op: format!("watch fabric from revision {}", applied.saturating_add(1)),
                endpoints: self.endpoints_str.clone(),
                reason: format!(
                    "etcd is at revision {now}, behind revision {applied} the cache applied: \
                     it lost its history (wiped or restored)"
                ),
            }));
        }
        Ok(())
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
