#!/usr/bin/env bash
# Every pinned build the tests use, in one go, each timed: what `make test` runs before the tests.
#
# Order: the Go builds run one after another (each `go build` already keeps both cores busy, and two builds
# of the same shared package at once would compile it twice: Go's build cache is shared, not coordinated),
# newest Kubernetes first, since the builds after it share most of its modules at the same versions
# (hack/lib/gobuild.sh: one module cache and one build cache for all). The image's base (debootstrap:
# downloads and unpacking, not compilation) and gpuguard's image run beside them in the background.
# Each line "build-all: NAME Ns" says how long that build took (0-1 s when it was cached).
#
# Usage: hack/build-all.sh   (no arguments; each hack/*/build.sh can still be run on its own)
# Env: GPUGUARD_SKIP_IMAGE=1 leaves the image out (as the image tests do).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
log_dir=$(mktemp -d)
trap 'rm -rf "$log_dir"' EXIT

timed() {
    local name=$1 start=$SECONDS
    shift
    if ! "$@" >"$log_dir/$name.out" 2>"$log_dir/$name.err"; then
        echo "build-all: $name failed after $((SECONDS - start)) s:" >&2
        tail -n 40 "$log_dir/$name.err" >&2
        return 1
    fi
    echo "build-all: $name $((SECONDS - start)) s" >&2
}

image_pid=""
if [[ ${GPUGUARD_SKIP_IMAGE:-0} != 1 && $(id -u) == 0 ]]; then
    timed image hack/image/build.sh &
    image_pid=$!
fi

total=$SECONDS
status=0
timed kube hack/testenv/build.sh || status=1
timed kwok hack/kwok/build.sh || status=1
timed karpenter hack/karpenter/build.sh || status=1
timed helm4 hack/helm/build.sh || status=1
timed helm3 hack/helm/build.sh --v3 || status=1
timed promtool hack/promtool/build.sh || status=1
timed kube-oldest hack/testenv/build.sh --oldest || status=1
if [[ -n $image_pid ]]; then
    wait "$image_pid" || status=1
fi
echo "build-all: all $((SECONDS - total)) s" >&2
exit "$status"
