#!/usr/bin/env bash
# Builds the operator and agent images here, without a container daemon, into OCI image archives:
#   1. release binaries with cargo (kvfabric-operator; kvfabric-socket-dir and kvfabric-csi;
#      kvfabric with --features rdma,cuda);
#   2. a minimal Debian bookworm root filesystem per image from mmdebstrap (only the listed
#      packages, extracted; no shell, no package manager), cached under ~/.cache/kvfabric keyed
#      by suite, architecture, mirror, package list and recipe;
#   3. umoci: the base as one layer, the binaries as a second, the config (entrypoint, user,
#      org.opencontainers.image.* labels); skopeo writes the OCI archive, named for containerd
#      (`kind load image-archive`, `ctr images import`) and for `skopeo copy` to a registry;
#   4. checks: `skopeo inspect --config` of each archive (entrypoint, user, labels), and the
#      binaries run from the archive's own unpacked rootfs (chroot in fresh namespaces, as the
#      image's user): `kvfabric --version`, `kvfabric agent --help`, `kvfabric-operator --help`,
#      `kvfabric-socket-dir --help`, `kvfabric-csi --help`; the agent finds libibverbs and the
#      verbs providers there;
#   5. an SPDX 2.3 SBOM per image (scripts/sbom.py: binaries by checksum, the crates each links,
#      the Debian packages of the base), in the image at /usr/share/doc/kvfabric/sbom.spdx.json
#      and beside the archive; validated with PyPI's spdx-tools. The base's package control
#      files are in /var/lib/dpkg/status.d (the distroless convention scanners read).
#
#   amd64 only: an arm64 image (Grace nodes) needs the aarch64 Rust standard library from
#   rustup, which this project's machines cannot reach; on a machine that can:
#   `rustup target add aarch64-unknown-linux-gnu`, apt's gcc-aarch64-linux-gnu and qemu-user-static,
#   then the same steps with arch=arm64 and --target aarch64-unknown-linux-gnu (not automated).
#
#   scripts/build-images.sh [--out DIR]     build, check; archives in DIR (default target/images)
#   scripts/build-images.sh --print-refs    print "operator <ref>" and "agent <ref>", build nothing
#
#   KVFABRIC_IMAGE_REGISTRY  registry and path of both images (default ghcr.io/kvfabric)
#   KVFABRIC_IMAGE_TAG       tag (default: the workspace version, the chart's appVersion)
#   KVFABRIC_CACHE           cache root (default ~/.cache/kvfabric)
#   KVFABRIC_DEBIAN_MIRROR   Debian mirror (default http://deb.debian.org/debian)
#   KVFABRIC_BASE_REFRESH=1  rebuild the cached base root filesystems (e.g. for security updates)
set -euo pipefail
shopt -s inherit_errexit

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# Bump when the way a base rootfs is made changes, so cached ones are not reused.
recipe=4
suite=bookworm
arch=amd64
mirror="${KVFABRIC_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
cache="${KVFABRIC_CACHE:-$HOME/.cache/kvfabric}"
version="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)"
registry="${KVFABRIC_IMAGE_REGISTRY:-ghcr.io/kvfabric}"
tag="${KVFABRIC_IMAGE_TAG:-$version}"
operator_ref="$registry/kvfabric-operator:$tag"
agent_ref="$registry/kvfabric-agent:$tag"
user=65532

# What each image's binaries link (checked below with ld.so inside the image): glibc and
# libgcc_s for both; the agent's rdma feature links libibverbs (which links libnl), and
# ibverbs-providers holds the NIC drivers it loads (mlx5, …) and their /etc/libibverbs.d entries.
operator_pkgs=(libc6 libgcc-s1)
agent_pkgs=(libc6 libgcc-s1 libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200)

# Called by mmdebstrap as an extract hook (the extract variant runs no customize hooks):
# `__prune ROOTFS PKG...` removes the files of every extracted package that is not listed (what
# apt pulled in only for maintainer scripts, which the extract variant never runs: adduser,
# passwd, perl-base, debconf, …), the docs and the build host's files, and writes the users.
if [[ "${1:-}" == "__prune" ]]; then
    rootfs="$2"
    shift 2
    keep=" $* "
    # The kept packages' control files and checksums, where scanners (Trivy, Syft, Grype) look
    # in an image without a dpkg database (the distroless convention), and where the SBOM's
    # Debian packages come from.
    mkdir -p "$rootfs/var/lib/dpkg/status.d"
    for deb in "$rootfs"/var/cache/apt/archives/*.deb; do
        pkg="$(dpkg-deb -f "$deb" Package)"
        if [[ "$keep" == *" $pkg "* ]]; then
            dpkg-deb -f "$deb" > "$rootfs/var/lib/dpkg/status.d/$pkg"
            dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./md5sums > "$rootfs/var/lib/dpkg/status.d/$pkg.md5sums" 2>/dev/null || true
            continue
        fi
        dpkg-deb --fsys-tarfile "$deb" | tar -t | while read -r f; do
            f="${f#./}"
            if [[ -n "$f" && ! -d "$rootfs/$f" ]]; then rm -f "$rootfs/$f"; fi
        done
    done
    rm -rf "$rootfs"/usr/share/{doc,man,info,locale,lintian,bug} "$rootfs"/var/cache/debconf
    mkdir -p "$rootfs/tmp" "$rootfs/etc"
    chmod 1777 "$rootfs/tmp"
    printf 'root:x:0:0:root:/root:/usr/sbin/nologin\nnonroot:x:%s:%s:nonroot:/home/nonroot:/usr/sbin/nologin\n' \
        "$user" "$user" > "$rootfs/etc/passwd"
    printf 'root:x:0:\nnonroot:x:%s:\n' "$user" > "$rootfs/etc/group"
    printf 'passwd: files\ngroup: files\nhosts: files dns\n' > "$rootfs/etc/nsswitch.conf"
    exit 0
fi

if [[ "${1:-}" == "--print-refs" ]]; then
    echo "operator $operator_ref"
    echo "agent $agent_ref"
    exit 0
fi

out="$root/target/images"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) out="$(realpath -m "$2")"; shift 2 ;;
        *) echo "build-images: unknown argument $1" >&2; exit 64 ;;
    esac
done

started=$SECONDS
step() { echo "build-images: [$((SECONDS - started))s] $*" >&2; }

if [[ "$(id -u)" != 0 ]]; then
    echo "build-images: run as root (mmdebstrap --mode=root, umoci unpack, chroot)" >&2
    exit 1
fi
missing=()
for tool in mmdebstrap umoci skopeo dpkg-deb unshare objcopy; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    step "installing mmdebstrap umoci skopeo (missing: ${missing[*]})"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap umoci skopeo binutils >/dev/null
fi

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
step "cargo build --release (operator; agent with rdma; csi driver)"
cargo build --release --locked -p kvfabric-operator --bins
cargo build --release --locked -p kvfabric-csi --bin kvfabric-csi
cargo build --release --locked -p kvfabric-cli --no-default-features --features rdma,cuda --bin kvfabric
rel="$CARGO_TARGET_DIR/release"

# SOURCE_DATE_EPOCH: the commit time, so the images' timestamps do not change with each build.
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}"
created="$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"
revision="$(git rev-parse HEAD 2>/dev/null || echo unknown)"

base_rootfs() { # name, packages... -> prints the cached tarball
    local name="$1"
    shift
    local key
    key="$(printf '%s\n' "$recipe" "$suite" "$arch" "$mirror" "$@" | sha256sum | cut -c1-16)"
    local tarball="$cache/rootfs/$name-$suite-$key.tar"
    if [[ -f "$tarball" && "${KVFABRIC_BASE_REFRESH:-0}" != 1 ]]; then
        step "base $name: cached $tarball"
    else
        step "base $name: mmdebstrap $suite ($*)"
        mkdir -p "$cache/rootfs"
        # No device nodes in the layer: runtimes mount /dev, and rootless snapshotters cannot
        # create them.
        mmdebstrap --quiet --mode=root --variant=extract --architectures="$arch" \
            --skip=output/dev \
            --include="$(IFS=,; echo "$*")" \
            --extract-hook="$root/scripts/build-images.sh __prune \"\$1\" $*" \
            --format=tar "$suite" "$tarball.part" "$mirror" >&2
        # mmdebstrap's own files and the build host's (apt sources, resolv.conf, hostname):
        # runtimes mount resolv.conf and hostname, and nothing here runs apt.
        local host_files
        host_files="$(tar -tf "$tarball.part" | grep -E '^\./etc/(apt/|resolv\.conf|hostname|fstab)$' || true)"
        if [[ -n "$host_files" ]]; then
            # shellcheck disable=SC2086 # one member name per word
            tar --delete -f "$tarball.part" $host_files
        fi
        mv "$tarball.part" "$tarball"
        find "$cache/rootfs" -name "$name-$suite-*.tar" -not -name "$(basename "$tarball")" -delete
    fi
    echo "$tarball"
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

# Debug info off, symbols kept: backtraces still name functions, the image is far smaller.
strip_into() { # binary, destination
    install -D -m 0755 "$1" "$2"
    objcopy --strip-debug "$2"
}

# How cargo builds each binary of the images (above): the SBOM lists what each one links.
cargo_args() {
    case "$1" in
        kvfabric) echo "-p kvfabric-cli --no-default-features --features rdma,cuda" ;;
        kvfabric-operator | kvfabric-socket-dir) echo "-p kvfabric-operator" ;;
        kvfabric-csi) echo "-p kvfabric-csi" ;;
        *) echo "build-images: no cargo arguments for $1" >&2; exit 1 ;;
    esac
}

build_image() { # name ref base-tarball entrypoint cmd description binaries...
    local name="$1" ref="$2" base="$3" entrypoint="$4" cmd="$5" description="$6"
    shift 6
    local layout="$work/$name-oci"
    umoci init --layout "$layout"
    umoci new --image "$layout:build"
    umoci unpack --image "$layout:build" "$work/$name-base"
    tar -xpf "$base" -C "$work/$name-base/rootfs" --numeric-owner
    umoci repack --image "$layout:build" --history.created "$created" \
        --history.created_by "mmdebstrap --variant=extract $suite" \
        --history.comment "Debian $suite, extracted packages only: $(basename "$base")" \
        "$work/$name-base"
    umoci unpack --image "$layout:build" "$work/$name-app"
    local b sbom_bins=()
    for b in "$@"; do
        strip_into "$rel/$b" "$work/$name-app/rootfs/usr/local/bin/$b"
        sbom_bins+=(--bin "/usr/local/bin/$b=$(cargo_args "$b")")
    done
    # The SBOM goes into the image and beside its archive; the base layer's packages are read
    # from the unpacked rootfs, so the base is part of it.
    "$root/scripts/sbom.py" --image "$name" --version "$version" --revision "$revision" \
        --created "$created" --arch "$arch" --rootfs "$work/$name-app/rootfs" \
        --out "$work/$name-app/rootfs/usr/share/doc/kvfabric/sbom.spdx.json" \
        --out "$out/$name-$tag.spdx.json" "${sbom_bins[@]}"
    # Commit-time mtimes, so the same commit gives the same layer.
    find "$work/$name-app/rootfs" -newermt "@$SOURCE_DATE_EPOCH" \
        -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
    umoci repack --image "$layout:build" --history.created "$created" \
        --history.created_by "scripts/build-images.sh" --history.comment "kvfabric $version binaries" \
        "$work/$name-app"
    local args=(
        --image "$layout:build" --tag "$tag"
        --os linux --architecture "$arch" --created "$created" --author "kvfabric"
        --config.user "$user:$user" --config.workingdir /
        --config.env "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        --config.entrypoint "$entrypoint"
        --config.label "org.opencontainers.image.title=$name"
        --config.label "org.opencontainers.image.description=$description"
        --config.label "org.opencontainers.image.version=$version"
        --config.label "org.opencontainers.image.revision=$revision"
        --config.label "org.opencontainers.image.created=$created"
        --config.label "org.opencontainers.image.source=https://github.com/kvfabric/kvfabric"
        --config.label "org.opencontainers.image.licenses=Apache-2.0"
        --config.label "org.opencontainers.image.base.name=debian:$suite"
        --history.created "$created" --history.created_by "umoci config"
    )
    [[ -n "$cmd" ]] && args+=(--config.cmd "$cmd")
    umoci config "${args[@]}"
    umoci gc --layout "$layout"
    local archive="$out/$name-$tag.oci.tar"
    rm -f "$archive"
    skopeo copy --quiet "oci:$layout:$tag" "oci-archive:$archive:$ref"
    name_for_containerd "$archive" "$ref"
    step "$name: $archive ($(du -h "$archive" | cut -f1))"
}

# containerd names an imported OCI image after `io.containerd.image.name` in the index; the
# OCI ref name alone is often a bare tag. index.json is not content-addressed, so this edit
# leaves every digest as it is.
name_for_containerd() { # archive ref
    python3 - "$1" "$2" <<'PY'
import io, json, sys, tarfile
path, ref = sys.argv[1], sys.argv[2]
with tarfile.open(path) as t:
    members = [(m, t.extractfile(m).read() if m.isfile() else None) for m in t.getmembers()]
out = io.BytesIO()
with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
    for m, data in members:
        if m.name in ("index.json", "./index.json"):
            index = json.loads(data)
            for d in index["manifests"]:
                a = d.setdefault("annotations", {})
                a["org.opencontainers.image.ref.name"] = ref
                a["io.containerd.image.name"] = ref
            data = json.dumps(index, separators=(",", ":")).encode()
            m.size = len(data)
        t.addfile(m, io.BytesIO(data) if data is not None else None)
with open(path + ".part", "wb") as f:
    f.write(out.getvalue())
import os
os.replace(path + ".part", path)
PY
}

check_config() { # archive entrypoint cmd
    local archive="$1" entrypoint="$2" cmd="$3"
    skopeo inspect --config "oci-archive:$archive" > "$work/config.json"
    python3 - "$work/config.json" "$entrypoint" "$cmd" "$user" "$version" "$archive" <<'PY'
import json, sys
path, entrypoint, cmd, user, version, archive = sys.argv[1:7]
with open(path) as f:
    cfg = json.load(f)
c = cfg["config"]
labels = c.get("Labels") or {}
problems = []
if c.get("Entrypoint") != [entrypoint]:
    problems.append(f"Entrypoint {c.get('Entrypoint')} != [{entrypoint}]")
if (c.get("Cmd") or []) != ([cmd] if cmd else []):
    problems.append(f"Cmd {c.get('Cmd')} != [{cmd}]")
if c.get("User") != f"{user}:{user}":
    problems.append(f"User {c.get('User')} != {user}:{user}")
for k in ("title", "description", "version", "revision", "created", "source", "licenses"):
    if not labels.get(f"org.opencontainers.image.{k}"):
        problems.append(f"label org.opencontainers.image.{k} missing")
if labels.get("org.opencontainers.image.version") != version:
    problems.append(f"label version {labels.get('org.opencontainers.image.version')} != {version}")
if cfg.get("os") != "linux" or cfg.get("architecture") != "amd64":
    problems.append(f"platform {cfg.get('os')}/{cfg.get('architecture')}")
if problems:
    sys.exit(f"build-images: {archive}: " + "; ".join(problems))
print(f"build-images: {archive}: config ok (entrypoint {entrypoint}, cmd {c.get('Cmd')}, "
      f"user {c['User']}, {len(labels)} labels)", file=sys.stderr)
PY
}

# Unpacks an archive (from the archive itself, not the build tree) and runs commands in its
# rootfs: new mount, PID, IPC, UTS and network namespaces, chroot, the image's user.
run_in() { # archive command...   (RUN_AS=uid:gid overrides the image's user)
    local archive="$1"
    shift
    local dir="$work/check-$(basename "$archive" .oci.tar)"
    if [[ ! -d "$dir/bundle" ]]; then
        mkdir -p "$dir"
        skopeo copy --quiet "oci-archive:$archive" "oci:$dir/oci:check"
        umoci unpack --image "$dir/oci:check" "$dir/bundle" >/dev/null
    fi
    unshare --fork --pid --mount --ipc --uts --net \
        chroot --userspec="${RUN_AS:-$user:$user}" "$dir/bundle/rootfs" "$@"
}

operator_base="$(base_rootfs operator "${operator_pkgs[@]}")"
agent_base="$(base_rootfs agent "${agent_pkgs[@]}")"

step "operator image $operator_ref"
build_image kvfabric-operator "$operator_ref" "$operator_base" /usr/local/bin/kvfabric-operator "" \
    "kvfabric operator: runs kvfabric agents for TransferFabric resources" kvfabric-operator
step "agent image $agent_ref"
build_image kvfabric-agent "$agent_ref" "$agent_base" /usr/local/bin/kvfabric agent \
    "kvfabric node agent (rdma, cuda-ipc, shm, tcp), the socket directory helper and CSI driver" \
    kvfabric kvfabric-socket-dir kvfabric-csi

operator_archive="$out/kvfabric-operator-$tag.oci.tar"
agent_archive="$out/kvfabric-agent-$tag.oci.tar"
check_config "$operator_archive" /usr/local/bin/kvfabric-operator ""
check_config "$agent_archive" /usr/local/bin/kvfabric agent

step "running the binaries inside the unpacked images"
expect() { # what, pattern, output
    grep -q -- "$2" <<<"$3" || {
        echo "build-images: $1 did not print $2:" >&2
        echo "$3" >&2
        exit 1
    }
}
expect "kvfabric --version" "^kvfabric $version\$" "$(run_in "$agent_archive" /usr/local/bin/kvfabric --version)"
expect "kvfabric agent --help" "--etcd-endpoints" "$(run_in "$agent_archive" /usr/local/bin/kvfabric agent --help)"
expect "kvfabric-socket-dir --help" "--mode" "$(run_in "$agent_archive" /usr/local/bin/kvfabric-socket-dir --help)"
expect "kvfabric-csi --help" "--kubelet-dir" "$(run_in "$agent_archive" /usr/local/bin/kvfabric-csi --help)"
expect "kvfabric-operator --help" "--agent-image" "$(run_in "$operator_archive" /usr/local/bin/kvfabric-operator --help)"
expect "kvfabric-operator --version" "^kvfabric-operator $version\$" \
    "$(run_in "$operator_archive" /usr/local/bin/kvfabric-operator --version)"
# The image's own dynamic loader resolves the verbs library inside the image, nothing is
# missing, and the NIC drivers libibverbs loads at run time are there.
libs="$(run_in "$agent_archive" /lib64/ld-linux-x86-64.so.2 --list /usr/local/bin/kvfabric)"
expect "ld.so --list kvfabric" "libibverbs.so.1 => /[a-z/]*x86_64-linux-gnu/libibverbs.so.1" "$libs"
if grep -q "not found" <<<"$libs"; then
    echo "build-images: the agent image lacks a library: $libs" >&2
    exit 1
fi
agent_root="$work/check-kvfabric-agent-$tag/bundle/rootfs"
# The init container's step, as the operator runs it: root, for the agent user and a socket
# group, set-group-ID.
RUN_AS=0:0 run_in "$agent_archive" /usr/local/bin/kvfabric-socket-dir \
    --dir /tmp/sockets/llm/llama/prefill --uid "$user" --gid 2000 --mode 2750 >/dev/null
got="$(stat -c '%u:%g %a' "$agent_root/tmp/sockets/llm/llama/prefill")"
[[ "$got" == "$user:2000 2750" ]] || {
    echo "build-images: kvfabric-socket-dir left the directory as $got" >&2
    exit 1
}
operator_root="$work/check-kvfabric-operator-$tag/bundle/rootfs"
for f in /etc/libibverbs.d/mlx5.driver /usr/lib/x86_64-linux-gnu/libibverbs/libmlx5-rdmav34.so; do
    [[ -e "$agent_root$f" ]] || {
        echo "build-images: the agent image lacks $f" >&2
        exit 1
    }
done
step "checking the SBOMs (spdx-tools)"
spdx_python="$("$root/scripts/tool-venv.sh" spdx-tools-0.8.5 "spdx-tools==0.8.5")"
for image in kvfabric-operator kvfabric-agent; do
    image_root="$work/check-$image-$tag/bundle/rootfs"
    sbom="$out/$image-$tag.spdx.json"
    cmp -s "$sbom" "$image_root/usr/share/doc/kvfabric/sbom.spdx.json" || {
        echo "build-images: the SBOM in $image is not the one beside its archive" >&2
        exit 1
    }
    "$spdx_python" - "$sbom" "$image_root" <<'PY'
import json, pathlib, sys
from spdx_tools.spdx.parser.parse_anything import parse_file
from spdx_tools.spdx.validation.document_validator import validate_full_spdx_document
path, rootfs = sys.argv[1], pathlib.Path(sys.argv[2])
problems = validate_full_spdx_document(parse_file(path))
if problems:
    sys.exit("build-images: invalid SPDX in %s:\n%s" % (path, "\n".join(p.validation_message for p in problems[:20])))
doc = json.load(open(path))
have = {(p["name"], p.get("versionInfo")) for p in doc["packages"]}
# Every Debian package of the image, at its version, and every binary by its checksum.
for f in (rootfs / "var/lib/dpkg/status.d").glob("*"):
    if f.name.endswith(".md5sums"):
        continue
    fields = dict(l.split(": ", 1) for l in f.read_text().splitlines() if ": " in l and not l.startswith(" "))
    assert (fields["Package"], fields["Version"]) in have, f"{path}: lacks {fields['Package']}"
import hashlib
for f in doc["files"]:
    data = (rootfs / f["fileName"].lstrip("./")).read_bytes()
    sums = {c["algorithm"]: c["checksumValue"] for c in f["checksums"]}
    assert sums["SHA256"] == hashlib.sha256(data).hexdigest(), f["fileName"]
names = {n for n, _ in have}
for crate in ("tokio", "rustls" if "operator" in path else "kvfabric-engine"):
    assert crate in names, f"{path}: lacks crate {crate}"
print(f"build-images: {path}: valid SPDX 2.3, {len(doc['packages'])} packages, {len(doc['files'])} binaries", file=sys.stderr)
PY
done

# No shell, no package manager, no setuid or setgid file.
for r in "$agent_root" "$operator_root"; do
    for f in /bin/sh /usr/bin/sh /usr/bin/dpkg /usr/bin/apt /usr/bin/passwd /usr/bin/perl; do
        if [[ -e "$r$f" || -L "$r$f" ]]; then
            echo "build-images: ${r%/bundle/rootfs} contains $f" >&2
            exit 1
        fi
    done
    if find "$r" -perm /6000 -type f | grep -q .; then
        echo "build-images: setuid/setgid files in an image:" >&2
        find "$r" -perm /6000 -type f >&2
        exit 1
    fi
done

step "done in $((SECONDS - started))s:"
for a in "$operator_archive" "$agent_archive"; do
    echo "  $a ($(du -h "$a" | cut -f1))  $(sed -n "1p" <<<"$(skopeo inspect --format '{{.Digest}}' "oci-archive:$a")")"
    echo "    SBOM (SPDX 2.3): ${a%.oci.tar}.spdx.json, and in the image at /usr/share/doc/kvfabric/sbom.spdx.json"
done
echo "load into kind:  kind load image-archive $agent_archive --name <cluster>"
echo "push:            skopeo copy oci-archive:$agent_archive docker://<registry>/kvfabric-agent:$tag"
