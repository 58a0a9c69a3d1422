//! The volumes this node has published, one JSON file each in the state directory, so a
//! restarted driver still knows which pods use a socket directory and removes it only when the
//! last one has gone. The state directory lives in the socket root (a tmpfs on most nodes, as
//! the mounts are: after a reboot both are gone and the kubelet publishes again).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::volume::{Volume, check_volume_id};
use crate::{Error, Result};

/// Name of the state directory in the socket root: a namespace name never starts with a dot.
pub const STATE_DIR: &str = ".csi-volumes";

/// The published volumes by id, written through to disk.
#[derive(Debug)]
pub struct Ledger {
    dir: PathBuf,
    volumes: BTreeMap<String, Volume>,
}

impl Ledger {
    /// Reads the state directory under `socket_root`, creating it if needed. A file that does
    /// not parse is reported and left for a person, never guessed at.
    pub fn open(socket_root: &Path) -> Result<Self> {
        let dir = socket_root.join(STATE_DIR);
        std::fs::create_dir_all(&dir).map_err(Error::io(format!("create {}", dir.display())))?;
        let mut volumes = BTreeMap::new();
        let entries =
            std::fs::read_dir(&dir).map_err(Error::io(format!("list {}", dir.display())))?;
        for entry in entries {
            let path = entry
                .map_err(Error::io(format!("list {}", dir.display())))?
                .path();
            let read = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Volume>(&b).map_err(|e| e.to_string()));
            match read {
                Ok(v) if path.file_name() == Some(v.volume_id.as_ref()) => {
                    volumes.insert(v.volume_id.clone(), v);
                }
                Ok(_) => {
                    tracing::warn!(file = %path.display(), "state file names another volume; ignored")
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "unreadable state file; ignored")
                }
            }
        }
        Ok(Ledger { dir, volumes })
    }

    pub fn get(&self, volume_id: &str) -> Option<&Volume> {
        self.volumes.get(volume_id)
    }

    pub fn len(&self) -> usize {
        self.volumes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.volumes.is_empty()
    }

    /// Whether any volume shows `dir`.
    pub fn uses(&self, dir: &Path) -> bool {
        self.volumes.values().any(|v| v.dir == dir)
    }

    /// Writes the record (a new file, renamed into place) before the mount is made, so a crash
    /// between the two leaves a record the kubelet's unpublish clears, never an unknown mount.
    pub fn record(&mut self, volume: Volume) -> Result<()> {
        let id = check_volume_id(&volume.volume_id)?;
        let path = self.dir.join(id);
        let tmp = self.dir.join(format!(".{id}.tmp"));
        let bytes = serde_json::to_vec(&volume).map_err(|e| Error::Io {
            action: format!("encode {}", path.display()),
            source: e.into(),
        })?;
        std::fs::write(&tmp, bytes).map_err(Error::io(format!("write {}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(Error::io(format!("rename to {}", path.display())))?;
        self.volumes.insert(volume.volume_id.clone(), volume);
        Ok(())
    }

    /// Forgets a volume; `None` if it was not recorded.
    pub fn forget(&mut self, volume_id: &str) -> Result<Option<Volume>> {
        let Some(v) = self.volumes.remove(volume_id) else {
            return Ok(None);
        };
        let path = self.dir.join(check_volume_id(volume_id)?);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(Some(v)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Some(v)),
            Err(e) => {
                self.volumes.insert(volume_id.to_owned(), v);
                Err(Error::io(format!("remove {}", path.display()))(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(id: &str, dir: &str) -> Volume {
        Volume {
            volume_id: id.to_owned(),
            target: PathBuf::from(format!("/var/lib/kubelet/pods/{id}/mount")),
            dir: PathBuf::from(dir),
            readonly: false,
        }
    }

    #[test]
    fn records_survive_a_reopen_and_garbage_is_skipped() {
        let root = tempfile::tempdir().expect("tmp");
        let mut l = Ledger::open(root.path()).expect("opens");
        l.record(volume("csi-a", "llm/f/p")).expect("a");
        l.record(volume("csi-b", "llm/f/p")).expect("b");
        l.record(volume("csi-c", "llm/f/q")).expect("c");
        std::fs::write(root.path().join(STATE_DIR).join("csi-x"), b"not json").expect("junk");
        std::fs::write(
            root.path().join(STATE_DIR).join("csi-y"),
            serde_json::to_vec(&volume("csi-z", "llm/f/p")).expect("json"),
        )
        .expect("misnamed");
        let mut l = Ledger::open(root.path()).expect("reopens");
        assert_eq!(l.len(), 3);
        assert_eq!(l.get("csi-b"), Some(&volume("csi-b", "llm/f/p")));
        assert!(l.forget("csi-a").expect("forgets").is_some());
        assert!(l.uses(Path::new("llm/f/p")));
        assert!(l.forget("csi-b").expect("forgets").is_some());
        assert!(!l.uses(Path::new("llm/f/p")));
        assert!(l.forget("csi-b").expect("twice").is_none());
        assert_eq!(Ledger::open(root.path()).expect("reopens").len(), 1);
    }
}
