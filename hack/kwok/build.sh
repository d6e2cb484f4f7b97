#!/usr/bin/env bash
# Build the pinned kwok controller used by the scheduling integration tests and `make e2e`, and print its path.
#
# kwok (sigs.k8s.io/kwok) simulates nodes on a real control plane: it heartbeats the Node objects it manages
# and moves the pods bound to them through their life cycle, so kube-scheduler and kube-controller-manager
# act on them as on real nodes. Only the `kwok` controller is built (not kwokctl, which downloads release
# binaries): the test session starts it against its own API server.
#
# Why from source, and how: as hack/helm/build.sh. `go install MODULE/cmd/kwok@VERSION` builds with kwok's
# own go.mod/go.sum at that tag (no replace directives), so KWOK_VERSION in hack/testenv/versions.env pins
# the dependency graph.
# The binary lives in ${GPUGUARD_CACHE:-~/.cache/gpuguard}/kwok/<KWOK_VERSION>/ (Go caches: shared); it appears only by an
# atomic rename after it reported the pinned version, so its presence means a complete build.
#
# stdout: exactly one line, the absolute path of the binary. Progress goes to stderr.
#
# Usage: hack/kwok/build.sh [--force]
#   --force   rebuild even if the cache has the binary
# Env: GPUGUARD_KWOK_CACHE  cache root (default: ${GPUGUARD_CACHE:-~/.cache/gpuguard}/kwok)
set -euo pipefail

MODULE=sigs.k8s.io/kwok
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=../lib/gobuild.sh
source "$ROOT/hack/lib/gobuild.sh"
# The pin lives beside the control plane's (hack/testenv/versions.env), read by harness/controlplane.py too.
KWOK_VERSION=$(read_pin KWOK_VERSION)

parse_force_args "${BASH_SOURCE[0]}" "$@"

CACHE="${GPUGUARD_KWOK_CACHE:-$(gpuguard_cache_root)/kwok}/$KWOK_VERSION"
BIN="$CACHE/kwok"

cached_or_lock "$BIN" "$CACHE"
go_shared_env "$CACHE"

tmp=$(mktemp -d "$CACHE/install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "build.sh: building kwok $KWOK_VERSION from $MODULE (CGO_ENABLED=0; a few minutes cold)" >&2
start=$SECONDS
# What kwok's hack/releases.sh sets for a release: `kwok --version` then reports the pinned version.
ldflags="-s -w -X $MODULE/pkg/consts.Version=$KWOK_VERSION"
GOBIN="$tmp" go install -trimpath -gcflags=all=-dwarf=false -ldflags "$ldflags" \
    "$MODULE/cmd/kwok@$KWOK_VERSION" >&2

got=$("$tmp/kwok" --version 2>&1 | head -n 1)
if [[ "$got" != *"$KWOK_VERSION"* ]]; then
    echo "build.sh: version mismatch: built kwok reports '$got', want '$KWOK_VERSION'" >&2
    exit 1
fi
mv -f "$tmp/kwok" "$BIN"
echo "build.sh: built kwok $KWOK_VERSION in $((SECONDS - start)) s" >&2
echo "$BIN"
