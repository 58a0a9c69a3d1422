//! Which RDMA ports this process may use, and which GID each uses: the allowed-device filter,
//! the GID choice (RoCE v2 preferred, overridable), and the combination of both with what the
//! pod was allocated. Every port left out is listed with the reason, so an empty result is
//! never a mystery.

use std::collections::BTreeSet;
use std::str::FromStr;

use serde::Serialize;

use super::sysfs::{GidEntry, GidKind, LinkLayer, Nic, Port};
use crate::error::{Error, Result};

/// Which GID of a port a connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GidChoice {
    /// InfiniBand: the port's IB GID. Ethernet: a RoCE v2 GID, IPv4-mapped first, then global
    /// IPv6, then link-local; RoCE v1 only when the port has no v2 GID at all.
    #[default]
    Auto,
    /// Exactly this index of the GID table (what `NCCL_IB_GID_INDEX`-style overrides pin).
    Index(u32),
}

impl FromStr for GidChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "auto" | "" => Ok(GidChoice::Auto),
            n => n
                .parse()
                .map(GidChoice::Index)
                .map_err(|_| Error::InvalidConfig {
                    field: "rdma_gid_index",
                    value: s.into(),
                    reason: "expected auto or a GID table index",
                }),
        }
    }
}

/// How good a RoCE GID is for `Auto` (lower is better).
fn roce_rank(g: &GidEntry) -> Option<(u8, u8)> {
    let kind = match g.kind {
        GidKind::RoceV2 => 0,
        GidKind::RoceV1 => 1,
        _ => return None,
    };
    let family = if g.gid.ipv4().is_some() {
        0
    } else if !g.gid.is_link_local() {
        1
    } else {
        2
    };
    Some((kind, family))
}

fn describe(g: &GidEntry) -> String {
    let addr = match g.gid.ipv4() {
        Some(v4) => v4.to_string(),
        None => std::net::Ipv6Addr::from(g.gid.0).to_string(),
    };
    match &g.netdev {
        Some(nd) => format!("GID {} ({}, {addr} on {nd})", g.index, g.kind),
        None => format!("GID {} ({}, {addr})", g.index, g.kind),
    }
}

/// The GID `port` of device `nic` uses under `choice`, with the reason in words.
pub fn select_gid<'p>(
    nic: &str,
    port: &'p Port,
    choice: GidChoice,
) -> Result<(&'p GidEntry, String)> {
    let err = |reason: String| Error::RdmaPort {
        device: nic.into(),
        port: port.port,
        reason,
    };
    if let GidChoice::Index(i) = choice {
        let populated: Vec<String> = port.gids.iter().map(|g| g.index.to_string()).collect();
        let g = port.gid(i).ok_or_else(|| {
            err(format!(
                "rdma_gid_index {i} is empty or out of range (populated: {})",
                if populated.is_empty() {
                    "none".into()
                } else {
                    populated.join(", ")
                }
            ))
        })?;
        return Ok((g, format!("{} (configured)", describe(g))));
    }
    match port.link_layer {
        LinkLayer::InfiniBand => {
            let g = port
                .gids
                .iter()
                .find(|g| g.kind == GidKind::Ib)
                .ok_or_else(|| err("InfiniBand port has no populated IB GID".into()))?;
            Ok((g, format!("{} (InfiniBand)", describe(g))))
        }
        LinkLayer::Ethernet => {
            let g = port
                .gids
                .iter()
                .filter_map(|g| roce_rank(g).map(|r| (r, g.index, g)))
                .min_by_key(|(r, i, _)| (*r, *i))
                .map(|(_, _, g)| g)
                .ok_or_else(|| err("Ethernet port has no populated RoCE GID".into()))?;
            let why = match roce_rank(g) {
                Some((0, 0)) => "RoCE v2, IPv4",
                Some((0, 1)) => "RoCE v2, no IPv4 GID: global IPv6",
                Some((0, _)) => "RoCE v2, only a link-local GID: not routable beyond the subnet",
                _ => "no RoCE v2 GID: RoCE v1 is not routable",
            };
            Ok((g, format!("{} ({why})", describe(g))))
        }
        LinkLayer::Other(ref l) => Err(err(format!(
            "link layer {l:?} is not InfiniBand or Ethernet"
        ))),
    }
}

/// The devices (and optionally ports) this process may use: `mlx5_0,mlx5_1:1` allows only those,
/// `^mlx5_2` excludes one, and both mix (`mlx5_0,mlx5_1,^mlx5_1:2`). Names match exactly (no
/// prefix matching: `mlx5_1` does not allow `mlx5_10`). Empty allows everything.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceFilter {
    include: Vec<(String, Option<u32>)>,
    exclude: Vec<(String, Option<u32>)>,
}

impl FromStr for DeviceFilter {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &'static str| Error::InvalidConfig {
            field: "rdma_devices",
            value: s.into(),
            reason,
        };
        let mut f = DeviceFilter::default();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (exclude, entry) = match entry.strip_prefix('^') {
                Some(rest) => (true, rest.trim()),
                None => (false, entry),
            };
            let (name, port) = match entry.split_once(':') {
                Some((n, p)) => {
                    let p: u32 = p
                        .parse()
                        .ok()
                        .filter(|p| *p >= 1)
                        .ok_or_else(|| bad("a port after ':' must be a number from 1"))?;
                    (n, Some(p))
                }
                None => (entry, None),
            };
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
            {
                return Err(bad("device names are letters, digits, '_', '-' or '.'"));
            }
            let item = (name.to_string(), port);
            if exclude {
                f.exclude.push(item);
            } else {
                f.include.push(item);
            }
        }
        Ok(f)
    }
}

impl DeviceFilter {
    fn matches(list: &[(String, Option<u32>)], nic: &str, port: u32) -> bool {
        list.iter()
            .any(|(n, p)| n == nic && p.is_none_or(|p| p == port))
    }

    pub fn allows(&self, nic: &str, port: u32) -> bool {
        (self.include.is_empty() || Self::matches(&self.include, nic, port))
            && !Self::matches(&self.exclude, nic, port)
    }

    pub fn is_empty(&self) -> bool {
        self.include.is_empty() && self.exclude.is_empty()
    }
}

/// A port this process can use, with the GID it will use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UsablePort {
    pub nic: String,
    pub port: u32,
    pub gid: GidEntry,
    pub gid_reason: String,
}

/// What `usable_ports` found: the ports, and every port it left out with the reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Usable {
    pub ports: Vec<UsablePort>,
    pub skipped: Vec<String>,
}

/// The ports of `nics` that are active, allowed by `filter`, among the devices the pod was
/// allocated (`allocated`, None outside a pod or when nothing restricts), and that have a GID
/// under `choice`.
pub fn usable_ports(
    nics: &[Nic],
    filter: &DeviceFilter,
    allocated: Option<&BTreeSet<String>>,
    choice: GidChoice,
) -> Usable {
    let mut u = Usable::default();
    for nic in nics {
        if let Some(a) = allocated
            && !a.contains(&nic.name)
        {
            u.skipped
                .push(format!("{}: not allocated to this pod", nic.name));
            continue;
        }
        if nic.ports.is_empty() {
            u.skipped.push(format!("{}: no ports", nic.name));
        }
        for port in &nic.ports {
            let at = format!("{} port {}", nic.name, port.port);
            if !filter.allows(&nic.name, port.port) {
                u.skipped.push(format!("{at}: excluded by rdma_devices"));
            } else if !port.state.is_active() {
                u.skipped.push(format!("{at}: state {}", port.state));
            } else {
                match select_gid(&nic.name, port, choice) {
                    Ok((gid, reason)) => u.ports.push(UsablePort {
                        nic: nic.name.clone(),
                        port: port.port,
                        gid: gid.clone(),
                        gid_reason: reason,
                    }),
                    Err(e) => u.skipped.push(format!("{at}: {e}")),
                }
            }
        }
    }
    u
}

#[cfg(test)]
mod tests {
    use super::super::sysfs::{self, fixture::FakeSysfs};
    use super::*;

    fn node() -> (tempfile::TempDir, Vec<Nic>) {
        let dir = tempfile::tempdir().unwrap();
        let fs = FakeSysfs::new(dir.path());
        // RoCE NIC with v1/v2 link-local, v2 IPv6 global and v2 IPv4 entries.
        fs.nic("mlx5_0", &["pci0000:3a", "0000:3a:00.0", "0000:3b:00.0"], 0);
        fs.port("mlx5_0", 1, "4: ACTIVE", "Ethernet", 0);
        fs.gid("mlx5_0", 1, 0, "fe80::1", "IB/RoCE v1", "ens1");
        fs.gid("mlx5_0", 1, 1, "fe80::1", "RoCE v2", "ens1");
        fs.gid("mlx5_0", 1, 2, "2001:db8::5", "IB/RoCE v1", "ens1");
        fs.gid("mlx5_0", 1, 3, "2001:db8::5", "RoCE v2", "ens1");
        fs.gid("mlx5_0", 1, 4, "::ffff:10.0.0.5", "IB/RoCE v1", "ens1");
        fs.gid("mlx5_0", 1, 5, "::ffff:10.0.0.5", "RoCE v2", "ens1");
        // RoCE NIC with only link-local v2 and v1.
        fs.nic("mlx5_1", &["pci0000:3a", "0000:3a:02.0", "0000:3c:00.0"], 0);
        fs.port("mlx5_1", 1, "4: ACTIVE", "Ethernet", 0);
        fs.gid("mlx5_1", 1, 0, "fe80::2", "IB/RoCE v1", "ens2");
        fs.gid("mlx5_1", 1, 1, "fe80::2", "RoCE v2", "ens2");
        // RoCE v1 only (old kernel or v1-only config).
        fs.nic("mlx4_0", &["pci0000:00", "0000:00:03.0"], 0);
        fs.port("mlx4_0", 1, "4: ACTIVE", "Ethernet", 0);
        fs.gid("mlx4_0", 1, 0, "fe80::3", "IB/RoCE v1", "ens3");
        // InfiniBand, two ports, one down.
        fs.nic("mlx5_2", &["pci0000:d7", "0000:d7:00.0", "0000:d8:00.0"], 1);
        fs.port("mlx5_2", 1, "4: ACTIVE", "InfiniBand", 7);
        fs.gid("mlx5_2", 1, 0, "fe80::0c42:a103:65:1a2b", "IB/RoCE v1", "");
        fs.port("mlx5_2", 2, "1: DOWN", "InfiniBand", 0);
        // Active Ethernet port without any GID (no IP configured).
        fs.nic("mlx5_3", &["pci0000:d7", "0000:d7:02.0", "0000:d9:00.0"], 1);
        fs.port("mlx5_3", 1, "4: ACTIVE", "Ethernet", 0);
        let nics = sysfs::nics(dir.path()).unwrap();
        (dir, nics)
    }

    fn port<'a>(nics: &'a [Nic], name: &str, port: u32) -> &'a Port {
        nics.iter()
            .find(|n| n.name == name)
            .unwrap()
            .port(port)
            .unwrap()
    }

    #[test]
    fn auto_prefers_roce_v2_ipv4_then_global_then_link_local_then_v1() {
        let (_d, nics) = node();
        let (g, why) = select_gid("mlx5_0", port(&nics, "mlx5_0", 1), GidChoice::Auto).unwrap();
        assert_eq!(g.index, 5);
        assert!(
            why.contains("RoCE v2, IPv4") && why.contains("10.0.0.5"),
            "{why}"
        );

        let mut p = port(&nics, "mlx5_0", 1).clone();
        p.gids.retain(|g| g.index != 5);
        let (g, why) = select_gid("mlx5_0", &p, GidChoice::Auto).unwrap();
        assert_eq!(g.index, 3, "{why}");
        assert!(why.contains("global IPv6"), "{why}");

        let (g, why) = select_gid("mlx5_1", port(&nics, "mlx5_1", 1), GidChoice::Auto).unwrap();
        assert_eq!(g.index, 1);
        assert!(why.contains("link-local"), "{why}");

        let (g, why) = select_gid("mlx4_0", port(&nics, "mlx4_0", 1), GidChoice::Auto).unwrap();
        assert_eq!((g.index, g.kind.clone()), (0, GidKind::RoceV1));
        assert!(why.contains("not routable"), "{why}");
    }

    #[test]
    fn infiniband_uses_its_ib_gid() {
        let (_d, nics) = node();
        let (g, why) = select_gid("mlx5_2", port(&nics, "mlx5_2", 1), GidChoice::Auto).unwrap();
        assert_eq!((g.index, g.kind.clone()), (0, GidKind::Ib));
        assert!(why.contains("InfiniBand"), "{why}");
    }

    #[test]
    fn an_override_pins_the_index_or_names_what_exists() {
        let (_d, nics) = node();
        let p = port(&nics, "mlx5_0", 1);
        let (g, why) = select_gid("mlx5_0", p, "3".parse().unwrap()).unwrap();
        assert_eq!(g.index, 3);
        assert!(why.contains("configured"), "{why}");
        let err = select_gid("mlx5_0", p, GidChoice::Index(9)).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("mlx5_0 port 1") && msg.contains("rdma_gid_index 9"),
            "{msg}"
        );
        assert!(msg.contains("0, 1, 2, 3, 4, 5"), "{msg}");
        let err = select_gid("mlx5_3", port(&nics, "mlx5_3", 1), GidChoice::Index(0)).unwrap_err();
        assert!(err.to_string().contains("populated: none"), "{err}");
        assert!("auto".parse::<GidChoice>().unwrap() == GidChoice::Auto);
        let err = "three".parse::<GidChoice>().unwrap_err();
        assert!(err.to_string().contains("rdma_gid_index") && err.to_string().contains("three"));
    }

    #[test]
    fn a_port_without_gids_is_an_error_not_a_panic() {
        let (_d, nics) = node();
        let err = select_gid("mlx5_3", port(&nics, "mlx5_3", 1), GidChoice::Auto).unwrap_err();
        assert!(err.to_string().contains("no populated RoCE GID"), "{err}");
        let mut p = port(&nics, "mlx5_2", 1).clone();
        p.link_layer = LinkLayer::Other("OPA".into());
        assert!(select_gid("hfi1_0", &p, GidChoice::Auto).is_err());
    }

    #[test]
    fn filters_parse_include_exclude_and_ports() {
        let f: DeviceFilter = "mlx5_0, mlx5_2:1".parse().unwrap();
        assert!(f.allows("mlx5_0", 1) && f.allows("mlx5_0", 2));
        assert!(f.allows("mlx5_2", 1) && !f.allows("mlx5_2", 2));
        assert!(!f.allows("mlx5_1", 1));
        assert!(!f.allows("mlx5_00", 1), "exact names, no prefix match");
        let f: DeviceFilter = "^mlx5_1".parse().unwrap();
        assert!(f.allows("mlx5_0", 1) && !f.allows("mlx5_1", 1) && f.allows("mlx5_10", 1));
        let f: DeviceFilter = "mlx5_0,^mlx5_0:2".parse().unwrap();
        assert!(f.allows("mlx5_0", 1) && !f.allows("mlx5_0", 2));
        let f: DeviceFilter = "".parse().unwrap();
        assert!(f.is_empty() && f.allows("anything", 3));
        for bad in ["mlx5_0:x", "mlx5_0:0", "^", "a b", "mlx5_0:"] {
            let err = bad.parse::<DeviceFilter>().unwrap_err();
            assert!(err.to_string().contains("rdma_devices"), "{bad}: {err}");
        }
    }

    #[test]
    fn usable_ports_combine_filter_allocation_state_and_gid_with_reasons() {
        let (_d, nics) = node();
        let u = usable_ports(&nics, &DeviceFilter::default(), None, GidChoice::Auto);
        let names: Vec<String> = u
            .ports
            .iter()
            .map(|p| format!("{}:{}", p.nic, p.port))
            .collect();
        assert_eq!(names, ["mlx4_0:1", "mlx5_0:1", "mlx5_1:1", "mlx5_2:1"]);
        assert!(
            u.skipped
                .iter()
                .any(|s| s.contains("mlx5_2 port 2: state DOWN")),
            "{:?}",
            u.skipped
        );
        assert!(
            u.skipped
                .iter()
                .any(|s| s.contains("mlx5_3 port 1") && s.contains("no populated"))
        );

        let allocated: BTreeSet<String> = ["mlx5_0".to_string(), "mlx5_2".into()].into();
        let filter: DeviceFilter = "^mlx5_2".parse().unwrap();
        let u = usable_ports(&nics, &filter, Some(&allocated), GidChoice::Auto);
        assert_eq!(u.ports.len(), 1);
        assert_eq!(
            (u.ports[0].nic.as_str(), u.ports[0].gid.index),
            ("mlx5_0", 5)
        );
        assert!(
            u.skipped
                .iter()
                .any(|s| s == "mlx5_1: not allocated to this pod")
        );
        assert!(
            u.skipped
                .iter()
                .any(|s| s.contains("mlx5_2 port 1: excluded"))
        );
    }
}
