#!/usr/bin/env bash
# Build horovod 0.28.1 with MXNet and gloo (CPU, no MPI) into the Python environment of
# $PYTHON (default: python3), from its source with the two patches below applied, in order:
# - scripts/horovod-0.28.1-enqueue-name.patch fixes a use-after-free in Horovod's MXNet
#   broadcast and alltoall: EnqueueTensorBroadcast and EnqueueTensorAlltoall
#   (horovod/common/operations.cc) log the collective's name after putting it on Horovod's
#   queue, by when MXNet may have deleted the engine operation that owns the name (a
#   segfault, a huge copy or a hang at exit);
# - scripts/horovod-0.28.1-lost-peer-exit.patch ends the process (status 1, saying why)
#   when Horovod's background loop fails, e.g. a peer is lost, instead of failing the
#   queued collectives into MXNet's engine from Horovod's thread (MXNet 1.9.1 records such
#   failures without a lock: a heap corruption on the survivors).
# See the patches' headers and docs/distributed/horovod-exit.md. The patched build's
# version is 0.28.1+mxlbsgd.sha<first 10 hex digits of the sha256 of the two patch files,
# concatenated in that order>.
#
#   PYTHON=.venv/bin/python bash scripts/install_horovod.sh
#   HOROVOD_STOCK=1 PYTHON=... bash scripts/install_horovod.sh   # as released, unpatched
#   bash scripts/install_horovod.sh --source DIR   # only unpack the (patched) source to DIR
#
# Installs mxnet 1.9.1 and Horovod's build and run dependencies first. The first build
# takes about 5 minutes on 2 cores; the wheel is then kept in $HOROVOD_BUILD_CACHE
# (default ~/.cache/mx_lbsgd/horovod), per patch set (its sha256), Python tag and mxnet
# version, with the sdist, and a rerun installs it again in seconds.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
version=0.28.1
patch_files=("$here/horovod-$version-enqueue-name.patch"
             "$here/horovod-$version-lost-peer-exit.patch"
             "$here/horovod-$version-ring-reducescatter.patch")
cache="${HOROVOD_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mx_lbsgd/horovod}"
stock="${HOROVOD_STOCK:-0}"
source_only=""
if [ "${1:-}" = "--source" ]; then
    source_only="${2:?--source needs a directory}"
elif [ $# -gt 0 ]; then
    echo "usage: [PYTHON=python] [HOROVOD_STOCK=1] bash $0 [--source DIR]" >&2
    exit 2
fi
sdist="$cache/sdist/horovod-$version.tar.gz"
patch_sha="$("$py" -c 'import hashlib, sys
print(hashlib.sha256(b"".join(open(p, "rb").read() for p in sys.argv[1:])).hexdigest()[:10])' \
    "${patch_files[@]}")"
if [ "$stock" = 1 ]; then
    local_version="" label="stock: unpatched"
else
    local_version="mxlbsgd.sha$patch_sha"
    label="patched: broadcast/alltoall name use-after-free, exit on a lost peer, ring reduce-scatter"
fi

fetch_sdist() {          # pip downloads the sdist once; later runs use the cached copy
    [ -f "$sdist" ] && return
    mkdir -p "$cache/sdist"
    local tmp
    tmp="$(mktemp -d "$cache/sdist/.download.XXXXXX")"
    "$py" -m pip download -q --no-deps --no-binary :all: "horovod==$version" -d "$tmp"
    mv "$tmp/horovod-$version.tar.gz" "$sdist"
    rm -rf "$tmp"
}

unpack() {               # unpack the sdist into $1/horovod-$version and apply the patches
    tar -xzf "$sdist" -C "$1"
    [ "$stock" = 1 ] && return
    # Applies a unified diff whose hunks must match exactly where they say (no fuzz, no
    # offset beyond the lines earlier hunks added): the patch is for this sdist only.
    local patch_file
    for patch_file in "${patch_files[@]}"; do
    "$py" - "$patch_file" "$1/horovod-$version" <<'PY'
import os, re, sys
patch, root = sys.argv[1:]
lines = open(patch).read().splitlines()
i = 0
while i < len(lines):
    if not (lines[i].startswith('--- ') and lines[i + 1:i + 2] != []
            and lines[i + 1].startswith('+++ ')):
        i += 1
        continue
    path = os.path.join(root, lines[i + 1][4:].split('\t')[0].split('/', 1)[1])
    with open(path, encoding='utf-8', errors='surrogateescape', newline='') as f:
        text = f.read().split('\n')
    i, shift = i + 2, 0
    while i < len(lines) and lines[i].startswith('@@'):
        at, n_old, n_new = (int(x or 1) for x in re.match(
            r'@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@', lines[i]).groups())
        start, old, new = at - 1 + shift if n_old else at + shift, [], []
        i += 1
        while len(old) < n_old or len(new) < n_new:
            tag, body = lines[i][:1] or ' ', lines[i][1:]
            old += [body] if tag in ' -' else []
            new += [body] if tag in ' +' else []
            i += 1
        if text[start:start + len(old)] != old:
            sys.exit('%s does not apply to %s at line %d' % (patch, path, start + 1))
        text[start:start + len(old)] = new
        shift += len(new) - len(old)
    with open(path, 'w', encoding='utf-8', errors='surrogateescape', newline='') as f:
        f.write('\n'.join(text))
    print('patched %s (%s)' % (os.path.relpath(path, root), os.path.basename(patch)))
PY
    done
}

if [ -n "$source_only" ]; then
    fetch_sdist
    mkdir -p "$source_only"
    unpack "$source_only"
    echo "horovod $version source in $source_only/horovod-$version ($label)"
    exit 0
fi

"$py" -m pip install -q 'mxnet==1.9.1' 'numpy>=1.17,<1.24' wheel cmake cloudpickle psutil \
    pyyaml packaging cffi
key="$("$py" -c 'import sys, mxnet
print("cp%d%d-mxnet%s" % (sys.version_info[:2] + (mxnet.__version__,)))')"
wheels="$cache/wheels/${local_version:-stock}-$key"
wheel="$(ls "$wheels"/horovod-*.whl 2>/dev/null | head -n 1 || true)"
if [ -z "$wheel" ]; then
    fetch_sdist
    build="$(mktemp -d)"
    trap 'rm -rf "$build"' EXIT
    unpack "$build"
    echo "building horovod $version ($label); about 5 minutes on 2 cores"
    env HOROVOD_WITH_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 \
        ${local_version:+HOROVOD_LOCAL_VERSION="$local_version"} \
        "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$build/wheel" \
        "$build/horovod-$version"
    mkdir -p "$wheels"
    built="$(ls "$build"/wheel/horovod-*.whl)"
    partial="$(mktemp "$wheels/.partial.XXXXXX")"
    cp "$built" "$partial" && mv "$partial" "$wheels/$(basename "$built")"
    wheel="$wheels/$(basename "$built")"
fi
"$py" -m pip install -q --no-deps --force-reinstall "$wheel"
"$py" -c "import sys, importlib.metadata as md, horovod.mxnet as hvd
hvd.init()
print('horovod', md.version('horovod'), 'ready (%s)' % sys.argv[1])" "$label"
