#!/usr/bin/env bash
# Every pinned build the tests use, in one go, each timed: what `make test` runs before the tests.
#
# Two lanes of Go builds run side by side, each lane one build after another: a `go build` keeps both cores
# busy only while it compiles, and spends much of its time on one core or none (resolving and downloading
# modules, linking the large Kubernetes binaries), so a second build fills those gaps. The lanes hold about
# the same CPU time: Kubernetes (newest, then oldest) in one, the smaller tools in the other, helm 4 first
# (it shares the newest Kubernetes' k8s.io modules at the same version). All share one module cache and one
# build cache (hack/lib/gobuild.sh): safe for concurrent builds. The image's base (debootstrap: downloads and
# unpacking) and gpuguard's image run beside them.
# Each line "build-all: NAME wall Ns, cpu Ns" says how long that build took and the CPU time it used (the
# figure that does not depend on what else the machine runs); 0-1 s when it was cached.
#
# Usage: hack/build-all.sh   (no arguments; each hack/*/build.sh can still be run on its own)
# Once every build succeeded, the shared Go build cache is emptied (GPUGUARD_KEEP_GOCACHE=1 keeps it): with
# every binary in place it would only speed up a rebuild after a pin changes, and it is the largest part
# (about 8 GB after the cold builds); the module cache (about 3.5 GB) stays, so nothing is downloaded twice.
#
# Env: GPUGUARD_SKIP_IMAGE=1 leaves the image out (as the image tests do).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
log_dir=$(mktemp -d)
trap 'rm -rf "$log_dir"' EXIT

timed() {
    local name=$1 rc=0 TIMEFORMAT="%R %U %S"
    shift
    { time "$@" >"$log_dir/$name.out" 2>"$log_dir/$name.err" || rc=$?; } 2>"$log_dir/$name.time"
    read -r wall user sys <"$log_dir/$name.time"
    if ((rc != 0)); then
        echo "build-all: $name failed after ${wall%.*} s:" >&2
        tail -n 40 "$log_dir/$name.err" >&2
        return 1
    fi
    echo "build-all: $name wall ${wall%.*} s, cpu $(python3 -c "print(round($user + $sys))") s" >&2
}

image_pid=""
if [[ ${GPUGUARD_SKIP_IMAGE:-0} != 1 && $(id -u) == 0 ]]; then
    timed image hack/image/build.sh &
    image_pid=$!
fi

lane_kube() {
    timed kube hack/testenv/build.sh && timed kube-oldest hack/testenv/build.sh --oldest
}
lane_tools() {
    local status=0
    timed helm4 hack/helm/build.sh || status=1
    timed kwok hack/kwok/build.sh || status=1
    timed karpenter hack/karpenter/build.sh || status=1
    timed helm3 hack/helm/build.sh --v3 || status=1
    timed promtool hack/promtool/build.sh || status=1
    return "$status"
}

total=$SECONDS
status=0
lane_kube &
kube_pid=$!
lane_tools || status=1
wait "$kube_pid" || status=1
if [[ -n $image_pid ]]; then
    wait "$image_pid" || status=1
fi
echo "build-all: all wall $((SECONDS - total)) s" >&2
# shellcheck source=lib/gobuild.sh
source "$ROOT/hack/lib/gobuild.sh"
gocache="$(gpuguard_cache_root)/go/build"
if [[ $status == 0 && ${GPUGUARD_KEEP_GOCACHE:-0} != 1 && -d $gocache ]]; then
    rm -rf "$gocache"
fi
exit "$status"
