#!/usr/bin/env bash
# Build the Dockerfile's image on a machine without a container registry, for tests/test_image.py, and print
# its name (localhost/gpuguard:test).
#
# Why not `docker build`: the machines reach only package registries (Debian's archive, PyPI, the Go module
# proxy), so the Dockerfile's base (python:3.11-slim from Docker Hub) cannot be pulled, and no container
# daemon runs here. What does run: buildah (Debian's package) with --isolation chroot, which builds the
# Dockerfile itself, step by step, without a runtime, cgroups or a daemon. The base is the Dockerfile's
# PYTHON_IMAGE argument: here a stand-in made with debootstrap from Debian bookworm (the slim image's own
# distribution) with Debian's python3.11, python3-venv, python3-pip and python-is-python3, so `python` and
# `pip` are what the Dockerfile calls. The published build keeps the default (python:3.11.14-slim-bookworm).
#
# Cache: the base root filesystem is built once per user into
#   ${GPUGUARD_CACHE:-~/.cache/gpuguard}/image-base/<BASE_KEY>/rootfs.tar
# (BASE_KEY names the suite and a hash of the package list: a change builds anew); later runs import it
# (seconds) and rebuild only gpuguard's image (~1 minute, most of it pip fetching the dependencies).
# The base trusts the CA bundle of the machine it is built on (/etc/ssl/certs/ca-certificates.crt), so
# pip inside the build reaches PyPI through the same TLS-intercepting proxy, if any, as the host's pip.
#
# Needs root (debootstrap, buildah's storage in /var/lib/containers). Missing Debian packages (buildah,
# debootstrap) are installed with apt-get.
#
# stdout: exactly one line, the image name. Progress goes to stderr.
# Usage: hack/image/build.sh [--force-base]
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=../lib/gobuild.sh
source "$ROOT/hack/lib/gobuild.sh"

IMAGE=localhost/gpuguard:test
SUITE=bookworm
MIRROR=${GPUGUARD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_PACKAGES=python3,python3-venv,python3-pip,python-is-python3,ca-certificates
BASE_KEY="debian-$SUITE-$(printf '%s' "$BASE_PACKAGES" | sha256sum | cut -c1-12)"

force_base=0
for arg in "$@"; do
    case "$arg" in
        --force-base) force_base=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "build.sh: unknown argument: $arg" >&2
            exit 2
            ;;
    esac
done

if [[ $(id -u) != 0 ]]; then
    echo "build.sh: needs root (debootstrap, buildah's storage); run the image tests as root or skip them with GPUGUARD_SKIP_IMAGE=1" >&2
    exit 1
fi
missing=()
command -v buildah >/dev/null || missing+=(buildah)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
    echo "build.sh: installing ${missing[*]} (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi

CACHE="$(gpuguard_cache_root)/image-base/$BASE_KEY"
TARBALL="$CACHE/rootfs.tar"
cache_lock "$CACHE"
start=$SECONDS
if [[ $force_base == 1 || ! -s "$TARBALL" ]]; then
    echo "build.sh: building the base root filesystem ($SUITE: $BASE_PACKAGES) with debootstrap; a few minutes, once" >&2
    tmp=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$tmp/rootfs" "$MIRROR" >&2
    # What an image carries no copy of: downloaded packages and the archive's indexes.
    rm -rf "$tmp/rootfs/var/cache/apt/archives/"*.deb "$tmp/rootfs/var/lib/apt/lists/"*
    tar -C "$tmp/rootfs" --numeric-owner -cf "$tmp/rootfs.tar" .
    mv -f "$tmp/rootfs.tar" "$TARBALL"
    rm -rf "$tmp"
    trap - EXIT
    echo "build.sh: base built in $((SECONDS - start)) s" >&2
fi

# The base image, named after the rootfs and the CA bundle it is given.
ca=/etc/ssl/certs/ca-certificates.crt
base="localhost/gpuguard-test-base:$BASE_KEY-$( (sha256sum "$TARBALL" | cut -c1-12; cat "$ca" 2>/dev/null) | sha256sum | cut -c1-12)"
if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    echo "build.sh: importing $base" >&2
    ctr=$(buildah from scratch)
    mnt=$(buildah mount "$ctr")
    tar -C "$mnt" --numeric-owner -xf "$TARBALL"
    [[ -s $ca ]] && cp "$ca" "$mnt/etc/ssl/certs/ca-certificates.crt"
    buildah umount "$ctr" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd python "$ctr"
    buildah commit --rm -q "$ctr" "$base" >/dev/null
fi

# The build context as .dockerignore admits it (pyproject.toml, README.md, gpuguard/ without byte code),
# the Dockerfile and the base: an image built from the same inputs is reused.
context=$(
    cd "$ROOT"
    find Dockerfile .dockerignore pyproject.toml README.md gpuguard -type f \
        ! -path '*/__pycache__/*' ! -name '*.py[cod]' ! -path '*.egg-info/*' -print0 |
        LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
)-$base
label=io.gpuguard.test.inputs
if [[ $(buildah inspect --type image --format "{{index .ImageAnnotations \"$label\"}}" "$IMAGE" 2>/dev/null) == "$context" ]]; then
    echo "build.sh: $IMAGE is current (same Dockerfile, context and base)" >&2
    echo "$IMAGE"
    exit 0
fi
echo "build.sh: building $IMAGE from the Dockerfile (buildah, --isolation chroot, PYTHON_IMAGE=$base)" >&2
buildah bud --isolation chroot --layers=false --pull=never -q --annotation "$label=$context" \
    --build-arg "PYTHON_IMAGE=$base" -f "$ROOT/Dockerfile" -t "$IMAGE" "$ROOT" >&2
echo "build.sh: $IMAGE ready ($((SECONDS - start)) s)" >&2
echo "$IMAGE"
