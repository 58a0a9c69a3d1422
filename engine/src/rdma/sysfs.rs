//! RDMA devices as the kernel lists them in sysfs: devices, ports, port state, link layer, GID
//! table (with each GID's type and net device), NUMA node and PCI position. No libibverbs is
//! needed, so this is compiled without the `rdma` feature and the agent uses it for discovery.
//!
//! Every function takes `root`, the directory that stands for `/` (`/` itself in production, a
//! fixture tree in tests). The layout read is the kernel's (drivers/infiniband/core/sysfs.c):
//!
//! ```text
//! sys/class/infiniband/<dev>/node_guid
//! sys/class/infiniband/<dev>/device -> ../../../<pci address>     (numa_node inside)
//! sys/class/infiniband/<dev>/ports/<n>/{state,link_layer,lid,rate}
//! sys/class/infiniband/<dev>/ports/<n>/gids/<i>
//! sys/class/infiniband/<dev>/ports/<n>/gid_attrs/{types,ndevs}/<i>
//! sys/class/net/<ndev>/mtu
//! sys/bus/pci/devices/<pci address> -> ../../../devices/pci0000:00/.../<pci address>
//! ```

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::mtu::Mtu;
use crate::error::{Error, Result};

/// Where RDMA devices are listed, relative to the root.
pub const CLASS_DIR: &str = "sys/class/infiniband";

/// A 128-bit global identifier (an IPv6 address for RoCE, subnet prefix + GUID for InfiniBand).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// fe80::/10, the address every port has whether or not anything routes to it.
    pub fn is_link_local(&self) -> bool {
        self.0[0] == 0xfe && self.0[1] & 0xc0 == 0x80
    }

    /// The IPv4 address of an IPv4-mapped GID (::ffff:a.b.c.d), the form RoCE v2 uses for an
    /// interface's IPv4 address.
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }
}

/// Written as sysfs does: eight groups of four hex digits.
impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// Accepts the sysfs form and any IPv6 text form (`::ffff:10.0.0.1`, `fe80::1`).
impl FromStr for Gid {
    type Err = Error;
    fn from_str(s: &str) -> Result<Gid> {
        s.trim()
            .parse::<Ipv6Addr>()
            .map(|a| Gid(a.octets()))
            .map_err(|_| Error::InvalidConfig {
                field: "gid",
                value: s.into(),
                reason: "expected 8 groups of hex digits (an IPv6 address)",
            })
    }
}

impl Serialize for Gid {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Gid {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The protocol a GID entry is for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GidKind {
    /// Native InfiniBand.
    Ib,
    /// RoCE v1 (Ethernet, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable): what RoCE fabrics use.
    RoceV2,
    /// A type string this code does not know, kept verbatim.
    Other(String),
}

impl GidKind {
    /// From the text of `gid_attrs/types/<i>`; "IB/RoCE v1" means IB on an InfiniBand port and
    /// RoCE v1 on an Ethernet one.
    pub fn parse(text: &str, link_layer: &LinkLayer) -> GidKind {
        match text.trim() {
            "RoCE v2" => GidKind::RoceV2,
            "IB/RoCE v1" | "RoCE v1" | "IB" => match link_layer {
                LinkLayer::Ethernet => GidKind::RoceV1,
                _ => GidKind::Ib,
            },
            other => GidKind::Other(other.into()),
        }
    }
}

impl fmt::Display for GidKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GidKind::Ib => f.write_str("IB"),
            GidKind::RoceV1 => f.write_str("RoCE v1"),
            GidKind::RoceV2 => f.write_str("RoCE v2"),
            GidKind::Other(s) => f.write_str(s),
        }
    }
}

/// One populated entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GidEntry {
    pub index: u32,
    pub gid: Gid,
    pub kind: GidKind,
    /// The net device the GID belongs to (RoCE), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netdev: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    InfiniBand,
    /// RoCE.
    Ethernet,
    Other(String),
}

impl LinkLayer {
    pub fn parse(text: &str) -> LinkLayer {
        match text.trim() {
            "InfiniBand" => LinkLayer::InfiniBand,
            "Ethernet" => LinkLayer::Ethernet,
            other => LinkLayer::Other(other.into()),
        }
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet",
            LinkLayer::Other(s) => s,
        })
    }
}

impl Serialize for LinkLayer {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for LinkLayer {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(LinkLayer::parse(&String::deserialize(d)?))
    }
}

/// A port's logical state (`enum ibv_port_state`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PortState {
    Down,
    Init,
    Armed,
    Active,
    ActiveDefer,
    Other(String),
}

impl PortState {
    /// From sysfs's `"4: ACTIVE"` (the number decides; the name is a fallback).
    pub fn parse(text: &str) -> PortState {
        let text = text.trim();
        let (num, name) = match text.split_once(':') {
            Some((n, name)) => (n.trim().parse::<u32>().ok(), name.trim()),
            None => (text.parse::<u32>().ok(), text),
        };
        match (num, name) {
            (Some(1), _) | (None, "DOWN") => PortState::Down,
            (Some(2), _) | (None, "INIT") => PortState::Init,
            (Some(3), _) | (None, "ARMED") => PortState::Armed,
            (Some(4), _) | (None, "ACTIVE") => PortState::Active,
            (Some(5), _) | (None, "ACTIVE_DEFER") => PortState::ActiveDefer,
            _ => PortState::Other(text.into()),
        }
    }

    pub fn is_active(&self) -> bool {
        matches!(self, PortState::Active | PortState::ActiveDefer)
    }
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PortState::Down => "DOWN",
            PortState::Init => "INIT",
            PortState::Armed => "ARMED",
            PortState::Active => "ACTIVE",
            PortState::ActiveDefer => "ACTIVE_DEFER",
            PortState::Other(s) => s,
        })
    }
}

impl Serialize for PortState {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PortState {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(PortState::parse(&String::deserialize(d)?))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Port {
    pub port: u32,
    pub state: PortState,
    pub link_layer: LinkLayer,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Populated GID entries, by index.
    pub gids: Vec<GidEntry>,
    /// For RoCE, derived from the net device's MTU; InfiniBand ports report theirs only through
    /// verbs (`ibv_query_port`), so None there.
    pub active_mtu: Option<Mtu>,
    /// e.g. "100 Gb/sec (4X EDR)".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
}

impl Port {
    pub fn gid(&self, index: u32) -> Option<&GidEntry> {
        self.gids.iter().find(|g| g.index == index)
    }
}

/// Where a PCI function sits: the components of its path under `/sys/devices`, from the root
/// complex down, e.g. `["pci0000:3a", "0000:3a:00.0", "0000:3b:00.0"]`. Two functions behind
/// the same switch share a longer prefix than two behind different root ports.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PciPath(pub Vec<String>);

impl PciPath {
    /// The PCI address (last component).
    pub fn address(&self) -> Option<&str> {
        self.0.last().map(String::as_str)
    }

    /// The root complex (first component, `pci0000:3a`).
    pub fn root(&self) -> Option<&str> {
        self.0.first().map(String::as_str)
    }

    /// Links between the two functions through their closest common bridge: 0 for the same
    /// function, 2 for two functions on one switch, more for longer ways round; None when they
    /// hang off different root complexes (the way goes through the CPU).
    pub fn hops(&self, other: &PciPath) -> Option<u32> {
        if self.root().is_none() || self.root() != other.root() {
            return None;
        }
        let common = self
            .0
            .iter()
            .zip(&other.0)
            .take_while(|(a, b)| a == b)
            .count();
        Some((self.0.len() - common + other.0.len() - common) as u32)
    }
}

impl fmt::Display for PciPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("/"))
    }
}

/// One RDMA device (an HCA, a RoCE NIC, or one of its SR-IOV functions).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Nic {
    pub name: String,
    pub ports: Vec<Port>,
    pub numa_node: Option<u32>,
    pub pci_address: Option<String>,
    pub pci_path: Option<PciPath>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_guid: Option<String>,
}

impl Nic {
    pub fn port(&self, port: u32) -> Option<&Port> {
        self.ports.iter().find(|p| p.port == port)
    }

    pub fn active_ports(&self) -> impl Iterator<Item = &Port> {
        self.ports.iter().filter(|p| p.state.is_active())
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Names of the entries of `dir`, sorted; empty when it does not exist.
fn entries(dir: &Path) -> Result<Vec<String>> {
    let read = match std::fs::read_dir(dir) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(format!("reading {}", dir.display()), e)),
    };
    let mut names: Vec<String> = read
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    Ok(names)
}

/// Names that are numbers, sorted numerically.
fn numbered(dir: &Path) -> Result<Vec<u32>> {
    let mut n: Vec<u32> = entries(dir)?
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    n.sort_unstable();
    Ok(n)
}

/// The NUMA node in a `numa_node` file; -1 (no affinity) and anything unreadable are None.
fn numa_node_at(path: &Path) -> Option<u32> {
    read_trimmed(path)?
        .parse::<i64>()
        .ok()
        .and_then(|n| if n >= 0 { u32::try_from(n).ok() } else { None })
}

/// Is `s` a PCI address (`0000:3b:00.0`, domain optional)?
pub fn is_pci_address(s: &str) -> bool {
    let hex = |p: &str, n: usize| p.len() == n && p.chars().all(|c| c.is_ascii_hexdigit());
    let (rest, function) = match s.rsplit_once('.') {
        Some(x) => x,
        None => return false,
    };
    if !(function.len() == 1 && function.chars().all(|c| ('0'..='7').contains(&c))) {
        return false;
    }
    let parts: Vec<&str> = rest.split(':').collect();
    match parts.as_slice() {
        [domain, bus, dev] => hex(domain, 4) && hex(bus, 2) && hex(dev, 2),
        [bus, dev] => hex(bus, 2) && hex(dev, 2),
        _ => false,
    }
}

/// A PCI address in the form sysfs names it: lower case, with the domain.
pub fn normalize_pci_address(s: &str) -> Option<String> {
    let s = s.trim().to_ascii_lowercase();
    // CUDA writes an 8-digit domain ("00000000:3B:00.0"); sysfs uses 4.
    let s = match s.split_once(':') {
        Some((domain, rest)) if domain.len() == 8 && domain.starts_with("0000") => {
            format!("{}:{rest}", &domain[4..])
        }
        _ => s,
    };
    if !is_pci_address(&s) {
        return None;
    }
    Some(if s.matches(':').count() == 1 {
        format!("0000:{s}")
    } else {
        s
    })
}

/// The position of PCI function `address` in the PCI tree, from `sys/bus/pci/devices/<address>`.
pub fn pci_path(root: &Path, address: &str) -> Option<PciPath> {
    let address = normalize_pci_address(address)?;
    path_under_devices(root, &root.join("sys/bus/pci/devices").join(address))
}

/// The NUMA node of PCI function `address`, None when the platform gives none.
pub fn pci_numa_node(root: &Path, address: &str) -> Option<u32> {
    let address = normalize_pci_address(address)?;
    numa_node_at(
        &root
            .join("sys/bus/pci/devices")
            .join(address)
            .join("numa_node"),
    )
}

/// The PCI components of the device behind a sysfs link (`.../pciXXXX:XX/.../<addr>`).
fn path_under_devices(root: &Path, link: &Path) -> Option<PciPath> {
    let real = std::fs::canonicalize(link).ok()?;
    let devices = std::fs::canonicalize(root.join("sys/devices")).ok()?;
    let rel = real.strip_prefix(devices).ok()?;
    let parts: Vec<String> = rel
        .components()
        .filter_map(|c| c.as_os_str().to_str().map(String::from))
        .skip_while(|c| !c.starts_with("pci"))
        .collect();
    // Everything after the root complex must be a PCI function (no trailing non-PCI dirs).
    if parts.len() < 2 || !parts[1..].iter().all(|p| is_pci_address(p)) {
        return None;
    }
    Some(PciPath(parts))
}

fn read_port(nic_dir: &Path, port: u32, root: &Path) -> Port {
    let dir = nic_dir.join("ports").join(port.to_string());
    let state = read_trimmed(&dir.join("state"))
        .map(|s| PortState::parse(&s))
        .unwrap_or_else(|| PortState::Other("unreadable".into()));
    let link_layer = read_trimmed(&dir.join("link_layer"))
        .map(|s| LinkLayer::parse(&s))
        .unwrap_or_else(|| LinkLayer::Other("unreadable".into()));
    let lid = read_trimmed(&dir.join("lid"))
        .and_then(|s| u16::from_str_radix(s.trim_start_matches("0x"), 16).ok())
        .unwrap_or(0);
    let mut gids = Vec::new();
    for index in numbered(&dir.join("gids")).unwrap_or_default() {
        let Some(gid) = read_trimmed(&dir.join("gids").join(index.to_string()))
            .and_then(|s| s.parse::<Gid>().ok())
        else {
            continue;
        };
        if gid.is_zero() {
            continue; // an unpopulated slot
        }
        let kind = read_trimmed(&dir.join("gid_attrs/types").join(index.to_string()))
            .map(|s| GidKind::parse(&s, &link_layer))
            .unwrap_or_else(|| match link_layer {
                // Kernels before 4.5 have no gid_attrs: every GID is IB / RoCE v1.
                LinkLayer::Ethernet => GidKind::RoceV1,
                _ => GidKind::Ib,
            });
        let netdev = read_trimmed(&dir.join("gid_attrs/ndevs").join(index.to_string()))
            .filter(|s| !s.is_empty());
        gids.push(GidEntry {
            index,
            gid,
            kind,
            netdev,
        });
    }
    let active_mtu = match link_layer {
        LinkLayer::Ethernet => roce_netdev(nic_dir, &gids)
            .and_then(|nd| read_trimmed(&root.join("sys/class/net").join(nd).join("mtu")))
            .and_then(|s| s.parse().ok())
            .and_then(Mtu::for_roce_netdev),
        _ => None,
    };
    Port {
        port,
        state,
        link_layer,
        lid,
        gids,
        active_mtu,
        rate: read_trimmed(&dir.join("rate")),
    }
}

/// The net device of a RoCE port: the one its GIDs name, else the PCI function's own.
fn roce_netdev(nic_dir: &Path, gids: &[GidEntry]) -> Option<String> {
    gids.iter().find_map(|g| g.netdev.clone()).or_else(|| {
        entries(&nic_dir.join("device/net"))
            .ok()?
            .into_iter()
            .next()
    })
}

/// One device by name, or None when `sys/class/infiniband/<name>` does not exist.
pub fn nic(root: &Path, name: &str) -> Result<Option<Nic>> {
    let dir = root.join(CLASS_DIR).join(name);
    if !dir.exists() {
        return Ok(None);
    }
    let ports = numbered(&dir.join("ports"))?
        .into_iter()
        .map(|p| read_port(&dir, p, root))
        .collect();
    let device = dir.join("device");
    let pci_address = std::fs::canonicalize(&device)
        .ok()
        .and_then(|t| t.file_name()?.to_str().map(String::from))
        .filter(|a| is_pci_address(a));
    Ok(Some(Nic {
        name: name.into(),
        ports,
        numa_node: numa_node_at(&device.join("numa_node")),
        pci_path: path_under_devices(root, &device),
        pci_address,
        node_guid: read_trimmed(&dir.join("node_guid")),
    }))
}

/// Every RDMA device under `root`, sorted by name; empty (not an error) when the machine has no
/// RDMA stack at all.
pub fn nics(root: &Path) -> Result<Vec<Nic>> {
    let mut out = Vec::new();
    for name in entries(&root.join(CLASS_DIR))? {
        if let Some(n) = nic(root, &name)? {
            out.push(n);
        }
    }
    Ok(out)
}

/// The RDMA devices bound to PCI function `address` (`sys/bus/pci/devices/<addr>/infiniband/*`).
pub fn nics_of_pci(root: &Path, address: &str) -> Result<Vec<String>> {
    match normalize_pci_address(address) {
        Some(a) => entries(&root.join("sys/bus/pci/devices").join(a).join("infiniband")),
        None => Ok(Vec::new()),
    }
}

/// The RDMA device behind a uverbs character device (`uverbs3` → `mlx5_3`).
pub fn nic_of_uverbs(root: &Path, uverbs: &str) -> Option<String> {
    read_trimmed(
        &root
            .join("sys/class/infiniband_verbs")
            .join(uverbs)
            .join("ibdev"),
    )
    .filter(|s| !s.is_empty())
}

/// Builds sysfs-shaped fixture trees for tests (here and in the agent), with the same links the
/// kernel makes. Not for production use.
#[doc(hidden)]
pub mod fixture {
    use std::os::unix::fs::symlink;
    use std::path::{Path, PathBuf};

    #[derive(Debug)]
    pub struct FakeSysfs {
        pub root: PathBuf,
    }

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().expect("has a parent")).expect("mkdir");
        std::fs::write(path, text).expect("write fixture file");
    }

    /// A relative link target from directory `from` to `to` (both under the root), as sysfs's.
    fn relative(from: &Path, to: &Path) -> PathBuf {
        let from: Vec<_> = from.components().collect();
        let to: Vec<_> = to.components().collect();
        let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
        let mut out = PathBuf::new();
        for _ in common..from.len() {
            out.push("..");
        }
        for c in &to[common..] {
            out.push(c);
        }
        out
    }

    fn link(at: &Path, to: &Path) {
        std::fs::create_dir_all(at.parent().expect("has a parent")).expect("mkdir");
        let target = relative(at.parent().expect("has a parent"), to);
        symlink(target, at).expect("symlink");
    }

    impl FakeSysfs {
        pub fn new(root: &Path) -> Self {
            std::fs::create_dir_all(root.join("sys/devices")).expect("mkdir");
            FakeSysfs { root: root.into() }
        }

        /// A PCI function at `path` (root complex first), with its numa_node (-1 for none) and
        /// its `sys/bus/pci/devices` link. Returns its directory.
        pub fn pci_function(&self, path: &[&str], numa: i32) -> PathBuf {
            let mut dir = self.root.join("sys/devices");
            for p in path {
                dir.push(p);
            }
            std::fs::create_dir_all(&dir).expect("mkdir");
            write(&dir.join("numa_node"), &format!("{numa}\n"));
            let address = path.last().expect("a path");
            let bus = self.root.join("sys/bus/pci/devices").join(address);
            if !bus.exists() {
                link(&bus, &dir);
            }
            dir
        }

        /// An RDMA device `name` on the PCI function at `pci` (created if needed).
        pub fn nic(&self, name: &str, pci: &[&str], numa: i32) -> PathBuf {
            let function = self.pci_function(pci, numa);
            let dir = function.join("infiniband").join(name);
            std::fs::create_dir_all(dir.join("ports")).expect("mkdir");
            write(&dir.join("node_guid"), "0c42:a103:0065:1a2b\n");
            // The kernel's form: up out of infiniband/<name> and the function, then back in.
            let address = pci.last().expect("a path");
            symlink(format!("../../../{address}"), dir.join("device")).expect("symlink");
            link(&self.root.join(super::CLASS_DIR).join(name), &dir);
            dir
        }

        /// A virtual RDMA device with no PCI function (like rxe).
        pub fn virtual_nic(&self, name: &str) -> PathBuf {
            let dir = self.root.join("sys/devices/virtual/infiniband").join(name);
            std::fs::create_dir_all(dir.join("ports")).expect("mkdir");
            link(&self.root.join(super::CLASS_DIR).join(name), &dir);
            dir
        }

        /// Port `port` of `nic`: state like "4: ACTIVE", link layer "InfiniBand"/"Ethernet".
        pub fn port(&self, nic: &str, port: u32, state: &str, link_layer: &str, lid: u16) {
            let dir = self.port_dir(nic, port);
            write(&dir.join("state"), &format!("{state}\n"));
            write(&dir.join("link_layer"), &format!("{link_layer}\n"));
            write(&dir.join("lid"), &format!("{lid:#x}\n"));
            write(&dir.join("rate"), "100 Gb/sec (4X EDR)\n");
            std::fs::create_dir_all(dir.join("gids")).expect("mkdir");
        }

        /// GID `index` of a port: `gid` in any IPv6 form, `kind` as sysfs writes it ("RoCE v2",
        /// "IB/RoCE v1"), the net device for RoCE.
        pub fn gid(&self, nic: &str, port: u32, index: u32, gid: &str, kind: &str, ndev: &str) {
            let dir = self.port_dir(nic, port);
            let g: super::Gid = gid.parse().expect("a gid");
            write(&dir.join("gids").join(index.to_string()), &format!("{g}\n"));
            write(
                &dir.join("gid_attrs/types").join(index.to_string()),
                &format!("{kind}\n"),
            );
            write(
                &dir.join("gid_attrs/ndevs").join(index.to_string()),
                &format!("{ndev}\n"),
            );
        }

        /// An empty GID slot (all zeros), as most of a real table is.
        pub fn empty_gid(&self, nic: &str, port: u32, index: u32) {
            let dir = self.port_dir(nic, port);
            write(
                &dir.join("gids").join(index.to_string()),
                "0000:0000:0000:0000:0000:0000:0000:0000\n",
            );
        }

        pub fn netdev(&self, name: &str, mtu: u32) {
            write(
                &self.root.join("sys/class/net").join(name).join("mtu"),
                &format!("{mtu}\n"),
            );
        }

        /// `uverbsN` of `nic`: its sysfs entry and its `/dev/infiniband` node (a plain file).
        pub fn uverbs(&self, n: u32, nic: &str) {
            let name = format!("uverbs{n}");
            write(
                &self
                    .root
                    .join("sys/class/infiniband_verbs")
                    .join(&name)
                    .join("ibdev"),
                &format!("{nic}\n"),
            );
            write(&self.root.join("dev/infiniband").join(&name), "");
        }

        /// A NUMA node with its cpulist.
        pub fn numa_node(&self, id: u32, cpulist: &str) {
            write(
                &self
                    .root
                    .join("sys/devices/system/node")
                    .join(format!("node{id}"))
                    .join("cpulist"),
                &format!("{cpulist}\n"),
            );
        }

        fn port_dir(&self, nic: &str, port: u32) -> PathBuf {
            self.root
                .join(super::CLASS_DIR)
                .join(nic)
                .join("ports")
                .join(port.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixture::FakeSysfs;
    use super::*;

    const SWITCH_A: [&str; 4] = ["pci0000:3a", "0000:3a:00.0", "0000:3b:00.0", "0000:3c:00.0"];

    fn roce_node(root: &Path) -> FakeSysfs {
        let fs = FakeSysfs::new(root);
        fs.nic("mlx5_0", &SWITCH_A, 0);
        fs.port("mlx5_0", 1, "4: ACTIVE", "Ethernet", 0);
        fs.gid(
            "mlx5_0",
            1,
            0,
            "fe80::ba59:9fff:fe1a:2b3c",
            "IB/RoCE v1",
            "ens1f0",
        );
        fs.gid(
            "mlx5_0",
            1,
            1,
            "fe80::ba59:9fff:fe1a:2b3c",
            "RoCE v2",
            "ens1f0",
        );
        fs.empty_gid("mlx5_0", 1, 2);
        fs.gid("mlx5_0", 1, 3, "::ffff:10.1.2.3", "RoCE v2", "ens1f0");
        fs.netdev("ens1f0", 9000);
        fs.nic("mlx5_1", &["pci0000:d7", "0000:d7:00.0", "0000:d8:00.0"], 1);
        fs.port("mlx5_1", 1, "1: DOWN", "InfiniBand", 0x1a);
        fs.gid(
            "mlx5_1",
            1,
            0,
            "fe80::0c42:a103:0065:1a2b",
            "IB/RoCE v1",
            "",
        );
        fs
    }

    #[test]
    fn lists_devices_ports_gids_numa_and_pci_position() {
        let dir = tempfile::tempdir().unwrap();
        roce_node(dir.path());
        let nics = nics(dir.path()).unwrap();
        assert_eq!(nics.len(), 2);
        let a = &nics[0];
        assert_eq!(a.name, "mlx5_0");
        assert_eq!(a.numa_node, Some(0));
        assert_eq!(a.pci_address.as_deref(), Some("0000:3c:00.0"));
        assert_eq!(a.pci_path.as_ref().unwrap().0, SWITCH_A);
        let p = &a.ports[0];
        assert_eq!(p.state, PortState::Active);
        assert_eq!(p.link_layer, LinkLayer::Ethernet);
        assert_eq!(p.active_mtu, Some(Mtu::M4096));
        assert_eq!(p.gids.len(), 3, "the empty slot is skipped: {:?}", p.gids);
        assert_eq!(p.gid(0).unwrap().kind, GidKind::RoceV1);
        assert_eq!(p.gid(1).unwrap().kind, GidKind::RoceV2);
        let v4 = p.gid(3).unwrap();
        assert_eq!(v4.gid.ipv4(), Some(Ipv4Addr::new(10, 1, 2, 3)));
        assert_eq!(v4.netdev.as_deref(), Some("ens1f0"));
        assert_eq!(
            v4.gid.to_string(),
            "0000:0000:0000:0000:0000:ffff:0a01:0203"
        );

        let b = &nics[1];
        assert_eq!(b.numa_node, Some(1));
        let p = &b.ports[0];
        assert_eq!(p.state, PortState::Down);
        assert!(!p.state.is_active());
        assert_eq!(p.link_layer, LinkLayer::InfiniBand);
        assert_eq!(p.lid, 0x1a);
        assert_eq!(p.gid(0).unwrap().kind, GidKind::Ib);
        assert_eq!(p.gid(0).unwrap().netdev, None);
        assert_eq!(p.active_mtu, None);
    }

    #[test]
    fn a_machine_without_rdma_has_no_devices_and_no_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(nics(dir.path()).unwrap().is_empty());
        assert!(nic(dir.path(), "mlx5_0").unwrap().is_none());
    }

    #[test]
    fn virtual_devices_and_missing_attributes_degrade_to_none() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FakeSysfs::new(dir.path());
        let rxe = fs.virtual_nic("rxe0");
        // A port with only a state file, and a numa_node of -1 elsewhere.
        std::fs::create_dir_all(rxe.join("ports/1")).unwrap();
        std::fs::write(rxe.join("ports/1/state"), "ACTIVE\n").unwrap();
        fs.nic("mlx5_2", &["pci0000:00", "0000:00:02.0"], -1);
        let nics = nics(dir.path()).unwrap();
        let rxe = nics.iter().find(|n| n.name == "rxe0").unwrap();
        assert_eq!(rxe.pci_address, None);
        assert_eq!(rxe.pci_path, None);
        assert_eq!(rxe.numa_node, None);
        assert_eq!(rxe.ports[0].state, PortState::Active);
        assert_eq!(
            rxe.ports[0].link_layer,
            LinkLayer::Other("unreadable".into())
        );
        assert!(rxe.ports[0].gids.is_empty());
        let m = nics.iter().find(|n| n.name == "mlx5_2").unwrap();
        assert_eq!(m.numa_node, None, "-1 means no affinity");
        assert!(m.ports.is_empty());
    }

    #[test]
    fn gids_parse_both_text_forms_and_refuse_garbage() {
        let a: Gid = "fe80:0000:0000:0000:0202:c9ff:fe00:0001".parse().unwrap();
        let b: Gid = "fe80::202:c9ff:fe00:1".parse().unwrap();
        assert_eq!(a, b);
        assert!(a.is_link_local());
        assert!(!"::ffff:10.0.0.1".parse::<Gid>().unwrap().is_link_local());
        let err = "fe80:zz".parse::<Gid>().unwrap_err();
        assert!(err.to_string().contains("fe80:zz"), "{err}");
        assert_eq!(serde_json::to_string(&a).unwrap(), format!("\"{a}\""));
        assert_eq!(
            serde_json::from_str::<Gid>(&serde_json::to_string(&a).unwrap()).unwrap(),
            a
        );
        assert!(serde_json::from_str::<Gid>("\"nope\"").is_err());
    }

    #[test]
    fn port_states_parse_by_number_then_name() {
        assert_eq!(PortState::parse("4: ACTIVE"), PortState::Active);
        assert_eq!(PortState::parse("5: ACTIVE_DEFER"), PortState::ActiveDefer);
        assert!(PortState::parse("5: ACTIVE_DEFER").is_active());
        assert_eq!(PortState::parse("1: DOWN"), PortState::Down);
        assert_eq!(PortState::parse("ARMED"), PortState::Armed);
        assert_eq!(
            PortState::parse("9: WEIRD"),
            PortState::Other("9: WEIRD".into())
        );
        assert_eq!(PortState::Active.to_string(), "ACTIVE");
    }

    #[test]
    fn pci_addresses_are_recognised_and_normalised() {
        assert!(is_pci_address("0000:3b:00.0"));
        assert!(is_pci_address("3b:00.1"));
        assert!(!is_pci_address("0000:3b:00.8"));
        assert!(!is_pci_address("mlx5_0"));
        assert!(!is_pci_address("0000:3b:00"));
        assert_eq!(
            normalize_pci_address("00000000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            normalize_pci_address("3b:00.1").as_deref(),
            Some("0000:3b:00.1")
        );
        assert_eq!(normalize_pci_address("garbage"), None);
    }

    #[test]
    fn pci_paths_give_hop_counts_and_numa_nodes() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FakeSysfs::new(dir.path());
        fs.pci_function(&SWITCH_A, 0);
        fs.pci_function(
            &["pci0000:3a", "0000:3a:00.0", "0000:3b:00.0", "0000:3d:00.0"],
            0,
        );
        fs.pci_function(&["pci0000:3a", "0000:3a:02.0", "0000:40:00.0"], 0);
        fs.pci_function(&["pci0000:d7", "0000:d7:00.0", "0000:d8:00.0"], 1);
        let p = |a: &str| pci_path(dir.path(), a).unwrap();
        let nic = p("0000:3c:00.0");
        assert_eq!(nic.hops(&nic), Some(0));
        assert_eq!(nic.hops(&p("0000:3d:00.0")), Some(2), "same switch");
        assert_eq!(nic.hops(&p("0000:40:00.0")), Some(5), "same root complex");
        assert_eq!(nic.hops(&p("0000:d8:00.0")), None, "other root complex");
        assert_eq!(pci_numa_node(dir.path(), "0000:D8:00.0"), Some(1));
        assert_eq!(pci_path(dir.path(), "0000:99:00.0"), None);
    }

    #[test]
    fn pci_functions_and_uverbs_nodes_map_to_device_names() {
        let dir = tempfile::tempdir().unwrap();
        let fs = roce_node(dir.path());
        fs.uverbs(1, "mlx5_1");
        assert_eq!(
            nics_of_pci(dir.path(), "0000:3c:00.0").unwrap(),
            vec!["mlx5_0"]
        );
        assert!(nics_of_pci(dir.path(), "0000:3d:00.0").unwrap().is_empty());
        assert!(nics_of_pci(dir.path(), "bogus").unwrap().is_empty());
        assert_eq!(
            nic_of_uverbs(dir.path(), "uverbs1").as_deref(),
            Some("mlx5_1")
        );
        assert_eq!(nic_of_uverbs(dir.path(), "uverbs7"), None);
    }
}
