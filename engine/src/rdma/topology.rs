//! Which NIC serves a region: for GPU memory the NIC with the shortest PCIe path to the GPU
//! (GPUDirect RDMA is fastest through a shared switch and worst across the CPU interconnect);
//! for host memory a NIC on the region's NUMA node. NICs that are equally close are all
//! returned, so a batch can be striped over them.

use serde::Serialize;

use super::sysfs::{Nic, PciPath};

/// Where a NIC sits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NicPlace {
    pub name: String,
    pub numa: Option<u32>,
    pub pci: Option<PciPath>,
}

impl From<&Nic> for NicPlace {
    fn from(n: &Nic) -> Self {
        NicPlace {
            name: n.name.clone(),
            numa: n.numa_node,
            pci: n.pci_path.clone(),
        }
    }
}

/// Where a region's memory sits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryPlace {
    Host {
        numa: Option<u32>,
    },
    Gpu {
        /// The GPU's PCI position (sysfs::pci_path of its bus id).
        pci: Option<PciPath>,
        numa: Option<u32>,
    },
}

/// How close a NIC is to the memory; derived order is best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Closeness {
    /// Same PCIe tree, this many links apart.
    Pcie { hops: u32 },
    /// Same NUMA node, different root complex (through the host bridge).
    SameNuma,
    /// Locality unknown on either side.
    Unknown,
    /// Across the CPU interconnect.
    OtherNuma,
}

impl std::fmt::Display for Closeness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Closeness::Pcie { hops } if *hops <= 2 => {
                write!(f, "{hops} PCIe hops (same switch)")
            }
            Closeness::Pcie { hops } => write!(f, "{hops} PCIe hops (same root complex)"),
            Closeness::SameNuma => f.write_str("same NUMA node"),
            Closeness::Unknown => f.write_str("locality unknown"),
            Closeness::OtherNuma => f.write_str("other NUMA node"),
        }
    }
}

fn numa_closeness(a: Option<u32>, b: Option<u32>) -> Closeness {
    match (a, b) {
        (Some(a), Some(b)) if a == b => Closeness::SameNuma,
        (Some(_), Some(_)) => Closeness::OtherNuma,
        _ => Closeness::Unknown,
    }
}

pub fn closeness(nic: &NicPlace, mem: &MemoryPlace) -> Closeness {
    match mem {
        MemoryPlace::Host { numa } => numa_closeness(nic.numa, *numa),
        MemoryPlace::Gpu { pci, numa } => {
            if let (Some(g), Some(n)) = (pci, &nic.pci)
                && let Some(hops) = g.hops(n)
            {
                return Closeness::Pcie { hops };
            }
            numa_closeness(nic.numa, *numa)
        }
    }
}

/// The NICs (indices into `nics`) to use for memory at `mem`, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NicChoice {
    pub nics: Vec<usize>,
    pub closeness: Closeness,
    pub reason: String,
}

/// The closest NICs to `mem`; None when `nics` is empty.
pub fn choose_nics(nics: &[NicPlace], mem: &MemoryPlace) -> Option<NicChoice> {
    let scored: Vec<(Closeness, usize)> = nics
        .iter()
        .enumerate()
        .map(|(i, n)| (closeness(n, mem), i))
        .collect();
    let best = scored.iter().map(|(c, _)| *c).min()?;
    let chosen: Vec<usize> = scored
        .iter()
        .filter(|(c, _)| *c == best)
        .map(|(_, i)| *i)
        .collect();
    let names: Vec<&str> = chosen.iter().map(|&i| nics[i].name.as_str()).collect();
    let what = match mem {
        MemoryPlace::Host { numa: Some(n) } => format!("host memory on NUMA node {n}"),
        MemoryPlace::Host { numa: None } => "host memory".to_string(),
        MemoryPlace::Gpu { pci: Some(p), .. } => {
            format!("GPU at {}", p.address().unwrap_or("?"))
        }
        MemoryPlace::Gpu { pci: None, .. } => "GPU (PCI position unknown)".to_string(),
    };
    let mut reason = format!("{what}: {} ({best})", names.join(", "));
    if chosen.len() < nics.len() {
        let others: Vec<String> = scored
            .iter()
            .filter(|(c, _)| *c != best)
            .map(|(c, i)| format!("{} {c}", nics[*i].name))
            .collect();
        reason.push_str(&format!("; not {}", others.join(", ")));
    }
    Some(NicChoice {
        nics: chosen,
        closeness: best,
        reason,
    })
}

/// The CPUs of a kernel cpulist (`0-3,8,10-11`), sorted, for pinning the completion poller
/// to the NIC's NUMA node. None for text that is not a cpulist.
pub fn parse_cpulist(text: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if a > b || b - a > 65536 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    Some(cpus)
}

/// The CPUs of NUMA node `node` under `root` (`sys/devices/system/node/node<N>/cpulist`).
pub fn numa_cpus(root: &std::path::Path, node: u32) -> Option<Vec<usize>> {
    let path = root.join(format!("sys/devices/system/node/node{node}/cpulist"));
    parse_cpulist(&std::fs::read_to_string(path).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists_parse_ranges_and_singles() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n").unwrap(),
            [0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpulist("5").unwrap(), [5]);
        assert_eq!(parse_cpulist("").unwrap(), Vec::<usize>::new());
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("a-b"), None);
        assert_eq!(parse_cpulist("0-99999999"), None);
        let dir = tempfile::tempdir().unwrap();
        let fs = super::super::sysfs::fixture::FakeSysfs::new(dir.path());
        fs.numa_node(1, "24-25,72");
        assert_eq!(numa_cpus(dir.path(), 1).unwrap(), [24, 25, 72]);
        assert_eq!(numa_cpus(dir.path(), 0), None);
    }

    fn path(p: &[&str]) -> Option<PciPath> {
        Some(PciPath(p.iter().map(|s| s.to_string()).collect()))
    }

    fn place(name: &str, numa: Option<u32>, pci: &[&str]) -> NicPlace {
        NicPlace {
            name: name.into(),
            numa,
            pci: if pci.is_empty() { None } else { path(pci) },
        }
    }

    /// Two sockets; socket 0 has a PCIe switch with GPU0 and mlx5_0 behind it and mlx5_1 on
    /// another root port; socket 1 has mlx5_2 and mlx5_3 on one switch.
    fn nics() -> Vec<NicPlace> {
        vec![
            place(
                "mlx5_0",
                Some(0),
                &["pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0"],
            ),
            place(
                "mlx5_1",
                Some(0),
                &["pci0000:00", "0000:00:03.0", "0000:05:00.0"],
            ),
            place(
                "mlx5_2",
                Some(1),
                &["pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:00.0"],
            ),
            place(
                "mlx5_3",
                Some(1),
                &["pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:00.1"],
            ),
        ]
    }

    #[test]
    fn a_gpu_gets_the_nic_behind_its_own_switch() {
        let gpu = MemoryPlace::Gpu {
            pci: path(&["pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:03:00.0"]),
            numa: Some(0),
        };
        let c = choose_nics(&nics(), &gpu).unwrap();
        assert_eq!(c.nics, [0]);
        assert_eq!(c.closeness, Closeness::Pcie { hops: 2 });
        assert!(
            c.reason.contains("mlx5_0") && c.reason.contains("same switch"),
            "{}",
            c.reason
        );
        assert!(c.reason.contains("mlx5_2 other NUMA node"), "{}", c.reason);
    }

    #[test]
    fn equally_close_nics_are_all_chosen_for_striping() {
        let gpu = MemoryPlace::Gpu {
            pci: path(&["pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:83:00.0"]),
            numa: Some(1),
        };
        let c = choose_nics(&nics(), &gpu).unwrap();
        assert_eq!(c.nics, [2, 3]);
        let host = MemoryPlace::Host { numa: Some(0) };
        let c = choose_nics(&nics(), &host).unwrap();
        assert_eq!(c.nics, [0, 1]);
        assert_eq!(c.closeness, Closeness::SameNuma);
        assert!(
            c.reason
                .starts_with("host memory on NUMA node 0: mlx5_0, mlx5_1"),
            "{}",
            c.reason
        );
    }

    #[test]
    fn without_pci_positions_numa_decides_and_unknown_beats_remote() {
        let gpu = MemoryPlace::Gpu {
            pci: None,
            numa: Some(1),
        };
        assert_eq!(choose_nics(&nics(), &gpu).unwrap().nics, [2, 3]);
        let gpu_other_root = MemoryPlace::Gpu {
            pci: path(&["pci0000:40", "0000:40:01.0"]),
            numa: Some(0),
        };
        assert_eq!(choose_nics(&nics(), &gpu_other_root).unwrap().nics, [0, 1]);
        let mixed = vec![place("a", Some(1), &[]), place("b", None, &[])];
        let c = choose_nics(&mixed, &MemoryPlace::Host { numa: Some(0) }).unwrap();
        assert_eq!(c.nics, [1]);
        assert_eq!(c.closeness, Closeness::Unknown);
        let c = choose_nics(&mixed, &MemoryPlace::Host { numa: None }).unwrap();
        assert_eq!(c.nics, [0, 1], "nothing known: all equal");
        assert!(choose_nics(&[], &MemoryPlace::Host { numa: None }).is_none());
    }

    #[test]
    fn closeness_orders_pcie_then_numa() {
        assert!(Closeness::Pcie { hops: 6 } < Closeness::SameNuma);
        assert!(Closeness::SameNuma < Closeness::Unknown);
        assert!(Closeness::Unknown < Closeness::OtherNuma);
        assert!(Closeness::Pcie { hops: 2 } < Closeness::Pcie { hops: 4 });
    }
}
