//! What this node has: GPUs, RDMA devices, NUMA nodes, addresses. Published in the agent's
//! registry entry so peers (and `kvfabric status`) can see what transports a node can offer.
//!
//! `discover()` looks at this machine; `discover_in(root, probes)` reads the sysfs parts under
//! `root` (a fixture tree in tests) and takes the GPU and address lists from `probes`. RDMA
//! devices come from the engine's sysfs reader, so the agent and the engine see the same thing.
//! Discovery blocks (file reads, the CUDA driver's first load): call it from `spawn_blocking`.

use std::net::IpAddr;
use std::path::Path;

use kvfabric_engine::cuda::CudaDeviceInfo;
use kvfabric_engine::rdma::{self, GidChoice};

pub use kvfabric_proto::entry::{Address, Devices, Gpu, NumaNode, RdmaDevice, RdmaPort};

/// What discovery needs that is not under the sysfs root.
#[derive(Debug)]
pub struct Probes {
    /// The CUDA driver's GPU list (`NoCudaDriver` on machines without one).
    pub gpus: kvfabric_engine::Result<Vec<CudaDeviceInfo>>,
    /// Interface addresses, loopback included or not (it is filtered out).
    pub addresses: std::io::Result<Vec<Address>>,
}

impl Probes {
    /// This machine's driver and interfaces.
    pub fn system() -> Probes {
        Probes {
            gpus: kvfabric_engine::cuda::devices(),
            addresses: if_addrs::get_if_addrs().map(|ifs| {
                ifs.into_iter()
                    .map(|i| Address {
                        ip: i.ip(),
                        interface: i.name,
                    })
                    .collect()
            }),
        }
    }
}

/// Everything this machine has.
pub fn discover() -> Devices {
    discover_in(Path::new("/"), Probes::system())
}

/// Devices with sysfs read under `root` (standing for `/`) and the rest from `probes`.
pub fn discover_in(root: &Path, probes: Probes) -> Devices {
    let mut d = Devices::default();
    gpus(root, probes.gpus, &mut d);
    rdma_devices(root, &mut d);
    numa_nodes(root, &mut d);
    match probes.addresses {
        Ok(list) => {
            d.addresses = list.into_iter().filter(|a| !is_loopback(a.ip)).collect();
            d.addresses
                .sort_by(|a, b| (&a.interface, a.ip).cmp(&(&b.interface, b.ip)));
            d.addresses.dedup();
            if d.addresses.is_empty() {
                d.notes.push("no non-loopback interface addresses".into());
            }
        }
        Err(e) => d.notes.push(format!("interface addresses not listed: {e}")),
    }
    d
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

fn gpus(root: &Path, probe: kvfabric_engine::Result<Vec<CudaDeviceInfo>>, d: &mut Devices) {
    match probe {
        Ok(list) if list.is_empty() => d.notes.push("the CUDA driver reports no GPUs".into()),
        Ok(list) => {
            d.gpus = list
                .into_iter()
                .map(|g| {
                    let bus = rdma::sysfs::normalize_pci_address(&g.pci_bus_id);
                    Gpu {
                        ordinal: g.ordinal,
                        uuid: g.uuid,
                        name: g.name,
                        numa_node: bus
                            .as_deref()
                            .and_then(|b| rdma::sysfs::pci_numa_node(root, b)),
                        pci_bus_id: bus.unwrap_or(g.pci_bus_id),
                        memory_bytes: g.memory_bytes,
                    }
                })
                .collect()
        }
        // NoCudaDriver reads "no CUDA driver: <why>".
        Err(e) => d.notes.push(e.to_string()),
    }
}

fn rdma_devices(root: &Path, d: &mut Devices) {
    let nics = match rdma::sysfs::nics(root) {
        Ok(n) => n,
        Err(e) => {
            d.notes.push(format!("RDMA devices not listed: {e}"));
            return;
        }
    };
    if nics.is_empty() {
        d.notes
            .push("no RDMA devices (the kernel lists none under /sys/class/infiniband)".into());
    }
    for nic in nics {
        let ports = nic
            .ports
            .iter()
            .map(|p| {
                let gid = rdma::select::select_gid(&nic.name, p, GidChoice::Auto).ok();
                RdmaPort {
                    port: p.port,
                    state: p.state.to_string(),
                    link_layer: p.link_layer.to_string(),
                    active_mtu: p.active_mtu.map(|m| m.bytes()),
                    gid_index: gid.as_ref().map(|(g, _)| g.index),
                    gid: gid.map(|(g, why)| format!("{} {why}", g.gid)),
                }
            })
            .collect();
        d.rdma.push(RdmaDevice {
            name: nic.name,
            ports,
            numa_node: nic.numa_node,
            pci_address: nic.pci_address,
        });
    }
}

fn numa_nodes(root: &Path, d: &mut Devices) {
    let dir = root.join("sys/devices/system/node");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) => {
            d.notes.push(format!(
                "no NUMA information ({} unreadable: {e})",
                dir.display()
            ));
            return;
        }
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let Some(id) = name
            .to_str()
            .and_then(|n| n.strip_prefix("node"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Ok(cpus) = std::fs::read_to_string(entry.path().join("cpulist")) {
            d.numa_nodes.push(NumaNode {
                id,
                cpus: cpus.trim().to_string(),
            });
        }
    }
    d.numa_nodes.sort_by_key(|n| n.id);
    if d.numa_nodes.is_empty() {
        d.notes
            .push(format!("no NUMA nodes listed under {}", dir.display()));
    }
}

#[cfg(test)]
mod tests {
    use kvfabric_engine::rdma::sysfs::fixture::FakeSysfs;

    use super::*;

    fn no_driver() -> kvfabric_engine::Result<Vec<CudaDeviceInfo>> {
        Err(kvfabric_engine::Error::NoCudaDriver {
            reason: "libcuda.so.1 not found".into(),
        })
    }

    fn addr(interface: &str, ip: &str) -> Address {
        Address {
            interface: interface.into(),
            ip: ip.parse().unwrap(),
        }
    }

    #[test]
    fn a_full_node_is_listed_with_numa_and_pci_positions() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FakeSysfs::new(dir.path());
        fs.numa_node(1, "24-47,72-95");
        fs.numa_node(0, "0-23,48-71");
        std::fs::create_dir_all(dir.path().join("sys/devices/system/node/power")).unwrap();
        fs.pci_function(&["pci0000:3a", "0000:3a:00.0", "0000:3b:00.0"], 0);
        fs.nic("mlx5_0", &["pci0000:3a", "0000:3a:00.0", "0000:3c:00.0"], 0);
        fs.port("mlx5_0", 1, "4: ACTIVE", "Ethernet", 0);
        fs.gid("mlx5_0", 1, 0, "fe80::1", "IB/RoCE v1", "ens1");
        fs.gid("mlx5_0", 1, 3, "::ffff:10.0.0.7", "RoCE v2", "ens1");
        fs.netdev("ens1", 1500);
        fs.nic("mlx5_1", &["pci0000:d7", "0000:d7:00.0", "0000:d8:00.0"], 1);
        fs.port("mlx5_1", 1, "1: DOWN", "InfiniBand", 0);
        let probes = Probes {
            gpus: Ok(vec![CudaDeviceInfo {
                ordinal: 0,
                name: "NVIDIA H200".into(),
                uuid: "GPU-00112233-4455-6677-8899-aabbccddeeff".into(),
                pci_bus_id: "00000000:3B:00.0".into(),
                memory_bytes: 150_000_000_000,
            }]),
            addresses: Ok(vec![
                addr("lo", "127.0.0.1"),
                addr("lo", "::1"),
                addr("eth0", "10.0.0.7"),
                addr("eth0", "fd00::7"),
            ]),
        };
        let d = discover_in(dir.path(), probes);
        assert!(d.notes.is_empty(), "{:?}", d.notes);
        assert_eq!(
            d.gpus,
            [Gpu {
                ordinal: 0,
                uuid: "GPU-00112233-4455-6677-8899-aabbccddeeff".into(),
                name: "NVIDIA H200".into(),
                pci_bus_id: "0000:3b:00.0".into(),
                memory_bytes: 150_000_000_000,
                numa_node: Some(0),
            }]
        );
        assert_eq!(d.rdma.len(), 2);
        assert_eq!(d.rdma[0].name, "mlx5_0");
        assert_eq!(d.rdma[0].pci_address.as_deref(), Some("0000:3c:00.0"));
        assert_eq!(d.rdma[0].numa_node, Some(0));
        let p = &d.rdma[0].ports[0];
        assert_eq!(
            (p.state.as_str(), p.link_layer.as_str()),
            ("ACTIVE", "Ethernet")
        );
        assert_eq!(p.active_mtu, Some(1024));
        assert_eq!(p.gid_index, Some(3));
        assert!(p.gid.as_deref().unwrap().contains("RoCE v2, IPv4"), "{p:?}");
        let p = &d.rdma[1].ports[0];
        assert_eq!(
            (p.state.as_str(), p.link_layer.as_str()),
            ("DOWN", "InfiniBand")
        );
        assert_eq!((p.gid_index, p.active_mtu), (None, None));
        assert_eq!(
            d.numa_nodes,
            [
                NumaNode {
                    id: 0,
                    cpus: "0-23,48-71".into()
                },
                NumaNode {
                    id: 1,
                    cpus: "24-47,72-95".into()
                },
            ]
        );
        assert_eq!(
            d.addresses,
            [addr("eth0", "10.0.0.7"), addr("eth0", "fd00::7")]
        );
        // What goes into the registry entry.
        let back: Devices = serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
        assert_eq!(back, d);
    }

    #[test]
    fn an_empty_machine_says_why_each_list_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let d = discover_in(
            dir.path(),
            Probes {
                gpus: no_driver(),
                addresses: Err(std::io::Error::other("netlink refused")),
            },
        );
        assert!(d.gpus.is_empty() && d.rdma.is_empty() && d.numa_nodes.is_empty());
        let notes = d.notes.join("\n");
        assert!(notes.contains("no CUDA driver"), "{notes}");
        assert!(notes.contains("no RDMA devices"), "{notes}");
        assert!(notes.contains("no NUMA information"), "{notes}");
        assert!(notes.contains("netlink refused"), "{notes}");
        // Old registry entries without the new fields still parse.
        let old = r#"{"gpus":[],"rdma":[{"name":"m","ports":[{"port":1,"state":"ACTIVE",
            "link_layer":"Ethernet"}],"numa_node":null,"pci_address":null}],
            "numa_nodes":[],"addresses":[]}"#;
        let parsed: Devices = serde_json::from_str(old).unwrap();
        assert_eq!(parsed.rdma[0].ports[0].gid, None);
    }

    #[test]
    fn a_driver_with_no_gpus_and_only_loopback_are_noted() {
        let dir = tempfile::tempdir().unwrap();
        let d = discover_in(
            dir.path(),
            Probes {
                gpus: Ok(vec![]),
                addresses: Ok(vec![
                    addr("lo", "127.0.0.1"),
                    addr("lo", "::ffff:127.0.0.1"),
                ]),
            },
        );
        let notes = d.notes.join("\n");
        assert!(notes.contains("reports no GPUs"), "{notes}");
        assert!(notes.contains("no non-loopback"), "{notes}");
    }

    /// This machine: never panics, and anything missing is explained.
    #[test]
    fn discovering_this_machine_never_panics() {
        let d = discover();
        println!("{}", serde_json::to_string_pretty(&d).unwrap());
        if d.gpus.is_empty() {
            assert!(
                d.notes
                    .iter()
                    .any(|n| n.contains("CUDA") || n.contains("GPU")),
                "{:?}",
                d.notes
            );
        }
        if d.rdma.is_empty() {
            assert!(d.notes.iter().any(|n| n.contains("RDMA")), "{:?}", d.notes);
        }
    }
}
