//! The command line and environment, checked once into a [`Config`].

use std::path::{Path, PathBuf};

use clap::Parser;
use kvfabric_proto::contract::csi;

use crate::{Error, Result};

/// Where the agents' socket directories live on the node (the operator's `--socket-root`).
pub const DEFAULT_SOCKET_ROOT: &str = "/var/run/kvfabric";
/// The kubelet's root directory.
pub const DEFAULT_KUBELET_DIR: &str = "/var/lib/kubelet";
/// Most volumes published on one node at once: two per pod on the node is far above any GPU
/// node's pod count, and bounds the mounts and state files a flood of pods can make.
pub const DEFAULT_MAX_VOLUMES: usize = 1024;

/// `kvfabric-csi`: hands pods their kvfabric agent's socket directory.
#[derive(Debug, Parser)]
#[command(name = "kvfabric-csi", version)]
pub struct Cli {
    /// The node's name (the DaemonSet gives `spec.nodeName`).
    #[arg(long, env = "KVFABRIC_NODE_NAME")]
    pub node_id: String,
    /// Root of the socket directories: `<root>/<namespace>/<fabric>/<pool>`.
    #[arg(long, env = "KVFABRIC_SOCKET_ROOT", default_value = DEFAULT_SOCKET_ROOT)]
    pub socket_root: PathBuf,
    /// The kubelet's root directory; targets must lie in its `pods/`.
    #[arg(long, env = "KVFABRIC_KUBELET_DIR", default_value = DEFAULT_KUBELET_DIR)]
    pub kubelet_dir: PathBuf,
    /// Most volumes published on this node at once.
    #[arg(long, env = "KVFABRIC_CSI_MAX_VOLUMES", default_value_t = DEFAULT_MAX_VOLUMES)]
    pub max_volumes: usize,
}

/// The driver's settings, checked.
#[derive(Clone, Debug)]
pub struct Config {
    pub node_id: String,
    pub socket_root: PathBuf,
    pub kubelet_dir: PathBuf,
    pub max_volumes: usize,
}

fn absolute(field: &'static str, path: &Path) -> Result<PathBuf> {
    if path.is_absolute() && path != Path::new("/") {
        Ok(path.to_path_buf())
    } else {
        Err(Error::Config {
            field,
            value: path.display().to_string(),
            reason: "must be an absolute path other than /".to_owned(),
        })
    }
}

impl Cli {
    pub fn config(&self) -> Result<Config> {
        if self.node_id.is_empty() || self.node_id.len() > 253 {
            return Err(Error::Config {
                field: "--node-id",
                value: self.node_id.clone(),
                reason: "must be the node's name (1-253 characters)".to_owned(),
            });
        }
        if self.max_volumes == 0 {
            return Err(Error::Config {
                field: "--max-volumes",
                value: "0".to_owned(),
                reason: "must be at least 1".to_owned(),
            });
        }
        Ok(Config {
            node_id: self.node_id.clone(),
            socket_root: absolute("--socket-root", &self.socket_root)?,
            kubelet_dir: absolute("--kubelet-dir", &self.kubelet_dir)?,
            max_volumes: self.max_volumes,
        })
    }
}

impl Config {
    /// The CSI socket the kubelet dials, in its plugins directory.
    pub fn csi_socket(&self) -> PathBuf {
        self.kubelet_dir
            .join("plugins")
            .join(csi::DRIVER)
            .join("csi.sock")
    }

    /// The registration socket the kubelet's plugin watcher finds.
    pub fn registration_socket(&self) -> PathBuf {
        self.kubelet_dir
            .join("plugins_registry")
            .join(format!("{}-reg.sock", csi::DRIVER))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config> {
        let mut argv = vec!["kvfabric-csi"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).expect("parses").config()
    }

    #[test]
    fn defaults_and_socket_paths() {
        let c = parse(&["--node-id", "gpu-1"]).expect("valid");
        assert_eq!(c.socket_root, Path::new("/var/run/kvfabric"));
        assert_eq!(
            c.csi_socket(),
            Path::new("/var/lib/kubelet/plugins/csi.kvfabric.io/csi.sock")
        );
        assert_eq!(
            c.registration_socket(),
            Path::new("/var/lib/kubelet/plugins_registry/csi.kvfabric.io-reg.sock")
        );
        assert_eq!(c.max_volumes, DEFAULT_MAX_VOLUMES);
    }

    #[test]
    fn bad_settings_name_their_flag() {
        for (args, flag) in [
            (&["--node-id", ""][..], "--node-id"),
            (&["--node-id", "n", "--socket-root", "run"], "--socket-root"),
            (&["--node-id", "n", "--kubelet-dir", "/"], "--kubelet-dir"),
            (&["--node-id", "n", "--max-volumes", "0"], "--max-volumes"),
        ] {
            let e = parse(args).expect_err("refused").to_string();
            assert!(e.starts_with(flag), "{args:?}: {e}");
        }
    }
}
