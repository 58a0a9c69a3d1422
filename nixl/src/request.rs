//! A NIXL transfer request: descriptors checked and planned into one agent batch per (local
//! segment, remote segment) pair when NIXL prepares it, posted as often as NIXL posts it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvfabric_client::{Client, FABRIC_KEY, Op, SubmitOptions, pb::Opcode};

use crate::backend::{Backend, Local, Md, Remote};
use crate::metadata::Span;
use crate::status::{Error, Result, Status};

/// Most ops in one batch (the agent's default limit is 65 536).
const MAX_BATCH_OPS: usize = 32_768;

/// One descriptor pair as NIXL hands it over.
#[derive(Debug, Clone, Copy)]
pub struct Desc<'a> {
    pub addr: u64,
    pub len: u64,
    pub md: Option<&'a Md>,
}

#[derive(Debug)]
struct Planned {
    local: Arc<Local>,
    remote: Arc<Remote>,
    ops: Vec<Op>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Prepared,
    Running,
    Done,
    Failed(Status),
}

#[derive(Debug)]
pub struct Request {
    opcode: Opcode,
    remote_agent: String,
    batches: Arc<Vec<Planned>>,
    state: Arc<Mutex<State>>,
}

impl Request {
    /// Checks every descriptor against the memory it names and plans the batches.
    pub fn prepare(
        read: bool,
        local: &[Desc<'_>],
        remote: &[Desc<'_>],
        remote_agent: &str,
    ) -> Result<Request> {
        if local.len() != remote.len() {
            return Err(Error::Mismatch {
                index: local.len().min(remote.len()),
                reason: format!(
                    "{} local descriptors for {} remote ones",
                    local.len(),
                    remote.len()
                ),
            });
        }
        let mut groups: HashMap<(usize, usize), usize> = HashMap::new();
        let mut batches: Vec<Planned> = Vec::new();
        for (index, (l, r)) in local.iter().zip(remote).enumerate() {
            let mismatch = |reason: String| Error::Mismatch { index, reason };
            let (Some(Md::Local(lm)), Some(Md::Remote(rm))) = (l.md, r.md) else {
                return Err(mismatch(
                    "the local side must be memory registered here and the remote side a \
                     peer's loaded metadata"
                        .into(),
                ));
            };
            if rm.agent != remote_agent {
                return Err(mismatch(format!(
                    "remote memory of agent {:?}, not {remote_agent:?}",
                    rm.agent
                )));
            }
            if l.len != r.len || l.len == 0 {
                return Err(mismatch(format!(
                    "{} local bytes for {} remote",
                    l.len, r.len
                )));
            }
            let local_at = inside(l, lm.addr, lm.len).ok_or_else(|| {
                mismatch(format!(
                    "local {:#x}+{} is outside its registration {:#x}+{}",
                    l.addr, l.len, lm.addr, lm.len
                ))
            })?;
            let remote_at = inside(r, rm.addr, rm.len).ok_or_else(|| {
                mismatch(format!(
                    "remote {:#x}+{} is outside its registration {:#x}+{}",
                    r.addr, r.len, rm.addr, rm.len
                ))
            })?;
            let key = (Arc::as_ptr(lm) as usize, Arc::as_ptr(rm) as usize);
            for op in split(&lm.pieces, local_at, &rm.pieces, remote_at, l.len) {
                let at = match groups.get(&key) {
                    Some(&i) if batches[i].ops.len() < MAX_BATCH_OPS => i,
                    _ => {
                        batches.push(Planned {
                            local: lm.clone(),
                            remote: rm.clone(),
                            ops: Vec::new(),
                        });
                        groups.insert(key, batches.len() - 1);
                        batches.len() - 1
                    }
                };
                batches[at].ops.push(op);
            }
        }
        Ok(Request {
            opcode: if read { Opcode::Read } else { Opcode::Write },
            remote_agent: remote_agent.into(),
            batches: Arc::new(batches),
            state: Arc::new(Mutex::new(State::Prepared)),
        })
    }

    /// Starts the batches (all at once); `notification`, if any, goes to the remote agent once
    /// every byte has landed. A failed transfer sends none.
    pub fn post(&self, backend: &Backend, notification: Option<Vec<u8>>) -> Result<Status> {
        let inbox = match &notification {
            Some(_) => Some(backend.inbox_of(&self.remote_agent)?),
            None => None,
        };
        {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if *state == State::Running {
                return Err(Error::Running);
            }
            *state = State::Running;
        }
        let (client, batches, state) = (
            backend.client.clone(),
            self.batches.clone(),
            self.state.clone(),
        );
        let (opcode, sender) = (self.opcode, backend.agent.clone());
        backend.rt.spawn(async move {
            let outcome = run(&client, opcode, batches).await;
            let outcome = match (outcome, inbox, notification) {
                (Ok(()), Some(inbox), Some(message)) => client
                    .notify(&inbox, FABRIC_KEY, &sender, &message)
                    .await
                    .map_err(Error::Agent),
                (outcome, ..) => outcome,
            };
            let done = match outcome {
                Ok(()) => State::Done,
                Err(e) => {
                    eprintln!("kvfabric-nixl: transfer: {e}");
                    State::Failed(e.status())
                }
            };
            *state.lock().unwrap_or_else(|e| e.into_inner()) = done;
        });
        Ok(Status::InProgress)
    }

    pub fn check(&self) -> Status {
        match *self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            State::Prepared => Status::NotPosted,
            State::Running => Status::InProgress,
            State::Done => Status::Success,
            State::Failed(s) => s,
        }
    }

    pub fn running(&self) -> bool {
        self.check() == Status::InProgress
    }
}

/// Where descriptor `d` starts in the registered `[addr, addr + len)`, when it lies inside.
fn inside(d: &Desc<'_>, addr: u64, len: u64) -> Option<u64> {
    let from = d.addr.checked_sub(addr)?;
    (from.checked_add(d.len)? <= len).then_some(from)
}

/// The ops moving `len` bytes from `local_at` of a range made of `local` pieces to (or from)
/// `remote_at` of one made of `remote` pieces: one op per stretch that lies in one piece on
/// both sides. The pieces cover their ranges (checked when they were made or parsed).
fn split(local: &[Span], local_at: u64, remote: &[Span], remote_at: u64, len: u64) -> Vec<Op> {
    let mut out = Vec::new();
    let (mut l, mut r) = (Cursor::at(local, local_at), Cursor::at(remote, remote_at));
    let mut left = len;
    while left > 0 {
        let (Some((ls, lw)), Some((rs, rw))) = (l.here(), r.here()) else {
            break;
        };
        let n = left.min(ls.len - lw).min(rs.len - rw);
        out.push(Op {
            local_region: ls.region,
            local_offset: ls.offset + lw,
            remote_region: rs.region,
            remote_offset: rs.offset + rw,
            len: n,
        });
        l.advance(n);
        r.advance(n);
        left -= n;
    }
    out
}

/// A position in a range made of pieces: the piece, and how far into it.
struct Cursor<'a> {
    pieces: &'a [Span],
    piece: usize,
    within: u64,
}

impl<'a> Cursor<'a> {
    fn at(pieces: &'a [Span], mut at: u64) -> Cursor<'a> {
        let mut piece = 0;
        while piece < pieces.len() && at >= pieces[piece].len {
            at -= pieces[piece].len;
            piece += 1;
        }
        Cursor {
            pieces,
            piece,
            within: at,
        }
    }
    fn here(&self) -> Option<(Span, u64)> {
        self.pieces.get(self.piece).map(|&s| (s, self.within))
    }
    fn advance(&mut self, n: u64) {
        self.within += n;
        if self
            .pieces
            .get(self.piece)
            .is_some_and(|s| self.within >= s.len)
        {
            self.piece += 1;
            self.within = 0;
        }
    }
}

/// Submits every batch at once; the first failure is the request's. One batch (the usual case:
/// one registration on each side) is awaited here, without a task of its own.
async fn run(client: &Client, opcode: Opcode, batches: Arc<Vec<Planned>>) -> Result<()> {
    if let [only] = batches.as_slice() {
        return submit(client, opcode, only).await;
    }
    let mut running = tokio::task::JoinSet::new();
    for i in 0..batches.len() {
        let (client, batches) = (client.clone(), batches.clone());
        running.spawn(async move { submit(&client, opcode, &batches[i]).await });
    }
    let mut first = None;
    while let Some(done) = running.join_next().await {
        let outcome = done.unwrap_or_else(|e| {
            Err(Error::Invalid {
                field: "batch task",
                reason: e.to_string(),
            })
        });
        if let Err(e) = outcome {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

async fn submit(client: &Client, opcode: Opcode, b: &Planned) -> Result<()> {
    let (local, remote) = (&b.local.segment, &b.remote.segment);
    client
        .submit(
            local,
            remote,
            FABRIC_KEY,
            opcode,
            &b.ops,
            SubmitOptions::default(),
        )
        .await
        .map(|_| ())
        .map_err(Error::Agent)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(agent: &str, addr: u64, len: u64) -> Md {
        Md::Remote(Arc::new(Remote {
            agent: agent.into(),
            segment: "nixl.p.1".into(),
            addr,
            len,
            pieces: vec![span(len, 0, 16)],
        }))
    }

    fn span(len: u64, region: u32, offset: u64) -> Span {
        Span {
            len,
            region,
            offset,
        }
    }

    #[test]
    fn a_stretch_over_pieces_becomes_one_op_per_piece_pair() {
        let local = [span(100, 0, 4000), span(50, 1, 0)];
        let remote = [span(30, 2, 7), span(200, 0, 0)];
        let ops = split(&local, 90, &remote, 20, 40);
        let got: Vec<_> = ops
            .iter()
            .map(|o| {
                (
                    o.local_region,
                    o.local_offset,
                    o.remote_region,
                    o.remote_offset,
                    o.len,
                )
            })
            .collect();
        // local 90..100 in piece 0, then piece 1; remote 20..30 in piece 0, then piece 1.
        assert_eq!(got, [(0, 4090, 2, 27, 10), (1, 0, 0, 0, 30)]);
        assert_eq!(ops.iter().map(|o| o.len).sum::<u64>(), 40);
        let whole = split(&local, 0, &remote, 0, 150);
        assert_eq!(whole.iter().map(|o| o.len).sum::<u64>(), 150);
    }

    #[test]
    fn a_descriptor_outside_its_registration_or_of_another_agent_is_refused() {
        let r = remote("P", 0x10_000, 4096);
        let d = |addr, len, md| Desc {
            addr,
            len,
            md: Some(md),
        };
        // Both sides remote: the local side must be ours.
        let e =
            Request::prepare(true, &[d(0x10_000, 8, &r)], &[d(0x10_000, 8, &r)], "P").unwrap_err();
        assert_eq!(e.status(), Status::Mismatch, "{e}");
        let e = Request::prepare(true, &[], &[d(0x10_000, 8, &r)], "P").unwrap_err();
        assert!(e.to_string().contains("0 local descriptors"), "{e}");
        let none = Desc {
            addr: 0,
            len: 8,
            md: None,
        };
        assert!(Request::prepare(true, &[none], &[none], "P").is_err());
        let past = d(0x10_000 + 4090, 8, &r);
        assert_eq!(inside(&past, 0x10_000, 4096), None);
        let wrap = d(u64::MAX - 2, 8, &r);
        assert_eq!(inside(&wrap, 0x10_000, 4096), None);
        let before = d(0x0fff0, 8, &r);
        assert_eq!(inside(&before, 0x10_000, 4096), None);
        let ok = d(0x10_000 + 4088, 8, &r);
        assert_eq!(inside(&ok, 0x10_000, 4096), Some(4088));
    }
}
