//! The faults a chaos run injects, one at a time.

use std::fmt;
use std::time::Duration;

/// One kind of fault. `target` picks the agent (or worker, or etcd member) it hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// SIGKILL an agent, start it again: its keys stay until its lease ends, its workers
    /// register again.
    AgentKill,
    /// SIGTERM an agent (it drains within its grace), start it again.
    AgentTerm,
    /// A worker dropped mid-pull with its connection (a killed process as its agent sees it),
    /// and a new one started in its place.
    WorkerKill,
    /// SIGKILL an etcd member (the leader every other time), start it again after a pause.
    EtcdMemberKill,
    /// Two agents' hosts drop what they send each other for a while, then heal.
    Blackhole,
    /// Every agent SIGKILLed at once and started again with nothing kept: a fabric-wide
    /// restart after a power cut.
    FullRestart,
}

impl Fault {
    pub const ALL: [Fault; 6] = [
        Fault::AgentKill,
        Fault::AgentTerm,
        Fault::WorkerKill,
        Fault::EtcdMemberKill,
        Fault::Blackhole,
        Fault::FullRestart,
    ];

    /// How long the fault lasts before it is lifted (a process down, a link cut).
    pub fn outage(self) -> Duration {
        match self {
            Fault::AgentKill | Fault::AgentTerm | Fault::FullRestart => Duration::from_secs(1),
            Fault::WorkerKill => Duration::ZERO,
            Fault::EtcdMemberKill => Duration::from_secs(3),
            Fault::Blackhole => Duration::from_secs(8),
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fault::AgentKill => "agent SIGKILL",
            Fault::AgentTerm => "agent SIGTERM",
            Fault::WorkerKill => "worker killed mid-pull",
            Fault::EtcdMemberKill => "etcd member SIGKILL",
            Fault::Blackhole => "peers blackholed",
            Fault::FullRestart => "every agent restarted",
        })
    }
}
