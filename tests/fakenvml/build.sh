#!/bin/sh
# Builds the fake NVML library: tests/fakenvml/build.sh [OUTDIR]
# OUTDIR defaults to <repo>/build/fakenvml; the result is OUTDIR/libnvidia-ml.so.1.
# Rebuilds only when fakenvml.c, nvml.h (or this script) is newer than the library.
#
# It compiles against NVIDIA's own nvml.h (PyPI package nvidia-nvml-dev, in the dev extra), with
# -Werror -Wmissing-prototypes: a function whose signature differs from nvml.h, or one nvml.h does not
# declare, does not build. $NVML_INCLUDE names the header's directory; default: the one in <repo>/.venv.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$root/build/fakenvml}
src=$here/fakenvml.c
lib=$out/libnvidia-ml.so.1
cc=${CC:-gcc}

inc=${NVML_INCLUDE:-}
if [ -z "$inc" ]; then
    for h in "$root"/.venv/lib/python3*/site-packages/nvidia/cu*/include/nvml.h; do
        [ -f "$h" ] && inc=$(dirname "$h")
    done
fi
if [ -z "$inc" ] || [ ! -f "$inc/nvml.h" ]; then
    echo "fakenvml: nvml.h not found: run 'make install' (the dev extra installs nvidia-nvml-dev)" \
        "or set NVML_INCLUDE to the directory that holds nvml.h" >&2
    exit 1
fi

if [ -f "$lib" ] && [ ! "$src" -nt "$lib" ] && [ ! "$here/build.sh" -nt "$lib" ] &&
    [ ! "$inc/nvml.h" -nt "$lib" ]; then
    exit 0
fi

mkdir -p "$out"
# Build to a temporary name and rename, so a concurrent build or a running
# test never sees a half-written library.
tmp=$lib.tmp.$$
trap 'rm -f "$tmp"' EXIT
# shellcheck disable=SC2086 # CFLAGS is a list of flags
"$cc" -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -pthread -O2 -Wall -Wextra -Werror \
    -Wmissing-prototypes -DNVML_NO_UNVERSIONED_FUNC_DEFS -I"$inc" \
    ${CFLAGS:-} -o "$tmp" "$src"
mv -f "$tmp" "$lib"
echo "fakenvml: built $lib (against $inc/nvml.h)"
