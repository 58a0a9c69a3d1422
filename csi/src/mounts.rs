//! The bind mounts: one from the socket directory onto each pod's target, read-only for
//! workers, never with devices, set-user-ID files or execution (a socket directory needs none).

use std::path::Path;

use rustix::io::Errno;
use rustix::mount::{MountFlags, UnmountFlags, mount_bind, mount_remount, unmount};

use crate::{Error, Result};

/// Whether `path` is a mount point in this process's mount namespace (the
/// `/proc/self/mountinfo` entries, their octal escapes undone).
pub fn is_mount_point(path: &Path) -> Result<bool> {
    Ok(mount_points(&mountinfo()?).any(|p| Path::new(&p) == path))
}

fn mountinfo() -> Result<String> {
    std::fs::read_to_string("/proc/self/mountinfo").map_err(Error::io("read /proc/self/mountinfo"))
}

/// The mount points (fifth field) of a mountinfo text.
fn mount_points(info: &str) -> impl Iterator<Item = String> + '_ {
    info.lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape)
}

/// The kernel writes space, tab, newline and backslash in mount points as `\ooo`.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match octal {
            Some(d) => {
                let v = d.iter().fold(0u32, |v, b| v * 8 + u32::from(b - b'0'));
                out.push(u8::try_from(v).unwrap_or(b'?'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Binds `source` onto `target`, then makes it nosuid, nodev, noexec and, for `readonly`,
/// read-only. A failed second step takes the first back, so no half-made mount stays.
pub fn bind(source: &Path, target: &Path, readonly: bool) -> Result<()> {
    mount_bind(source, target).map_err(Error::mount(format!(
        "bind {} onto {}",
        source.display(),
        target.display()
    )))?;
    let mut flags = MountFlags::BIND | MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    if readonly {
        flags |= MountFlags::RDONLY;
    }
    if let Err(e) = mount_remount(target, flags, "") {
        let _ = unmount(target, UnmountFlags::DETACH);
        return Err(Error::mount(format!(
            "restrict the bind mount at {}",
            target.display()
        ))(e));
    }
    Ok(())
}

/// Unmounts `target`; a mount still busy (a process of the pod not yet gone) is detached, so
/// the kubelet's teardown never waits on it.
pub fn unbind(target: &Path) -> Result<()> {
    match unmount(target, UnmountFlags::NOFOLLOW) {
        Ok(()) => Ok(()),
        Err(Errno::BUSY) => {
            tracing::warn!(target = %target.display(), "mount busy; detached");
            unmount(target, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH)
                .map_err(Error::mount(format!("detach {}", target.display())))
        }
        Err(e) => Err(Error::mount(format!("unmount {}", target.display()))(e)),
    }
}

/// Detaches every mount at or below `dir`, deepest first, and says how many: for tests and
/// tools that clean up after the driver (which itself unmounts one target at a time).
pub fn detach_under(dir: &Path) -> Result<usize> {
    let mut points: Vec<String> = mount_points(&mountinfo()?)
        .filter(|p| Path::new(p).starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in &points {
        unmount(p.as_str(), UnmountFlags::NOFOLLOW | UnmountFlags::DETACH)
            .map_err(Error::mount(format!("detach {p}")))?;
    }
    Ok(points.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_fields_are_read_and_unescaped() {
        let info = "22 1 0:21 / /proc rw,nosuid - proc proc rw\n\
                    90 22 8:1 /x /var/lib/kubelet/pods/a/my\\040vol rw - ext4 /dev/sda1 rw\n\
                    91 22 8:1 /x /odd\\134name\\07 rw - ext4 /dev/sda1 rw\n";
        let points: Vec<String> = mount_points(info).collect();
        assert_eq!(
            points,
            ["/proc", "/var/lib/kubelet/pods/a/my vol", "/odd\\name\\07"]
        );
        assert!(is_mount_point(Path::new("/proc")).expect("reads mountinfo"));
        assert!(!is_mount_point(Path::new("/proc/self")).expect("reads mountinfo"));
    }
}
