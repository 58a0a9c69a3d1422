#!/usr/bin/env python3
"""An SPDX 2.3 JSON SBOM of one image built by scripts/build-images.sh.

What it lists, and where each fact comes from:
  - the image, as the described package (name, version, the commit);
  - each binary in /usr/local/bin as a file with its SHA-256 (read from the rootfs);
  - each Rust crate a binary statically links (``cargo tree -e normal`` with the binary's own
    package and features), with version, crates.io purl, the Cargo.lock checksum and the
    declared license (``cargo metadata``); relationship: binary STATIC_LINK crate;
  - each Debian package in the image (``/var/lib/dpkg/status.d``, written when the base was
    made), with version, architecture, source package, maintainer and a Debian purl;
    relationship: image CONTAINS package.

    scripts/sbom.py --image NAME --version V --revision SHA --created T --arch amd64 \\
        --rootfs DIR --out FILE --bin PATH='CARGO TREE ARGS' [--bin ...]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

CRATES_IO = "registry+https://github.com/rust-lang/crates.io-index"


def spdx_id(kind: str, name: str, version: str = "") -> str:
    raw = f"{kind}-{name}-{version}" if version else f"{kind}-{name}"
    return "SPDXRef-" + re.sub(r"[^A-Za-z0-9.-]", "-", raw)


def license_expression(raw: str | None) -> str:
    """Cargo's `license` as an SPDX expression: the old `A/B` form means `A OR B`."""
    if not raw:
        return "NOASSERTION"
    return " OR ".join(p.strip() for p in raw.split("/")) if "/" in raw else raw


def cargo(*args: str) -> str:
    return subprocess.run(
        ["cargo", *args], check=True, capture_output=True, text=True
    ).stdout


@functools.cache
def linked_crates(tree_args: str) -> tuple[tuple[str, str], ...]:
    """(name, version) of every crate in the binary's normal dependency tree; binaries of one
    package (kvfabric-operator and kvfabric-socket-dir) ask once."""
    out = cargo("tree", "--locked", "-e", "normal", "--prefix", "none",
                "-f", "{p}", *shlex.split(tree_args))
    seen: dict[tuple[str, str], None] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].startswith("v"):
            seen[(parts[0], parts[1][1:])] = None
    return tuple(seen)


def debian_packages(rootfs: Path) -> list[dict[str, str]]:
    out = []
    status = rootfs / "var/lib/dpkg/status.d"
    for f in sorted(status.glob("*")):
        if f.name.endswith(".md5sums"):
            continue
        fields: dict[str, str] = {}
        key = None
        for line in f.read_text().splitlines():
            if line.startswith((" ", "\t")) and key:
                continue  # continuation lines (descriptions): not needed
            if ":" in line:
                key, value = line.split(":", 1)
                fields[key] = value.strip()
        out.append(fields)
    return out


def library(spdx: str, name: str, version: str, purl: str, **fields: object) -> dict:
    """A dependency's package entry; `fields` add or override (download, license, ...)."""
    return {
        "SPDXID": spdx,
        "name": name,
        "versionInfo": version,
        "downloadLocation": "NOASSERTION",
        "filesAnalyzed": False,
        "licenseDeclared": "NOASSERTION",
        "licenseConcluded": "NOASSERTION",
        "copyrightText": "NOASSERTION",
        "primaryPackagePurpose": "LIBRARY",
        "externalRefs": [{
            "referenceCategory": "PACKAGE-MANAGER",
            "referenceType": "purl",
            "referenceLocator": purl,
        }],
        **fields,
    }


def digests(path: Path) -> dict[str, str]:
    data = path.read_bytes()
    return {"SHA1": hashlib.sha1(data).hexdigest(), "SHA256": hashlib.sha256(data).hexdigest()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--revision", required=True)
    ap.add_argument("--created", required=True)
    ap.add_argument("--arch", required=True)
    ap.add_argument("--rootfs", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path, action="append")
    ap.add_argument("--bin", required=True, action="append",
                    help="PATH=CARGO_TREE_ARGS: a binary in the image and how cargo builds it")
    a = ap.parse_args()

    # Every feature: the binaries enable optional crates (rdma, cuda) a default resolve omits.
    metadata = json.loads(cargo("metadata", "--format-version", "1", "--locked", "--all-features"))
    by_key = {(p["name"], p["version"]): p for p in metadata["packages"]}
    lock = tomllib.loads(Path("Cargo.lock").read_text())
    checksums = {(p["name"], p["version"]): p.get("checksum") for p in lock["package"]}

    image_id = spdx_id("Image", a.image)
    packages = [{
        "SPDXID": image_id,
        "name": a.image,
        "versionInfo": a.version,
        "downloadLocation": "NOASSERTION",
        # Its files are the binaries below (the base's files are its Debian packages').
        "filesAnalyzed": True,
        "supplier": "Organization: kvfabric",
        "licenseDeclared": "Apache-2.0",
        "licenseConcluded": "NOASSERTION",
        "copyrightText": "NOASSERTION",
        "sourceInfo": f"https://github.com/kvfabric/kvfabric commit {a.revision}",
        "primaryPackagePurpose": "CONTAINER",
    }]
    files = []
    relationships = [{
        "spdxElementId": "SPDXRef-DOCUMENT",
        "relationshipType": "DESCRIBES",
        "relatedSpdxElement": image_id,
    }]
    crate_ids: dict[tuple[str, str], str] = {}
    for spec in a.bin:
        path, _, tree_args = spec.partition("=")
        binary = a.rootfs / path.lstrip("/")
        file_id = spdx_id("File", Path(path).name)
        sums = digests(binary)
        files.append({
            "SPDXID": file_id,
            "fileName": "." + path,
            "checksums": [{"algorithm": k, "checksumValue": v} for k, v in sums.items()],
            "fileTypes": ["BINARY"],
            "licenseConcluded": "NOASSERTION",
            "copyrightText": "NOASSERTION",
        })
        for name, version in linked_crates(tree_args):
            key = (name, version)
            meta = by_key.get(key)
            if meta is None:
                sys.exit(f"sbom: {name} {version} is in cargo tree but not in cargo metadata")
            if key not in crate_ids:
                crate_ids[key] = spdx_id("Crate", name, version)
                from_registry = meta.get("source") == CRATES_IO
                pkg = library(
                    crate_ids[key], name, version, f"pkg:cargo/{name}@{version}",
                    licenseDeclared=license_expression(meta.get("license")),
                )
                if from_registry:
                    pkg["downloadLocation"] = (
                        f"https://crates.io/api/v1/crates/{name}/{version}/download")
                if from_registry and checksums.get(key):
                    pkg["checksums"] = [{"algorithm": "SHA256",
                                         "checksumValue": checksums[key]}]
                packages.append(pkg)
            relationships.append({"spdxElementId": file_id, "relationshipType": "STATIC_LINK",
                                  "relatedSpdxElement": crate_ids[key]})
    # SPDX 2.3 §7.9: SHA-1 of the sorted SHA-1s of the package's files.
    packages[0]["packageVerificationCode"] = {
        "packageVerificationCodeValue": hashlib.sha1("".join(sorted(
            c["checksumValue"] for f in files for c in f["checksums"] if c["algorithm"] == "SHA1"
        )).encode()).hexdigest()
    }
    packages[0]["hasFiles"] = [f["SPDXID"] for f in files]
    debs = debian_packages(a.rootfs)
    for d in debs:
        name, version, arch = d["Package"], d["Version"], d.get("Architecture", a.arch)
        deb_id = spdx_id("Deb", name, version)
        source = d.get("Source", name).split()[0]
        packages.append(library(
            deb_id, name, version,
            f"pkg:deb/debian/{name}@{version}?arch={arch}&distro=debian-12",
            supplier=f"Organization: {d.get('Maintainer', 'Debian')}",
            sourceInfo=f"Debian source package {source}",
        ))
        relationships.append({"spdxElementId": image_id, "relationshipType": "CONTAINS",
                              "relatedSpdxElement": deb_id})
    doc = {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"{a.image}-{a.version}",
        "documentNamespace":
            f"https://github.com/kvfabric/kvfabric/sbom/{a.image}-{a.version}-{a.revision}",
        "creationInfo": {
            "created": a.created,
            "creators": ["Tool: kvfabric-scripts/sbom.py", "Organization: kvfabric"],
        },
        "packages": packages,
        "files": files,
        "relationships": relationships,
    }
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    for out in a.out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    print(f"sbom: {a.image}: {len(crate_ids)} crates, {len(debs)} Debian packages, "
          f"{len(files)} binaries", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
