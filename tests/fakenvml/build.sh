#!/bin/sh
# Builds the fake NVML library: tests/fakenvml/build.sh [OUTDIR]
# OUTDIR defaults to <repo>/build/fakenvml; the result is OUTDIR/libnvidia-ml.so.1.
# Rebuilds only when fakenvml.c (or this script) is newer than the library.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$root/build/fakenvml}
src=$here/fakenvml.c
lib=$out/libnvidia-ml.so.1
cc=${CC:-gcc}

if [ -f "$lib" ] && [ ! "$src" -nt "$lib" ] && [ ! "$here/build.sh" -nt "$lib" ]; then
    exit 0
fi

mkdir -p "$out"
# Build to a temporary name and rename, so a concurrent build or a running
# test never sees a half-written library.
tmp=$lib.tmp.$$
trap 'rm -f "$tmp"' EXIT
# shellcheck disable=SC2086 # CFLAGS is a list of flags
"$cc" -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -pthread -O2 -Wall -Wextra -Werror \
    ${CFLAGS:-} -o "$tmp" "$src"
mv -f "$tmp" "$lib"
echo "fakenvml: built $lib"
