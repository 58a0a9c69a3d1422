//! What a `NodePublishVolume` asks, checked: no I/O here, so every rule is tested on its own.
//! The kubelet is the only caller, but most of what it sends was written by whoever made the
//! pod: the namespace comes from the kubelet (the `CSIDriver`'s `podInfoOnMount`, which
//! overrides a pod's attribute of the same name), fabric and pool from the pod. The directory a
//! pod gets is always `<socketRoot>/<its namespace>/<fabric>/<pool>`, so a pod reaches only its
//! own namespace's fabrics, whatever it writes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kvfabric_proto::contract::{csi, is_dns_label};

use crate::pb::csi::NodePublishVolumeRequest;
use crate::pb::csi::volume_capability::AccessType;
use crate::{Error, Result};

/// Longest volume id: the kubelet's ephemeral ids are `csi-` and a 64-hex-digit hash.
pub const MAX_VOLUME_ID: usize = 128;

/// One published volume: where it is mounted and which socket directory it shows.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Volume {
    pub volume_id: String,
    /// The mount point the kubelet chose, in its pods directory.
    pub target: PathBuf,
    /// `<namespace>/<fabric>/<pool>`, under the socket root.
    pub dir: PathBuf,
    /// Mounted read-only (a worker's `readOnly: true`; the agent's volume is read-write).
    pub readonly: bool,
}

/// A volume id, as the kubelet makes them: a file name of ASCII letters, digits, '.', '_' and
/// '-', never `.` or `..` (the driver keeps one state file per volume, named by it).
pub fn check_volume_id(id: &str) -> Result<&str> {
    let ok = (1..=MAX_VOLUME_ID).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && id != "."
        && id != "..";
    if ok {
        Ok(id)
    } else {
        Err(Error::invalid(
            "volume_id",
            id,
            "must be 1-128 ASCII letters, digits, '.', '_' or '-'",
        ))
    }
}

/// A target path: absolute, normal (no `.`, `..` or `//`), and inside the kubelet's pods
/// directory, so no request mounts over a path of the node.
pub fn check_target(target: &str, kubelet_dir: &Path) -> Result<PathBuf> {
    let path = Path::new(target);
    // Checked on the text: `Path::components` would drop the `.` and `//` it should refuse.
    let normal = target
        .strip_prefix('/')
        .is_some_and(|rest| rest.split('/').all(|s| !matches!(s, "" | "." | "..")));
    if !normal {
        return Err(Error::invalid(
            "target_path",
            target,
            "must be an absolute path without '.', '..' or empty components",
        ));
    }
    let pods = kubelet_dir.join("pods");
    if !path.starts_with(&pods) || path == pods {
        return Err(Error::invalid(
            "target_path",
            target,
            "must be inside the kubelet's pods directory (--kubelet-dir)",
        ));
    }
    Ok(path.to_path_buf())
}

fn attribute<'a>(
    context: &'a HashMap<String, String>,
    key: &'static str,
    field: &'static str,
) -> Result<&'a str> {
    let value = context.get(key).map(String::as_str).ok_or(Error::Invalid {
        field,
        value: String::new(),
        reason: "is required",
    })?;
    if is_dns_label(value) {
        Ok(value)
    } else {
        Err(Error::invalid(field, value, "must be a DNS label"))
    }
}

/// The volume a publish request describes, or the first field it gets wrong.
pub fn publish_request(req: &NodePublishVolumeRequest, kubelet_dir: &Path) -> Result<Volume> {
    let volume_id = check_volume_id(&req.volume_id)?.to_owned();
    let target = check_target(&req.target_path, kubelet_dir)?;
    match req
        .volume_capability
        .as_ref()
        .and_then(|c| c.access_type.as_ref())
    {
        Some(AccessType::Mount(_)) => {}
        Some(AccessType::Block(_)) => {
            return Err(Error::invalid(
                "volume_capability",
                "block",
                "a socket directory is a mount volume, never a block device",
            ));
        }
        None => {
            return Err(Error::invalid(
                "volume_capability",
                "",
                "is required (a mount volume)",
            ));
        }
    }
    if !req.staging_target_path.is_empty() {
        return Err(Error::invalid(
            "staging_target_path",
            &req.staging_target_path,
            "the driver does not stage volumes",
        ));
    }
    let context = &req.volume_context;
    let known = [
        csi::FABRIC_ATTRIBUTE,
        csi::POOL_ATTRIBUTE,
        csi::POD_NAMESPACE_ATTRIBUTE,
        csi::EPHEMERAL_ATTRIBUTE,
    ];
    // A misspelt attribute fails the pod's start, rather than naming a directory nobody serves.
    if let Some(key) = context
        .keys()
        .find(|k| !known.contains(&k.as_str()) && !csi::POD_INFO_ATTRIBUTES.contains(&k.as_str()))
    {
        return Err(Error::invalid(
            "volume_context",
            key,
            "is not an attribute of this driver (fabric, pool)",
        ));
    }
    if context.get(csi::EPHEMERAL_ATTRIBUTE).map(String::as_str) != Some("true") {
        return Err(Error::invalid(
            "volume_context[csi.storage.k8s.io/ephemeral]",
            context
                .get(csi::EPHEMERAL_ATTRIBUTE)
                .map_or("", String::as_str),
            "the driver serves ephemeral inline volumes only (a pod's `csi:` volume)",
        ));
    }
    let namespace = attribute(
        context,
        csi::POD_NAMESPACE_ATTRIBUTE,
        "volume_context[csi.storage.k8s.io/pod.namespace] (the CSIDriver's podInfoOnMount)",
    )?;
    let fabric = attribute(context, csi::FABRIC_ATTRIBUTE, "volume_context[fabric]")?;
    let pool = attribute(context, csi::POOL_ATTRIBUTE, "volume_context[pool]")?;
    Ok(Volume {
        volume_id,
        target,
        dir: [namespace, fabric, pool].iter().collect(),
        readonly: req.readonly,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::csi::VolumeCapability;
    use crate::pb::csi::volume_capability::{BlockVolume, MountVolume};

    const KUBELET: &str = "/var/lib/kubelet";
    const TARGET: &str = "/var/lib/kubelet/pods/0b5c/volumes/kubernetes.io~csi/sockets/mount";

    fn request() -> NodePublishVolumeRequest {
        NodePublishVolumeRequest {
            volume_id: "csi-0123abcd".to_owned(),
            target_path: TARGET.to_owned(),
            volume_capability: Some(VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume::default())),
                access_mode: None,
            }),
            readonly: true,
            volume_context: HashMap::from([
                ("fabric".to_owned(), "llama".to_owned()),
                ("pool".to_owned(), "decode".to_owned()),
                (csi::POD_NAMESPACE_ATTRIBUTE.to_owned(), "llm".to_owned()),
                (csi::EPHEMERAL_ATTRIBUTE.to_owned(), "true".to_owned()),
                ("csi.storage.k8s.io/pod.name".to_owned(), "w-0".to_owned()),
            ]),
            ..NodePublishVolumeRequest::default()
        }
    }

    fn refused(req: &NodePublishVolumeRequest) -> String {
        publish_request(req, Path::new(KUBELET))
            .expect_err("refused")
            .to_string()
    }

    #[test]
    fn a_pods_volume_names_its_own_namespaces_pool() {
        let v = publish_request(&request(), Path::new(KUBELET)).expect("valid");
        assert_eq!(v.dir, Path::new("llm/llama/decode"));
        assert_eq!(v.target, Path::new(TARGET));
        assert!(v.readonly);
        assert_eq!(v.volume_id, "csi-0123abcd");
    }

    #[test]
    fn names_that_could_leave_the_directory_are_refused() {
        for (key, bad) in [
            ("fabric", ".."),
            ("fabric", "a/b"),
            ("pool", "."),
            ("pool", "Decode"),
            ("pool", ""),
            ("pool", "-x"),
            (csi::POD_NAMESPACE_ATTRIBUTE, "../etc"),
        ] {
            let mut r = request();
            r.volume_context.insert(key.to_owned(), bad.to_owned());
            let e = refused(&r);
            assert!(e.contains("volume_context["), "{key}={bad}: {e}");
        }
        for id in ["", "..", "a/b", &"x".repeat(129)] {
            let mut r = request();
            r.volume_id = id.to_owned();
            assert!(refused(&r).starts_with("volume_id"), "{id}");
        }
    }

    #[test]
    fn targets_stay_in_the_pods_directory() {
        for t in [
            "relative/path",
            "/var/lib/kubelet/pods/../../../etc",
            "/var/lib/kubelet/pods/./x",
            "/var/lib/kubelet/pods//x",
            "/var/lib/kubelet/pods",
            "/var/lib/kubelet/plugins/x",
            "/etc",
        ] {
            let mut r = request();
            r.target_path = t.to_owned();
            assert!(refused(&r).starts_with("target_path"), "{t}");
        }
    }

    #[test]
    fn missing_or_unknown_attributes_and_other_kinds_are_refused() {
        let mut r = request();
        r.volume_context.remove(csi::POD_NAMESPACE_ATTRIBUTE);
        assert!(refused(&r).contains("podInfoOnMount"));
        let mut r = request();
        r.volume_context.remove("pool");
        assert!(refused(&r).contains("volume_context[pool]"));
        let mut r = request();
        r.volume_context
            .insert("fabirc".to_owned(), "llama".to_owned());
        assert!(refused(&r).contains("\"fabirc\""));
        let mut r = request();
        r.volume_context.remove(csi::EPHEMERAL_ATTRIBUTE);
        assert!(refused(&r).contains("ephemeral"));
        let mut r = request();
        r.volume_capability = Some(VolumeCapability {
            access_type: Some(AccessType::Block(BlockVolume {})),
            access_mode: None,
        });
        assert!(refused(&r).starts_with("volume_capability"));
        let mut r = request();
        r.volume_capability = None;
        assert!(refused(&r).starts_with("volume_capability"));
        let mut r = request();
        r.staging_target_path = "/var/lib/kubelet/plugins/x".to_owned();
        assert!(refused(&r).starts_with("staging_target_path"));
    }
}
