//! Pulls that run to completion on the binding's runtime, with no Python thread or event loop in
//! their path: each is a set of batches from the peers, then the read of one word (the peer's
//! hold still alive), then a record the caller collects with `take`. A vLLM worker's engine
//! thread keeps the GIL busy between steps; an asyncio loop that needed it at every completion
//! added milliseconds to each pull (the queue, each batch's answer, the check).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::agent::{Agent, Batch, TraceHeaders};
use crate::buffer::HostBuffer;
use crate::client::{Client, Ops, Segment, seconds, within};
use crate::error::{Error, Result, code_name};

/// What became of one pull.
#[pyclass(module = "kvfabric._native", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The id `start` was given.
    pub id: String,
    /// Bytes the batches moved (0 when a batch failed).
    pub bytes: u64,
    /// Empty when the pull is good; else why not: a gRPC status name in lower case
    /// (`"not_found"`, `"deadline_exceeded"`, ...) or `"hold_ended"`.
    pub reason: String,
    pub detail: String,
    /// From `start` to the batches' last answer, then the check's.
    pub read_us: u64,
    pub check_us: u64,
}

#[pymethods]
impl Pulled {
    fn __repr__(&self) -> String {
        format!(
            "Pulled(id={:?}, bytes={}, reason={:?}, read_us={}, check_us={})",
            self.id, self.bytes, self.reason, self.read_us, self.check_us
        )
    }
}

/// `Pulls(client)`: starts pulls and collects the finished ones.
#[pyclass(module = "kvfabric._native", frozen)]
#[derive(Debug)]
pub struct Pulls {
    agent: Agent,
    deadline: Duration,
    finished: Arc<Mutex<Vec<Pulled>>>,
}

/// A failed call's reason as the connector counts it.
fn reason(e: &Error) -> String {
    match e {
        Error::Agent { code, .. } => code_name(*code).to_lowercase(),
        Error::Unreachable { .. } => "unavailable".into(),
        Error::Invalid { .. } => "invalid_argument".into(),
        Error::Client(_) => "client".into(),
    }
}

/// One batch of a pull: (remote segment, its key, the ops).
type Read = (String, u64, Py<Ops>);

#[pymethods]
impl Pulls {
    #[new]
    fn new(client: &Client) -> Self {
        Pulls {
            agent: client.agent().clone(),
            deadline: client.deadline(),
            finished: Arc::default(),
        }
    }

    /// Starts pull `id` into segment `local`: every batch of `reads` at once (each may take
    /// `timeout` seconds), then, if all succeeded, `check` (`check_timeout` seconds), whose
    /// 8 bytes must land at offset `word` of `scratch` and equal `expect` there. Returns at
    /// once; the outcome comes from `take`.
    #[pyo3(signature = (id, local, reads, timeout, check, check_timeout, scratch, word, expect, traceparent=None, tracestate=None))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        py: Python<'_>,
        id: String,
        local: &Segment,
        reads: Vec<Read>,
        timeout: f64,
        check: Read,
        check_timeout: f64,
        scratch: &HostBuffer,
        word: u64,
        expect: u64,
        traceparent: Option<String>,
        tracestate: Option<String>,
    ) -> Result<()> {
        let read_limit = seconds("timeout", Some(timeout))?.unwrap_or(self.deadline);
        let check_limit = seconds("check_timeout", Some(check_timeout))?.unwrap_or(self.deadline);
        if word
            .checked_add(8)
            .is_none_or(|end| end > scratch.memory.len())
        {
            return Err(Error::invalid(
                "word",
                word,
                "8 bytes past it must lie in scratch",
            ));
        }
        let batch = |(remote, key, ops): &Read, limit: Duration| Batch {
            local_segment: local.name.clone(),
            local_key: local.key,
            remote_segment: remote.clone(),
            remote_key: *key,
            write: false,
            ops: ops.get().0.clone(),
            timeout_ms: limit.as_millis().max(1) as u64,
            checksum: false,
        };
        let batches: Vec<Batch> = reads.iter().map(|r| batch(r, read_limit)).collect();
        let check = batch(&check, check_limit);
        let trace = TraceHeaders {
            traceparent,
            tracestate,
        };
        let (agent, deadline, finished) =
            (self.agent.clone(), self.deadline, self.finished.clone());
        let scratch = scratch.memory.clone();
        let run = async move {
            let t0 = Instant::now();
            let mut out = Pulled {
                id,
                bytes: 0,
                reason: String::new(),
                detail: String::new(),
                read_us: 0,
                check_us: 0,
            };
            let calls: Vec<_> = batches
                .into_iter()
                .map(|b| {
                    let (agent, trace) = (agent.clone(), trace.clone());
                    tokio::spawn(async move {
                        within(read_limit + deadline, "Submit", agent.submit(b, &trace)).await
                    })
                })
                .collect();
            let mut failed = None;
            for call in calls {
                match call.await {
                    Ok(Ok(t)) => out.bytes += t.bytes,
                    Ok(Err(e)) => {
                        failed.get_or_insert((reason(&e), e.to_string()));
                    }
                    Err(e) => {
                        failed.get_or_insert(("internal".into(), e.to_string()));
                    }
                }
            }
            let t1 = Instant::now();
            out.read_us = (t1 - t0).as_micros() as u64;
            if failed.is_none() {
                match within(
                    check_limit + deadline,
                    "Submit",
                    agent.submit(check, &trace),
                )
                .await
                {
                    Ok(_) => {
                        // SAFETY: the agent wrote these 8 bytes before it answered, and nothing
                        // else writes this word while the pull that owns it is in flight.
                        let got = unsafe {
                            let at = scratch.as_slice().as_ptr().add(word as usize);
                            u64::from_ne_bytes(std::ptr::read_volatile(at.cast::<[u8; 8]>()))
                        };
                        if got != expect {
                            failed = Some((
                                "hold_ended".into(),
                                "the prefill's hold ended before the pull did".into(),
                            ));
                        }
                    }
                    Err(e) => failed = Some((reason(&e), format!("checking the hold: {e}"))),
                }
                out.check_us = t1.elapsed().as_micros() as u64;
            }
            if let Some((why, detail)) = failed {
                (out.bytes, out.reason, out.detail) = (0, why, detail);
            }
            finished.lock().unwrap_or_else(|p| p.into_inner()).push(out);
        };
        py.detach(|| crate::client::runtime().spawn(run));
        Ok(())
    }

    /// The pulls finished since the last call, in the order they finished.
    fn take(&self) -> Vec<Pulled> {
        std::mem::take(&mut *self.finished.lock().unwrap_or_else(|p| p.into_inner()))
    }
}
