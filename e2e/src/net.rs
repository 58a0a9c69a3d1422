//! Network namespaces joined by veth pairs on one bridge: each agent gets its own "host" with its
//! own address, links can be cut and restored, their rate limited, and two hosts partitioned
//! from each other while both keep talking to the rest. Where namespaces cannot be
//! made (no root, no `ip`), every host is loopback and the test records a skip
//! (`kvfabric_testkit::skip`): in CI that fails it.

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use kvfabric_testkit::skip::{Why, skip};

/// One emulated machine.
#[derive(Debug, Clone)]
pub struct Host {
    /// Namespace name (None on the loopback fallback).
    pub netns: Option<String>,
    /// Its address on the bridge.
    pub ip: IpAddr,
    /// The veth end inside the namespace.
    dev: String,
}

#[derive(Debug)]
pub struct Network {
    bridge: Option<String>,
    /// The bridge's own address, reachable from every host (where etcd listens).
    pub gateway: IpAddr,
    pub hosts: Vec<Host>,
    /// Why namespaces are not used, when they are not.
    pub fallback: Option<String>,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

fn ip(args: &[&str]) -> Result<(), String> {
    run("ip", args)
}

fn tc(args: &[&str]) -> Result<(), String> {
    run("tc", args)
}

/// Runs `program` (of iproute2) with `args`; its stderr is the error.
fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let what = || format!("{program} {}", args.join(" "));
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{}: {e} (apt-get install iproute2)", what()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            what(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Network {
    /// `n` hosts on a fresh bridge, or loopback with a recorded skip (a failure in CI).
    #[track_caller]
    pub fn new(n: usize) -> Network {
        match Network::namespaces(n) {
            Ok(net) => net,
            Err(reason) => {
                skip(
                    Why::Missing("network namespaces"),
                    format!("{reason}; every host is loopback, links cannot be cut"),
                );
                Network {
                    bridge: None,
                    gateway: IpAddr::V4(Ipv4Addr::LOCALHOST),
                    hosts: (0..n)
                        .map(|_| Host {
                            netns: None,
                            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
                            dev: String::new(),
                        })
                        .collect(),
                    fallback: Some(reason),
                }
            }
        }
    }

    /// `n` hosts on a fresh bridge, each in its own namespace; why not, where they cannot be made.
    pub fn namespaces(n: usize) -> Result<Network, String> {
        if effective_uid() != 0 {
            return Err("not root".into());
        }
        // Unique per process and test, so tests can run in parallel (names ≤ 15 chars).
        // One number per network, taken once: tests that build networks at the same time must
        // not share a subnet (two bridges on one /24 route each other's packets away).
        let seq = NEXT.fetch_add(1, Ordering::Relaxed);
        let id = format!("{:x}{seq}", std::process::id() % 0xffff);
        let subnet = (std::process::id() % 200 + 20) as u8;
        let third = (seq % 250) as u8;
        let bridge = format!("kvb{id}");
        let gateway = Ipv4Addr::new(10, subnet, third, 1);
        let mut net = Network {
            bridge: Some(bridge.clone()),
            gateway: IpAddr::V4(gateway),
            hosts: Vec::new(),
            fallback: None,
        };
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{gateway}/24"), "dev", &bridge])?;
        ip(&["link", "set", &bridge, "up"])?;
        for i in 0..n {
            let ns = format!("kvn{id}h{i}");
            let outer = format!("kvv{id}h{i}");
            ip(&["netns", "add", &ns])?;
            // Pushed before the links exist, so Drop cleans up whatever was made.
            let addr = Ipv4Addr::new(10, subnet, third, 10 + i as u8);
            net.hosts.push(Host {
                netns: Some(ns.clone()),
                ip: IpAddr::V4(addr),
                dev: "eth0".into(),
            });
            ip(&[
                "link", "add", &outer, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["link", "set", &outer, "master", &bridge, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// Cuts (`up = false`) or restores a host's link.
    pub fn set_link(&self, host: usize, up: bool) -> Result<(), String> {
        let h = &self.hosts[host];
        let Some(ns) = &h.netns else {
            return Err("no namespaces: links cannot be cut on loopback".into());
        };
        ip(&[
            "-n",
            ns,
            "link",
            "set",
            &h.dev,
            if up { "up" } else { "down" },
        ])
    }

    /// Limits what `host` sends to `mbit` megabits per second (a token bucket on its link), so
    /// a batch it serves takes long enough to be watched and interrupted.
    pub fn limit_rate(&self, host: usize, mbit: u32) -> Result<(), String> {
        let h = &self.hosts[host];
        let Some(ns) = &h.netns else {
            return Err("no namespaces: rates cannot be limited on loopback".into());
        };
        let rate = format!("{mbit}mbit");
        tc(&[
            "-n", ns, "qdisc", "replace", "dev", &h.dev, "root", "tbf", "rate", &rate, "burst",
            "256kb", "latency", "100ms",
        ])
    }

    /// Partitions hosts `a` and `b` from each other, both ways, and nothing else: each drops
    /// what it sends to the other (a blackhole route for the other's address inside its
    /// namespace, more specific than the bridge's subnet route). New connections between them
    /// fail at once ("invalid argument"), open ones go silent; both keep reaching every other
    /// host, as a host cut off from etcd but not from its peers would.
    pub fn partition(&self, a: usize, b: usize) -> Result<(), String> {
        self.blackhole(a, b, "add")?;
        self.blackhole(b, a, "add")
    }

    /// Lifts [`Network::partition`]: connections that went silent carry on.
    pub fn heal(&self, a: usize, b: usize) -> Result<(), String> {
        self.blackhole(a, b, "del")?;
        self.blackhole(b, a, "del")
    }

    /// Adds (`add`) or removes (`del`) the route in `from`'s namespace that drops what it sends
    /// to `to`.
    fn blackhole(&self, from: usize, to: usize, verb: &str) -> Result<(), String> {
        let Some(ns) = &self.hosts[from].netns else {
            return Err("no namespaces: hosts cannot be partitioned on loopback".into());
        };
        let target = format!("{}/32", self.hosts[to].ip);
        ip(&["-n", ns, "route", verb, "blackhole", &target])
    }

    /// Lifts [`Network::limit_rate`].
    pub fn unlimit_rate(&self, host: usize) -> Result<(), String> {
        let h = &self.hosts[host];
        let Some(ns) = &h.netns else {
            return Err("no namespaces: rates cannot be limited on loopback".into());
        };
        tc(&["-n", ns, "qdisc", "del", "dev", &h.dev, "root"])
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for h in &self.hosts {
            if let Some(ns) = &h.netns {
                // Deleting the namespace deletes its veth end, and with it the pair.
                let _ = ip(&["netns", "del", ns]);
            }
        }
        if let Some(b) = &self.bridge {
            let _ = ip(&["link", "del", b]);
        }
    }
}

fn effective_uid() -> u32 {
    // `id -u` keeps this crate free of a libc binding for one call.
    Command::new("id")
        .arg("-u")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(u32::MAX)
}
