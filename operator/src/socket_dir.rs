//! The agent's socket directory on the node. The kubelet creates a `DirectoryOrCreate` hostPath
//! as root:root 0755, where a non-root agent cannot bind a socket and the workers' group has no
//! say; `kvfabric-socket-dir` (the init container of every agent pod) hands it to the agent's
//! user and the socket group, set-group-ID so the sockets inherit that group.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::{Error, Result};

/// The mode bits a socket directory may have: setgid, rwx for user and group, r-x for others;
/// never setuid, sticky or world-writable.
pub const ALLOWED_MODE: u32 = 0o2775;

fn io(action: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { action, source }
}

/// Creates `dir` if needed, and gives it `uid`, `gid` and `mode`; checks the result, since the
/// kernel drops setgid silently when the caller is not in `gid`.
pub fn prepare(dir: &Path, uid: u32, gid: u32, mode: u32) -> Result<()> {
    if mode & !ALLOWED_MODE != 0 {
        return Err(Error::Config {
            field: "--mode",
            value: format!("{mode:o}"),
            reason: "only the setgid bit and rwxrwxr-x are allowed (never setuid, sticky or o+w)"
                .to_owned(),
        });
    }
    let shown = dir.display().to_string();
    std::fs::create_dir_all(dir).map_err(io(format!("create {shown}")))?;
    let meta = std::fs::symlink_metadata(dir).map_err(io(format!("stat {shown}")))?;
    if !meta.file_type().is_dir() {
        return Err(Error::Config {
            field: "--dir",
            value: shown,
            reason: "is not a directory (a symlink or file is never followed)".to_owned(),
        });
    }
    std::os::unix::fs::chown(dir, Some(uid), Some(gid)).map_err(io(format!(
        "chown {shown} to {uid}:{gid} (needs CAP_CHOWN)"
    )))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
        .map_err(io(format!("chmod {shown} to {mode:o} (needs CAP_FOWNER)")))?;
    let meta = std::fs::symlink_metadata(dir).map_err(io(format!("stat {shown}")))?;
    let got = meta.mode() & 0o7777;
    if meta.uid() != uid || meta.gid() != gid || got != mode {
        return Err(Error::Config {
            field: "--dir",
            value: shown,
            reason: format!(
                "is {}:{} {got:o} after the change, wanted {uid}:{gid} {mode:o} (is the process in group {gid}?)",
                meta.uid(),
                meta.gid()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("kvfabric-socket-dir-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn creates_and_sets_owner_and_mode_twice() {
        let d = tmp("ok").join("llm/tf/prefill");
        // Our own ids: allowed without privilege, and what the init container does for root.
        // Our own ids (read off a directory we create): a change to them needs no privilege.
        let probe = tmp("probe");
        std::fs::create_dir_all(&probe).expect("probe");
        let m = std::fs::metadata(&probe).expect("probe");
        let (uid, gid) = (m.uid(), m.gid());
        let _ = std::fs::remove_dir_all(&probe);
        for _ in 0..2 {
            prepare(&d, uid, gid, 0o2750).expect("prepares");
            let m = std::fs::metadata(&d).expect("stat");
            assert_eq!(m.mode() & 0o7777, 0o2750);
            assert_eq!((m.uid(), m.gid()), (uid, gid));
        }
        prepare(&d, uid, gid, 0o700).expect("tightens");
        assert_eq!(std::fs::metadata(&d).expect("stat").mode() & 0o7777, 0o700);
        let _ = std::fs::remove_dir_all(tmp("ok"));
    }

    #[test]
    fn refuses_dangerous_modes_and_symlinks() {
        let d = tmp("bad");
        for mode in [0o4750, 0o1777, 0o2757, 0o777] {
            let e = prepare(&d, 0, 0, mode).expect_err("refused");
            assert!(e.to_string().contains("--mode"), "{e}");
        }
        let target = tmp("target");
        std::fs::create_dir_all(&target).expect("target");
        std::os::unix::fs::symlink(&target, &d).expect("symlink");
        let e = prepare(&d, 0, 0, 0o2750).expect_err("symlink refused");
        assert!(e.to_string().contains("not a directory"), "{e}");
        let _ = std::fs::remove_file(&d);
        let _ = std::fs::remove_dir_all(&target);
    }
}
