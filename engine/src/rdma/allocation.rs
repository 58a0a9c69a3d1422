//! Which RDMA devices a Kubernetes device plugin gave this pod.
//!
//! - The SR-IOV network device plugin sets `PCIDEVICE_<RESOURCE>` (resource name upper-cased,
//!   `.`/`/`/`-` as `_`) to a comma-separated list of the VF PCI addresses it allocated, e.g.
//!   `PCIDEVICE_NVIDIA_COM_SRIOV_RDMA=0000:3b:00.2,0000:3b:00.3`; newer versions add a
//!   `PCIDEVICE_<RESOURCE>_INFO` JSON variable, which is not an address list and is skipped.
//!   Each address maps to its RDMA device through `sys/bus/pci/devices/<addr>/infiniband/`.
//! - The shared RDMA device plugin sets no variable; it mounts the devices' uverbs nodes into
//!   the container (`/dev/infiniband/uverbsN`), each naming its device through
//!   `sys/class/infiniband_verbs/uverbsN/ibdev`.
//!
//! Outside a pod neither restricts anything (a host's `/dev/infiniband` has every device).

use std::collections::BTreeSet;
use std::path::Path;

use serde::Serialize;

use super::sysfs;
use crate::error::Result;

/// Where the allocation came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Source {
    /// `PCIDEVICE_*` variables of the SR-IOV device plugin (their names).
    SriovPlugin { variables: Vec<String> },
    /// The uverbs nodes present under `/dev/infiniband`.
    DevNodes,
    /// Nothing restricts: every device on the node may be used.
    Unrestricted,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Allocation {
    pub source: Source,
    /// Device names; empty means none allocated unless `source` is `Unrestricted`.
    pub devices: BTreeSet<String>,
    /// What could not be mapped to an RDMA device (a VF without an RDMA function, a token that
    /// is no PCI address), so a misconfigured plugin is visible.
    pub unmatched: Vec<String>,
}

impl Allocation {
    /// The restriction to hand to `select::usable_ports`: None when unrestricted.
    pub fn restriction(&self) -> Option<&BTreeSet<String>> {
        match self.source {
            Source::Unrestricted => None,
            _ => Some(&self.devices),
        }
    }
}

/// The allocation seen from `root` with environment `env` (pass `std::env::vars()`).
pub fn allocation(
    root: &Path,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Allocation> {
    let mut variables = Vec::new();
    let mut devices = BTreeSet::new();
    let mut unmatched = Vec::new();
    let mut vars: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with("PCIDEVICE_") && !k.ends_with("_INFO"))
        .collect();
    vars.sort();
    for (name, value) in vars {
        let mut any = false;
        for token in value.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            if !sysfs::is_pci_address(token) {
                unmatched.push(format!("{name}: {token:?} is not a PCI address"));
                continue;
            }
            let nics = sysfs::nics_of_pci(root, token)?;
            if nics.is_empty() {
                unmatched.push(format!("{name}: {token} has no RDMA device"));
            }
            for n in nics {
                any = true;
                devices.insert(n);
            }
        }
        if any {
            variables.push(name);
        }
    }
    if !variables.is_empty() {
        return Ok(Allocation {
            source: Source::SriovPlugin { variables },
            devices,
            unmatched,
        });
    }
    let dev = root.join("dev/infiniband");
    let nodes: Vec<String> = match std::fs::read_dir(&dev) {
        Ok(r) => r
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("uverbs"))
            .collect(),
        Err(_) => Vec::new(),
    };
    if nodes.is_empty() {
        return Ok(Allocation {
            source: Source::Unrestricted,
            devices,
            unmatched,
        });
    }
    for node in nodes {
        match sysfs::nic_of_uverbs(root, &node) {
            Some(n) => {
                devices.insert(n);
            }
            None => unmatched.push(format!(
                "/dev/infiniband/{node}: no sysfs entry names its device"
            )),
        }
    }
    Ok(Allocation {
        source: Source::DevNodes,
        devices,
        unmatched,
    })
}

#[cfg(test)]
mod tests {
    use super::super::sysfs::fixture::FakeSysfs;
    use super::*;

    fn vars(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn sriov_node(root: &Path) -> FakeSysfs {
        let fs = FakeSysfs::new(root);
        fs.nic("mlx5_0", &["pci0000:3a", "0000:3a:00.0", "0000:3b:00.0"], 0);
        fs.nic("mlx5_4", &["pci0000:3a", "0000:3a:00.0", "0000:3b:00.2"], 0);
        fs.nic("mlx5_5", &["pci0000:3a", "0000:3a:00.0", "0000:3b:00.3"], 0);
        // A VF bound to a driver without RDMA.
        fs.pci_function(&["pci0000:3a", "0000:3a:00.0", "0000:3b:00.4"], 0);
        fs
    }

    #[test]
    fn sriov_variables_map_vf_addresses_to_devices() {
        let dir = tempfile::tempdir().unwrap();
        sriov_node(dir.path());
        let a = allocation(
            dir.path(),
            vars(&[
                (
                    "PCIDEVICE_NVIDIA_COM_SRIOV_RDMA",
                    "0000:3b:00.2, 0000:3b:00.3",
                ),
                (
                    "PCIDEVICE_NVIDIA_COM_SRIOV_RDMA_INFO",
                    r#"{"0000:3b:00.2":{"generic":{}}}"#,
                ),
                ("PATH", "/usr/bin"),
            ]),
        )
        .unwrap();
        assert_eq!(
            a.source,
            Source::SriovPlugin {
                variables: vec!["PCIDEVICE_NVIDIA_COM_SRIOV_RDMA".into()]
            }
        );
        assert_eq!(a.devices.iter().collect::<Vec<_>>(), ["mlx5_4", "mlx5_5"]);
        assert!(a.unmatched.is_empty(), "{:?}", a.unmatched);
        assert_eq!(a.restriction().unwrap().len(), 2);
    }

    #[test]
    fn unmappable_tokens_are_reported_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        sriov_node(dir.path());
        let a = allocation(
            dir.path(),
            vars(&[
                ("PCIDEVICE_INTEL_COM_NET", "0000:3b:00.4"),
                ("PCIDEVICE_X_RDMA", "0000:3b:00.2,bogus"),
            ]),
        )
        .unwrap();
        assert_eq!(a.devices.iter().collect::<Vec<_>>(), ["mlx5_4"]);
        assert_eq!(a.unmatched.len(), 2, "{:?}", a.unmatched);
        assert!(
            a.unmatched
                .iter()
                .any(|u| u.contains("0000:3b:00.4 has no RDMA device"))
        );
        assert!(
            a.unmatched
                .iter()
                .any(|u| u.contains("\"bogus\" is not a PCI address"))
        );
    }

    #[test]
    fn shared_plugin_allocation_comes_from_the_mounted_uverbs_nodes() {
        let dir = tempfile::tempdir().unwrap();
        let fs = sriov_node(dir.path());
        fs.uverbs(0, "mlx5_0");
        std::fs::write(dir.path().join("dev/infiniband/uverbs9"), "").unwrap();
        std::fs::write(dir.path().join("dev/infiniband/rdma_cm"), "").unwrap();
        let a = allocation(dir.path(), vars(&[])).unwrap();
        assert_eq!(a.source, Source::DevNodes);
        assert_eq!(a.devices.iter().collect::<Vec<_>>(), ["mlx5_0"]);
        assert_eq!(a.unmatched.len(), 1, "{:?}", a.unmatched);
        assert!(a.unmatched[0].contains("uverbs9"));
    }

    #[test]
    fn nothing_allocated_means_unrestricted() {
        let dir = tempfile::tempdir().unwrap();
        sriov_node(dir.path());
        let a = allocation(dir.path(), vars(&[("PCIDEVICE_X", "0000:3b:00.4")])).unwrap();
        assert_eq!(a.source, Source::Unrestricted);
        assert!(a.restriction().is_none());
        assert_eq!(a.unmatched.len(), 1, "still visible: {:?}", a.unmatched);
    }
}
