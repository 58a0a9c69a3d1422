//! Holds: per-request read capabilities on a segment.
//!
//! A segment's key lets whoever holds it read and write all of the segment for as long as it is
//! registered. A *hold* is narrower: its owner (the worker that registered the segment) asks its
//! agent for a hold on some blocks (planes × block ids) for a while, and hands the hold's key to
//! one reader. The reader presents the hold key as a Submit's `remote_key`; the reader's agent
//! learns the grant from the segment's agent (`SegmentAccess` answers a hold key with the grant
//! and records the asking agent) and checks every batch against it before a byte moves.
//!
//! Two tables live here:
//!
//! - [`Holds`], at the segment's agent: the live holds, their grants and the agents each was
//!   handed to, so that ending a hold can ask each of them to drop it.
//! - [`Grants`], at a reader's agent: the grants it was given, each with a lock that its
//!   batches hold until every piece of theirs is accounted for (the engine keeps the guard with
//!   the batch, `Batch::keeping`), so a revocation knows when nothing under the grant can land.
//!
//! Grants are stored as given (planes and a sorted id set), never expanded: a hold of 2^20
//! blocks over 4096 planes is 8 MiB of ids and 128 KiB of planes, not 2^32 ranges.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvfabric_engine::{BatchOps, RegionId};

use kvfabric_proto::limits::{MAX_HOLD_BLOCK_IDS, MAX_HOLD_PLANES, MAX_HOLD_TTL_MS};
use kvfabric_proto::pb;

use crate::error::{Error, Result};
use crate::node::LocalSegment;

/// Most live holds (and holds still being ended) one segment may have.
pub(crate) const MAX_HOLDS_PER_SEGMENT: usize = 65_536;
/// Most live holds (and holds still being ended) one agent may keep for all its segments.
pub(crate) const MAX_HOLDS_PER_AGENT: usize = 262_144;
/// Words (8 bytes) of planes and block ids all holds of an agent may store, and as many for
/// the grants it was handed: 512 MiB each. A hold's own bounds (4096 planes, 2^20 ids) times the
/// counts above would be terabytes; this is what bounds the memory.
pub(crate) const MAX_HOLD_WORDS: usize = 1 << 26;
/// Most agents one hold is handed to (each is asked to drop it when it ends).
pub(crate) const MAX_GRANTEES: usize = 1024;
/// Most grants a reader's agent keeps (for its workers' batches) at once.
pub(crate) const MAX_GRANTS: usize = 262_144;
/// How long ending a hold waits for the agents it was handed to, unless the caller says.
pub(crate) const DEFAULT_END_TIMEOUT: Duration = Duration::from_secs(5);
/// A cached grant with less than this left (or less than the batch's own budget, if smaller)
/// is asked for again before a batch uses it: the owner may have extended the hold.
pub(crate) const GRANT_REFRESH: Duration = Duration::from_secs(1);

/// How much earlier than the owner's word a reader's agent lets its grant end: 10 ms, plus
/// 1000 ppm of the time left for two monotonic clocks that drift apart (NTP slews stay far
/// below that). The reader counts from when it *asked*, which is before the owner counted.
pub(crate) fn margin(left: Duration) -> Duration {
    Duration::from_millis(10) + left / 1000
}

/// A plane of a grant, in the serving engine's region ids: block `i` is `block_bytes` at
/// `base + i × stride` of `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantPlane {
    pub region: RegionId,
    pub base: u64,
    pub stride: u64,
    pub block_bytes: u64,
}

/// A plane with the byte range its granted blocks span, for finding the planes an op may fall
/// in without visiting them all.
#[derive(Debug, Clone, Copy)]
struct Indexed {
    plane: GrantPlane,
    /// Where the block of the smallest granted id starts.
    start: u64,
    /// The largest end (where the block of the largest granted id ends) of this plane and the
    /// planes of its region before it (sorted by `start`): a walk back from an offset stops
    /// once no earlier plane reaches it.
    reach: u64,
}

/// What a batch under a hold did that the grant does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outside {
    /// Op `index`'s remote range lies in no granted block.
    Op { index: usize },
    /// Table plane `index`'s remote side is no granted plane's region and stride, or its
    /// bytes of a block are not inside a granted plane's block.
    Plane { index: usize },
    /// Table block pair `index` names remote block `id`, which the hold does not grant.
    Block { index: usize, id: u64 },
}

impl std::fmt::Display for Outside {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outside::Op { index } => write!(f, "ops[{index}] reads bytes no granted block holds"),
            Outside::Plane { index } => write!(
                f,
                "table.planes[{index}].remote is not inside a granted plane (same region and \
                 stride, within its blocks)"
            ),
            Outside::Block { index, id } => write!(
                f,
                "table.remote_blocks[{index}] = {id} is not a granted block"
            ),
        }
    }
}

/// What a hold allows: planes (sorted by region, then where their granted blocks start) and
/// the sorted set of block ids every plane grants.
#[derive(Debug)]
pub struct Grant {
    planes: Vec<Indexed>,
    ids: Vec<u64>,
}

impl Grant {
    /// A grant of `planes` × `ids` (ids in any order, repeats dropped). Refused (the reason
    /// names what) when empty or when a plane's last block ends past 2^64; the owner has also
    /// checked every block against its region (see `Node::create_hold`).
    pub fn new(
        planes: impl IntoIterator<Item = GrantPlane>,
        mut ids: Vec<u64>,
    ) -> std::result::Result<Grant, (Option<usize>, &'static str)> {
        ids.sort_unstable();
        ids.dedup();
        let (Some(&min), Some(&max)) = (ids.first(), ids.last()) else {
            return Err((None, "a hold grants at least one block id"));
        };
        let mut indexed = Vec::new();
        for (i, p) in planes.into_iter().enumerate() {
            if p.block_bytes == 0 {
                return Err((Some(i), "a plane's blocks have at least one byte"));
            }
            // The one bounds formula of planes (the engine's); the smallest id's start is
            // below the largest id's end, so it cannot pass 2^64 when that does not.
            let end = kvfabric_engine::plane_end(p.base, p.stride, max, p.block_bytes).ok_or((
                Some(i),
                "base + largest block id × stride + block_bytes passes 2^64",
            ))?;
            let start = p.base + min * p.stride;
            indexed.push(Indexed {
                plane: p,
                start,
                reach: end,
            });
        }
        if indexed.is_empty() {
            return Err((None, "a hold grants at least one plane"));
        }
        indexed.sort_unstable_by_key(|x| (x.plane.region, x.start));
        for i in 1..indexed.len() {
            if indexed[i].plane.region == indexed[i - 1].plane.region {
                indexed[i].reach = indexed[i].reach.max(indexed[i - 1].reach);
            }
        }
        Ok(Grant {
            planes: indexed,
            ids,
        })
    }

    /// The planes as given (sorted).
    pub fn planes(&self) -> impl Iterator<Item = &GrantPlane> {
        self.planes.iter().map(|x| &x.plane)
    }

    /// The block ids (sorted, no repeats).
    pub fn ids(&self) -> &[u64] {
        &self.ids
    }

    /// Memory the grant holds, in 8-byte words (what [`MAX_HOLD_WORDS`] counts).
    pub fn words(&self) -> usize {
        self.ids.len() + self.planes.len() * 7
    }

    /// The planes of `region`.
    fn of_region(&self, region: RegionId) -> &[Indexed] {
        let from = self.planes.partition_point(|x| x.plane.region < region);
        let to = self.planes.partition_point(|x| x.plane.region <= region);
        &self.planes[from..to]
    }

    fn granted(&self, id: u64) -> bool {
        self.ids.binary_search(&id).is_ok()
    }

    /// Whether `len` bytes at `offset` of `region` lie inside one granted block. The planes
    /// whose granted span holds `offset` are found by a binary search and a walk back that
    /// stops where no earlier plane reaches it: one or two in the layouts engines register
    /// (a layer's planes apart, or K and V interleaved), all of the region's at worst.
    fn covers(&self, region: RegionId, offset: u64, len: u64) -> bool {
        let planes = self.of_region(region);
        let upto = planes.partition_point(|x| x.start <= offset);
        for x in planes[..upto].iter().rev() {
            if x.reach <= offset {
                return false;
            }
            if plane_holds(&x.plane, &self.ids, offset, len) {
                return true;
            }
        }
        false
    }

    /// Checks a read under the hold, its regions already the engine's ids: every op's remote
    /// range inside one granted block; a table's every remote plane inside a granted plane
    /// (same region and stride, its bytes of a block within the granted plane's block) and
    /// every remote block id granted. Costs ops × planes met (see `covers`), or table planes ×
    /// the region's granted planes + blocks × log ids.
    pub fn admits(&self, ops: &BatchOps) -> std::result::Result<(), Outside> {
        match ops {
            BatchOps::List(list) => {
                for (index, o) in list.iter().enumerate() {
                    if !self.covers(o.remote_region, o.remote_offset, o.len) {
                        return Err(Outside::Op { index });
                    }
                }
            }
            BatchOps::Table(table) => {
                for (index, p) in table.planes.iter().enumerate() {
                    let r = &p.remote;
                    let inside = self.of_region(r.region).iter().any(|x| {
                        let g = &x.plane;
                        g.stride == r.stride
                            && r.base >= g.base
                            && p.block_bytes <= g.block_bytes
                            && r.base - g.base <= g.block_bytes - p.block_bytes
                    });
                    if !inside {
                        return Err(Outside::Plane { index });
                    }
                }
                for (index, b) in table.blocks.iter().enumerate() {
                    let id = u64::from(b.remote);
                    if !self.granted(id) {
                        return Err(Outside::Block { index, id });
                    }
                }
            }
        }
        Ok(())
    }
}

/// A grant as SegmentAccess carries it, with the time it has left.
pub(crate) fn to_wire(grant: &Grant, left: Duration) -> pb::HoldGrant {
    pb::HoldGrant {
        planes: grant
            .planes()
            .map(|p| pb::GrantPlane {
                region_id: p.region.0,
                base: p.base,
                stride: p.stride,
                block_bytes: p.block_bytes,
            })
            .collect(),
        block_ids: grant.ids().to_vec(),
        expires_in_ms: u64::try_from(left.as_millis()).unwrap_or(u64::MAX),
    }
}

/// A grant from SegmentAccess, within the bounds a hold has (the segment's agent is a fabric
/// member, but what it sends is still checked before it is kept).
pub(crate) fn from_wire(g: pb::HoldGrant) -> std::result::Result<(Grant, Duration), String> {
    if g.planes.len() > MAX_HOLD_PLANES || g.block_ids.len() > MAX_HOLD_BLOCK_IDS {
        return Err(format!(
            "{} planes and {} block ids: more than a hold has",
            g.planes.len(),
            g.block_ids.len()
        ));
    }
    let left = Duration::from_millis(g.expires_in_ms.min(MAX_HOLD_TTL_MS));
    let planes = g.planes.into_iter().map(|p| GrantPlane {
        region: RegionId(p.region_id),
        base: p.base,
        stride: p.stride,
        block_bytes: p.block_bytes,
    });
    let grant = Grant::new(planes, g.block_ids).map_err(|(plane, why)| match plane {
        Some(i) => format!("planes[{i}]: {why}"),
        None => why.to_owned(),
    })?;
    Ok((grant, left))
}

/// Whether `len` bytes at `offset` lie inside one block of plane `p` whose id is in `ids`
/// (sorted, not empty), given `offset >= p.base`. Blocks may overlap (a stride shorter than a
/// block), so the ids whose block holds the range are a span, `lo..=hi`: one binary search
/// finds whether a granted id is in it. Checked arithmetic throughout.
fn plane_holds(p: &GrantPlane, ids: &[u64], offset: u64, len: u64) -> bool {
    let Some(into) = offset.checked_sub(p.base) else {
        return false;
    };
    let Some(reach) = into.checked_add(len) else {
        return false;
    };
    if p.stride == 0 {
        // Every id's block is the same bytes.
        return reach <= p.block_bytes;
    }
    // Block `id` starts at id × stride (from base) and ends block_bytes later: it holds the
    // range when id × stride <= into and reach <= id × stride + block_bytes.
    let hi = into / p.stride;
    let lo = reach.saturating_sub(p.block_bytes).div_ceil(p.stride);
    let first = ids.partition_point(|&id| id < lo);
    lo <= hi && ids.get(first).is_some_and(|&id| id <= hi)
}

/// A hold at the segment's agent.
#[derive(Debug)]
struct Hold {
    segment: String,
    /// The registration it was made on: a segment registered again under the same name is
    /// another one, and its holds are not this one's.
    owner: Weak<LocalSegment>,
    /// None once it is being ended (its grant is no longer handed out; the agents it was handed
    /// to are still to confirm).
    grant: Option<Arc<Grant>>,
    expires: Instant,
    /// Agents that were handed the grant and have not confirmed dropping it.
    granted: BTreeSet<String>,
}

impl Hold {
    fn of(&self, segment: &Arc<LocalSegment>) -> bool {
        self.owner.as_ptr() == Arc::as_ptr(segment)
    }
}

#[derive(Debug, Default)]
struct HoldTable {
    holds: HashMap<u64, Hold>,
    per_segment: HashMap<String, usize>,
    words: usize,
    live: usize,
}

impl HoldTable {
    fn remove(&mut self, key: u64) -> Option<Hold> {
        let hold = self.holds.remove(&key)?;
        if let Some(g) = &hold.grant {
            self.words -= g.words();
            self.live -= 1;
        }
        if let Some(n) = self.per_segment.get_mut(&hold.segment) {
            *n -= 1;
            if *n == 0 {
                self.per_segment.remove(&hold.segment);
            }
        }
        Some(hold)
    }

    /// Stops handing out `key`'s grant (it is being ended).
    fn retire(&mut self, key: u64) {
        if let Some(g) = self.holds.get_mut(&key).and_then(|h| h.grant.take()) {
            self.words -= g.words();
            self.live -= 1;
        }
    }
}

/// What ending a hold has to do.
#[derive(Debug)]
pub struct Ending {
    /// Agents to ask to drop their grant.
    pub agents: Vec<String>,
    /// Whether this call ended a live hold (rather than retrying one already being ended).
    pub was_live: bool,
}

/// The holds of the segments registered with this agent.
#[derive(Debug, Default)]
pub struct Holds {
    table: Mutex<HoldTable>,
}

/// How a sweep went.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Live holds that reached their expiry.
    pub expired: usize,
}

impl Holds {
    fn table(&self) -> std::sync::MutexGuard<'_, HoldTable> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Live holds (being ended ones not counted).
    pub fn live(&self) -> usize {
        self.table().live
    }

    /// Adds a hold on `segment` granting `grant` for `ttl`, and returns its key: random
    /// (`rand::random`, the thread's CSPRNG seeded from the OS), never 0, never a key in use
    /// by another hold, never one `taken` says is a segment's.
    pub fn create(
        &self,
        segment: &Arc<LocalSegment>,
        grant: Grant,
        ttl: Duration,
        taken: impl Fn(u64) -> bool,
    ) -> Result<u64> {
        let now = Instant::now();
        let mut t = self.table();
        // The server sweeps every second; at a limit, expired holds go first.
        let full = |t: &HoldTable| {
            t.holds.len() >= MAX_HOLDS_PER_AGENT
                || t.per_segment.get(&segment.name).copied().unwrap_or(0) >= MAX_HOLDS_PER_SEGMENT
                || t.words + grant.words() > MAX_HOLD_WORDS
        };
        if full(&t) {
            sweep_table(&mut t, now);
        }
        if t.holds.len() >= MAX_HOLDS_PER_AGENT {
            return Err(Error::Exhausted {
                resource: "holds at this agent",
                limit: MAX_HOLDS_PER_AGENT,
            });
        }
        if t.per_segment.get(&segment.name).copied().unwrap_or(0) >= MAX_HOLDS_PER_SEGMENT {
            return Err(Error::Exhausted {
                resource: "holds on this segment",
                limit: MAX_HOLDS_PER_SEGMENT,
            });
        }
        if t.words + grant.words() > MAX_HOLD_WORDS {
            return Err(Error::Exhausted {
                resource: "words of hold planes and block ids at this agent",
                limit: MAX_HOLD_WORDS,
            });
        }
        // 2^64 keys: a collision is all but impossible, but a key must never be ambiguous.
        let key = std::iter::repeat_with(rand::random::<u64>)
            .take(64)
            .find(|&k| k != 0 && k != segment.key.0 && !t.holds.contains_key(&k) && !taken(k))
            .ok_or_else(|| Error::io("hold key", std::io::Error::other("no free key drawn")))?;
        t.words += grant.words();
        t.live += 1;
        *t.per_segment.entry(segment.name.clone()).or_default() += 1;
        t.holds.insert(
            key,
            Hold {
                segment: segment.name.clone(),
                owner: Arc::downgrade(segment),
                grant: Some(Arc::new(grant)),
                expires: now + ttl,
                granted: BTreeSet::new(),
            },
        );
        Ok(key)
    }

    /// Moves a live hold's expiry to `ttl` from now, never earlier than it was (a reader's
    /// agent may hold the grant until the old expiry). Returns the time left.
    pub fn extend(&self, segment: &Arc<LocalSegment>, key: u64, ttl: Duration) -> Result<Duration> {
        let now = Instant::now();
        let mut t = self.table();
        let hold = t
            .holds
            .get_mut(&key)
            .filter(|h| h.of(segment) && h.grant.is_some() && h.expires > now)
            .ok_or_else(|| Error::NoSuchHold {
                segment: segment.name.clone(),
            })?;
        hold.expires = hold.expires.max(now + ttl);
        Ok(hold.expires - now)
    }

    /// The grant of live hold `key` on `segment` and its time left, recording `agent` as
    /// holding it; None when `key` is no live hold of the segment.
    pub fn access(
        &self,
        segment: &Arc<LocalSegment>,
        key: u64,
        agent: &str,
    ) -> Result<Option<(Arc<Grant>, Duration)>> {
        let now = Instant::now();
        let mut t = self.table();
        let Some(hold) = t.holds.get_mut(&key).filter(|h| h.of(segment)) else {
            return Ok(None);
        };
        let Some(grant) = hold.grant.clone().filter(|_| hold.expires > now) else {
            return Ok(None);
        };
        if !hold.granted.contains(agent) {
            if hold.granted.len() >= MAX_GRANTEES {
                return Err(Error::Exhausted {
                    resource: "agents one hold is handed to",
                    limit: MAX_GRANTEES,
                });
            }
            hold.granted.insert(agent.to_owned());
        }
        Ok(Some((grant, hold.expires - now)))
    }

    /// Starts ending hold `key` on `segment`: its grant is no longer handed out, and the
    /// agents it was handed to (and have not confirmed yet) are returned. None when there is
    /// no such hold (never issued, expired, ended and confirmed).
    pub fn begin_end(&self, segment: &Arc<LocalSegment>, key: u64) -> Option<Ending> {
        let mut t = self.table();
        let hold = t.holds.get(&key).filter(|h| h.of(segment))?;
        let was_live = hold.grant.is_some();
        let agents = hold.granted.iter().cloned().collect();
        t.retire(key);
        Some(Ending { agents, was_live })
    }

    /// `confirmed` dropped their grant of hold `key`; once every agent has, the hold is gone.
    /// Returns the time the hold has left when some have not.
    pub fn confirm(&self, key: u64, confirmed: &[String]) -> Option<Duration> {
        let mut t = self.table();
        let hold = t.holds.get_mut(&key)?;
        for a in confirmed {
            hold.granted.remove(a);
        }
        if hold.granted.is_empty() {
            t.remove(key);
            return None;
        }
        Some(hold.expires.saturating_duration_since(Instant::now()))
    }

    /// Drops the holds of a segment that is going away (its memory goes with it).
    pub fn drop_segment(&self, name: &str) {
        let mut t = self.table();
        let keys: Vec<u64> = t
            .holds
            .iter()
            .filter(|(_, h)| h.segment == name)
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            t.remove(k);
        }
    }

    /// Forgets holds past their expiry.
    pub fn sweep(&self) -> Swept {
        sweep_table(&mut self.table(), Instant::now())
    }
}

fn sweep_table(t: &mut HoldTable, now: Instant) -> Swept {
    let gone: Vec<(u64, bool)> = t
        .holds
        .iter()
        .filter(|(_, h)| h.expires <= now)
        .map(|(k, h)| (*k, h.grant.is_some()))
        .collect();
    let mut swept = Swept::default();
    for (k, live) in gone {
        t.remove(k);
        swept.expired += usize::from(live);
    }
    swept
}

/// Why a grant a reader's agent kept can no longer be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// The segment's agent revoked it (the hold was ended).
    Revoked,
    /// Taken out of the table (the key was not a hold's, the owner refused it, or it expired
    /// unused): a batch that finds its slot so asks again with a new one.
    Gone,
}

#[derive(Debug, Default)]
struct SlotState {
    grant: Option<Arc<Grant>>,
    expires: Option<Instant>,
    ended: Option<Ended>,
}

/// A grant at a reader's agent: (segment, hold key) and what the segment's agent said. The
/// slot is in the table before the question is sent, so a revocation that overtakes the answer
/// finds it and the answer is not used.
#[derive(Debug)]
pub struct GrantSlot {
    segment: String,
    key: u64,
    state: Mutex<SlotState>,
    /// Held while asking the segment's agent, so concurrent batches ask once.
    pub(crate) fetch: tokio::sync::Mutex<()>,
    /// Batches under the grant hold it shared (the engine keeps the guard until every piece
    /// is accounted for); a revocation takes it exclusively.
    pub(crate) uses: Arc<tokio::sync::RwLock<()>>,
}

/// A grant fit to use now.
#[derive(Debug, Clone)]
pub struct Usable {
    pub grant: Arc<Grant>,
    pub expires: Instant,
}

/// Why a grant cannot be used for a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unusable {
    /// Revoked, or expired on this agent's clock.
    Ended,
    /// Dropped from the table meanwhile: ask the segment's agent again.
    Retry,
}

impl GrantSlot {
    fn state(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The grant, if it has at least `left` to live and was not revoked.
    pub fn fresh(&self, left: Duration) -> Option<Usable> {
        let s = self.state();
        match (&s.grant, s.expires, s.ended) {
            (Some(grant), Some(expires), None)
                if expires.saturating_duration_since(Instant::now())
                    >= left.max(Duration::from_nanos(1)) =>
            {
                Some(Usable {
                    grant: grant.clone(),
                    expires,
                })
            }
            _ => None,
        }
    }

    /// The grant as a batch may use it now.
    pub fn usable(&self) -> std::result::Result<Usable, Unusable> {
        let s = self.state();
        match (s.ended, &s.grant, s.expires) {
            (Some(Ended::Gone), ..) => Err(Unusable::Retry),
            (Some(Ended::Revoked), ..) => Err(Unusable::Ended),
            (None, Some(grant), Some(expires)) if expires > Instant::now() => Ok(Usable {
                grant: grant.clone(),
                expires,
            }),
            _ => Err(Unusable::Ended),
        }
    }

    fn ended(&self) -> Option<Ended> {
        self.state().ended
    }
}

#[derive(Debug, Default)]
struct GrantTable {
    slots: HashMap<(String, u64), Arc<GrantSlot>>,
    words: usize,
}

/// The grants this agent was handed for its workers' batches.
#[derive(Debug, Default)]
pub struct Grants {
    table: Mutex<GrantTable>,
}

impl Grants {
    fn table(&self) -> std::sync::MutexGuard<'_, GrantTable> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The slot of (`segment`, `key`) if there is one.
    pub fn find(&self, segment: &str, key: u64) -> Option<Arc<GrantSlot>> {
        self.table().slots.get(&(segment.to_owned(), key)).cloned()
    }

    /// The slot of (`segment`, `key`), made if there is none.
    pub fn slot(&self, segment: &str, key: u64) -> Result<Arc<GrantSlot>> {
        let mut t = self.table();
        if let Some(s) = t.slots.get(&(segment.to_owned(), key)) {
            return Ok(s.clone());
        }
        if t.slots.len() >= MAX_GRANTS {
            sweep_grants(&mut t);
        }
        if t.slots.len() >= MAX_GRANTS {
            return Err(Error::Exhausted {
                resource: "hold grants at this agent",
                limit: MAX_GRANTS,
            });
        }
        let slot = Arc::new(GrantSlot {
            segment: segment.to_owned(),
            key,
            state: Mutex::default(),
            fetch: tokio::sync::Mutex::default(),
            uses: Arc::default(),
        });
        t.slots.insert((segment.to_owned(), key), slot.clone());
        Ok(slot)
    }

    /// Stores what the segment's agent granted. Refused (the slot dropped) when the grants'
    /// memory would pass [`MAX_HOLD_WORDS`].
    pub fn set(&self, slot: &Arc<GrantSlot>, grant: Arc<Grant>, expires: Instant) -> Result<()> {
        let mut t = self.table();
        let old = {
            let s = slot.state();
            if s.ended.is_some() {
                // Revoked (or dropped) while the question was out: the answer is not used, and
                // the batches that wait for it find the slot ended.
                return Ok(());
            }
            s.grant.as_ref().map_or(0, |g| g.words())
        };
        if t.words - old + grant.words() > MAX_HOLD_WORDS {
            sweep_grants(&mut t);
        }
        // The sweep may have taken this very slot out (expired, unused).
        let mut s = slot.state();
        if s.ended.is_some() {
            return Ok(());
        }
        let words = t.words - old + grant.words();
        if words > MAX_HOLD_WORDS {
            drop(s);
            take_out(&mut t, slot, Ended::Gone);
            return Err(Error::Exhausted {
                resource: "words of hold grants at this agent",
                limit: MAX_HOLD_WORDS,
            });
        }
        t.words = words;
        s.grant = Some(grant);
        s.expires = Some(expires);
        Ok(())
    }

    /// Takes `slot` out of the table (the key was no hold's, or the owner refused it): batches
    /// that still hold it ask again.
    pub fn discard(&self, slot: &Arc<GrantSlot>) {
        let mut t = self.table();
        if slot.uses.try_write().is_ok() {
            take_out(&mut t, slot, Ended::Gone);
            return;
        }
        // Batches still run under an earlier grant of this slot: it stays findable, so a
        // revocation still waits for them; no new batch uses it.
        let mut s = slot.state();
        if s.ended.is_none() {
            t.words -= s.grant.take().map_or(0, |g| g.words());
            s.expires = None;
        }
    }

    /// Drops the grant of (`segment`, `key`) — no batch starts under it any more — and waits
    /// up to `wait` for the batches under it to be accounted for. Ok at once when there is no
    /// such grant: nothing under it can be in flight here.
    pub async fn revoke(&self, segment: &str, key: u64, wait: Duration) -> Result<()> {
        let slot = {
            let mut t = self.table();
            let Some(slot) = t.slots.get(&(segment.to_owned(), key)).cloned() else {
                return Ok(());
            };
            take_out(&mut t, &slot, Ended::Revoked);
            slot
        };
        tokio::time::timeout(wait, slot.uses.write())
            .await
            .map(drop)
            .map_err(|_| Error::Deadline {
                during: "waiting for this agent's batches under the hold",
                millis: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            })
    }

    /// Forgets grants past their expiry that no batch uses.
    pub fn sweep(&self) {
        sweep_grants(&mut self.table());
    }

    /// Grants kept now.
    pub fn len(&self) -> usize {
        self.table().slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Removes `slot` from the table (if it is still the one there) and marks it `why`; a revoked
/// mark wins over a gone one.
fn take_out(t: &mut GrantTable, slot: &Arc<GrantSlot>, why: Ended) {
    let k = (slot.segment.clone(), slot.key);
    if t.slots.get(&k).is_some_and(|s| Arc::ptr_eq(s, slot)) {
        t.slots.remove(&k);
    }
    let mut s = slot.state();
    if s.ended != Some(Ended::Revoked) {
        if s.ended.is_none() {
            t.words -= s.grant.as_ref().map_or(0, |g| g.words());
        }
        s.ended = Some(why);
    }
}

fn sweep_grants(t: &mut GrantTable) {
    let now = Instant::now();
    let stale: Vec<Arc<GrantSlot>> = t
        .slots
        .values()
        .filter(|s| {
            let st = s.state();
            // Expired, or holding no grant (its key was no hold's while batches still ran
            // under an earlier grant); a slot being asked for is left to its asker, one in use
            // to its batches.
            st.expires.is_none_or(|e| e <= now)
                && s.fetch.try_lock().is_ok()
                && s.uses.try_write().is_ok()
        })
        .cloned()
        .collect();
    for s in stale {
        take_out(t, &s, Ended::Gone);
    }
}

/// Whether a batch should ask again after finding its slot gone.
pub(crate) fn slot_gone(slot: &GrantSlot) -> bool {
    slot.ended() == Some(Ended::Gone)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfabric_engine::{BlockOp, BlockPair, BlockTable, Plane, PlaneSide};

    fn plane(region: u64, base: u64, stride: u64, block_bytes: u64) -> GrantPlane {
        GrantPlane {
            region: RegionId(region),
            base,
            stride,
            block_bytes,
        }
    }

    fn op(region: u64, offset: u64, len: u64) -> BlockOp {
        BlockOp {
            local_region: RegionId(99),
            local_offset: 0,
            remote_region: RegionId(region),
            remote_offset: offset,
            len,
        }
    }

    fn list(ops: Vec<BlockOp>) -> BatchOps {
        BatchOps::List(ops)
    }

    fn table(remote: Vec<(u64, u64, u64, u64)>, ids: &[u32]) -> BatchOps {
        let side = |region, base, stride| PlaneSide {
            region: RegionId(region),
            base,
            stride,
        };
        BatchOps::Table(BlockTable {
            planes: remote
                .into_iter()
                .map(|(r, b, s, bb)| Plane {
                    local: side(99, 0, bb),
                    remote: side(r, b, s),
                    block_bytes: bb,
                })
                .collect(),
            blocks: ids
                .iter()
                .enumerate()
                .map(|(i, &id)| BlockPair {
                    local: i as u32,
                    remote: id,
                })
                .collect(),
        })
    }

    /// K and V of two layers: layer 0 in region 1 (K at 0, V at 100 blocks), layer 1 in
    /// region 2 with K and V interleaved in each 2-block stride. Blocks 3, 5 and 9 granted.
    fn kv() -> Grant {
        let bs = 4096;
        Grant::new(
            [
                plane(1, 0, bs, bs),
                plane(1, 100 * bs, bs, bs),
                plane(2, 0, 2 * bs, bs),
                plane(2, bs, 2 * bs, bs),
            ],
            vec![9, 3, 5, 3],
        )
        .unwrap()
    }

    #[test]
    fn ops_inside_granted_blocks_pass_and_any_byte_outside_is_refused() {
        let g = kvfabric_engine::BatchOps::List(Vec::new());
        assert!(kv().admits(&g).is_ok());
        let g = kv();
        let bs = 4096;
        assert_eq!(g.ids(), &[3, 5, 9]);
        // Whole blocks of each plane, and a part of one.
        let ok = list(vec![
            op(1, 3 * bs, bs),
            op(1, (100 + 9) * bs, bs),
            op(2, 2 * 5 * bs, bs),
            op(2, 2 * 5 * bs + bs, bs),
            op(1, 5 * bs + 100, 200),
        ]);
        assert_eq!(g.admits(&ok), Ok(()));
        for (bad, why) in [
            (op(1, 4 * bs, bs), "block 4 is not granted"),
            (op(1, 3 * bs + 1, bs), "one byte into block 4"),
            (op(1, 3 * bs - 1, 2), "one byte of block 2"),
            (
                op(2, 2 * 3 * bs, 2 * bs),
                "K and V of a block are two planes, not one range",
            ),
            (op(3, 3 * bs, bs), "region 3 is not granted"),
            (
                op(1, u64::MAX - 10, 20),
                "an op at the end of the address space",
            ),
            (op(1, (100 + 9) * bs, u64::MAX), "a length past 2^64"),
        ] {
            let ops = list(vec![op(1, 3 * bs, bs), bad]);
            assert_eq!(g.admits(&ops), Err(Outside::Op { index: 1 }), "{why}");
        }
    }

    #[test]
    fn tables_need_a_granted_plane_s_region_and_stride_and_granted_ids() {
        let g = kv();
        let bs = 4096;
        let ok = table(
            vec![(1, 0, bs, bs), (1, 100 * bs, bs, bs), (2, bs, 2 * bs, bs)],
            &[3, 9],
        );
        assert_eq!(g.admits(&ok), Ok(()));
        // Half a block, at an offset inside the granted one.
        assert_eq!(g.admits(&table(vec![(1, 512, bs, 1024)], &[5])), Ok(()));
        for (planes, ids, want) in [
            (
                vec![(1, 0, bs, bs)],
                vec![3, 4],
                Outside::Block { index: 1, id: 4 },
            ),
            (
                vec![(1, 0, 2 * bs, bs)],
                vec![3],
                Outside::Plane { index: 0 },
            ),
            (vec![(1, 1, bs, bs)], vec![3], Outside::Plane { index: 0 }),
            (vec![(1, bs, bs, bs)], vec![3], Outside::Plane { index: 0 }),
            (
                vec![(1, 0, bs, 2 * bs)],
                vec![3],
                Outside::Plane { index: 0 },
            ),
            (
                vec![(1, 0, bs, bs), (3, 0, bs, bs)],
                vec![3],
                Outside::Plane { index: 1 },
            ),
            (vec![(1, 0, 0, bs)], vec![3], Outside::Plane { index: 0 }),
        ] {
            assert_eq!(
                g.admits(&table(planes.clone(), &ids)),
                Err(want),
                "{planes:?} {ids:?}"
            );
        }
    }

    #[test]
    fn a_plane_whose_last_block_passes_2_64_is_refused_naming_it() {
        let e = Grant::new(
            [plane(1, 0, 4096, 4096), plane(1, 8, u64::MAX / 2, 1)],
            vec![0, 3],
        )
        .unwrap_err();
        assert_eq!(e.0, Some(1));
        assert!(Grant::new([plane(1, 0, 1, 1)], Vec::new()).is_err());
        assert!(Grant::new([], vec![1]).is_err());
        assert_eq!(
            Grant::new([plane(1, 0, 1, 0)], vec![1]).unwrap_err().0,
            Some(0)
        );
    }

    /// Every op the check admits lies in a granted block, and every op inside one is admitted,
    /// against a brute-force expansion of random grants.
    #[test]
    fn what_the_check_admits_is_exactly_the_granted_bytes() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(24);
        let mut admitted = 0;
        for _ in 0..2000 {
            let planes: Vec<GrantPlane> = (0..rng.random_range(1..5))
                .map(|_| {
                    plane(
                        rng.random_range(1..3),
                        rng.random_range(0..64),
                        rng.random_range(0..40),
                        rng.random_range(1..24),
                    )
                })
                .collect();
            let ids: Vec<u64> = (0..rng.random_range(1..5))
                .map(|_| rng.random_range(0..8))
                .collect();
            let g = Grant::new(planes.clone(), ids.clone()).unwrap();
            let granted = |r: u64, o: u64, l: u64| {
                planes.iter().any(|p| {
                    p.region == RegionId(r)
                        && ids.iter().any(|&i| {
                            let at = p.base + i * p.stride;
                            o >= at && o + l <= at + p.block_bytes
                        })
                })
            };
            for _ in 0..20 {
                let (r, o, l) = (
                    rng.random_range(1..3),
                    rng.random_range(0..300),
                    rng.random_range(1..12),
                );
                let ok = g.admits(&list(vec![op(r, o, l)])).is_ok();
                assert_eq!(ok, granted(r, o, l), "{planes:?} {ids:?} op {r} {o} {l}");
                admitted += usize::from(ok);
            }
        }
        assert!(admitted > 1500, "only {admitted}: the test says little");
    }

    fn segment(name: &str) -> Arc<LocalSegment> {
        Arc::new(LocalSegment {
            name: name.into(),
            key: kvfabric_engine::AccessKey(7),
            regions: Vec::new(),
            fabric_access: false,
            inbox: Default::default(),
        })
    }

    fn grant() -> Grant {
        Grant::new([plane(1, 0, 64, 64)], vec![1, 2]).unwrap()
    }

    #[test]
    fn holds_are_bounded_live_until_expiry_and_end_once_every_grantee_confirms() {
        let holds = Holds::default();
        let seg = segment("prefill-0");
        let other = segment("prefill-1");
        let k = holds
            .create(&seg, grant(), Duration::from_secs(60), |_| false)
            .unwrap();
        assert!(k != 0 && k != 7);
        assert_eq!(holds.live(), 1);
        // Only for its own segment, and recorded per agent.
        assert!(holds.access(&other, k, "b").unwrap().is_none());
        assert!(holds.access(&seg, k ^ 1, "b").unwrap().is_none());
        let (_, left) = holds.access(&seg, k, "node-b").unwrap().unwrap();
        assert!(left <= Duration::from_secs(60));
        holds.access(&seg, k, "node-c").unwrap().unwrap();
        // Extending never shortens.
        let left = holds.extend(&seg, k, Duration::from_millis(1)).unwrap();
        assert!(left > Duration::from_secs(59), "{left:?}");
        let ending = holds.begin_end(&seg, k).unwrap();
        assert_eq!(ending.agents, ["node-b", "node-c"]);
        assert!(ending.was_live);
        assert_eq!(holds.live(), 0);
        // No longer handed out, nor extended; one agent confirmed, one did not.
        assert!(holds.access(&seg, k, "node-d").unwrap().is_none());
        assert!(matches!(
            holds.extend(&seg, k, Duration::from_secs(1)),
            Err(Error::NoSuchHold { .. })
        ));
        assert!(holds.confirm(k, &["node-b".into()]).is_some());
        let again = holds.begin_end(&seg, k).unwrap();
        assert_eq!(again.agents, ["node-c"]);
        assert!(!again.was_live);
        assert!(holds.confirm(k, &["node-c".into()]).is_none());
        assert!(holds.begin_end(&seg, k).is_none());
        // Expiry.
        let k = holds
            .create(&seg, grant(), Duration::from_millis(1), |_| false)
            .unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(holds.access(&seg, k, "b").unwrap().is_none());
        assert_eq!(holds.sweep(), Swept { expired: 1 });
        assert_eq!(holds.live(), 0);
        // A key that is a segment's is never drawn: `taken` refusing all of them fails typed.
        assert!(
            holds
                .create(&seg, grant(), Duration::from_secs(1), |_| true)
                .is_err()
        );
    }

    #[test]
    fn a_segment_s_holds_are_bounded() {
        let holds = Holds::default();
        let seg = segment("s");
        for _ in 0..MAX_HOLDS_PER_SEGMENT {
            holds
                .create(&seg, grant(), Duration::from_secs(60), |_| false)
                .unwrap();
        }
        let e = holds
            .create(&seg, grant(), Duration::from_secs(60), |_| false)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Exhausted {
                    limit: MAX_HOLDS_PER_SEGMENT,
                    ..
                }
            ),
            "{e}"
        );
        // Another segment still gets some; dropping the segment frees its holds.
        holds
            .create(&segment("t"), grant(), Duration::from_secs(60), |_| false)
            .unwrap();
        holds.drop_segment("s");
        assert_eq!(holds.live(), 1);
    }

    #[tokio::test]
    async fn a_revocation_waits_for_batches_under_the_grant_and_ends_it() {
        let grants = Grants::default();
        let slot = grants.slot("s", 5).unwrap();
        let expires = Instant::now() + Duration::from_secs(60);
        grants.set(&slot, Arc::new(grant()), expires).unwrap();
        assert!(slot.fresh(Duration::from_secs(1)).is_some());
        let batch = slot.uses.clone().read_owned().await;
        // A batch in flight: the revocation waits for it, up to its deadline.
        let e = grants
            .revoke("s", 5, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Deadline { .. }), "{e}");
        assert_eq!(slot.usable().unwrap_err(), Unusable::Ended);
        assert!(grants.find("s", 5).is_none());
        drop(batch);
        drop(slot.uses.write().await);
        // A grant that never was: nothing to wait for.
        grants.revoke("s", 6, Duration::ZERO).await.unwrap();
        // A revocation that overtakes the answer: the answer is not used.
        let slot = grants.slot("s", 7).unwrap();
        grants.revoke("s", 7, Duration::from_secs(1)).await.unwrap();
        grants.set(&slot, Arc::new(grant()), expires).unwrap();
        assert_eq!(slot.usable().unwrap_err(), Unusable::Ended);
        assert!(grants.is_empty());
    }
}
