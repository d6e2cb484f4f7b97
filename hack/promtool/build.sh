#!/usr/bin/env bash
# Build the pinned promtool used by tests/test_monitoring.py (`promtool check rules`, `promtool test rules`
# on deploy/monitoring/), and print its path.
#
# Why from source: as for helm (hack/helm/build.sh), the machines reach only package registries; the Go
# module proxy serves github.com/prometheus/prometheus, whose cmd/promtool builds to the release's binary
# with CGO_ENABLED=0. Prometheus tags its Go module v0.<major*100+minor>.<patch>: v0.316.0 is Prometheus
# 3.16.0. `go install MODULE/cmd/promtool@VERSION` builds with Prometheus's own go.mod/go.sum at that tag.
#
# The binary lives in ${GPUGUARD_CACHE:-~/.cache/gpuguard}/promtool/<PROMETHEUS_VERSION>/ (the module and
# build caches are the ones all pinned builds share: hack/lib/gobuild.sh), and a second run only checks that the binary is there and prints its path.
#
# stdout: exactly one line, the absolute path of the binary. Progress goes to stderr.
#
# Usage: hack/promtool/build.sh [--force]
#   --force   rebuild even if the cache has the binary
# Env: GPUGUARD_PROMTOOL_CACHE  cache root (default: ${GPUGUARD_CACHE:-~/.cache/gpuguard}/promtool)
set -euo pipefail

# The pin: Prometheus 3.16.0.
PROMETHEUS_VERSION=v3.16.0
MODULE_VERSION=v0.316.0
MODULE=github.com/prometheus/prometheus

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=../lib/gobuild.sh
source "$ROOT/hack/lib/gobuild.sh"

parse_force_args "${BASH_SOURCE[0]}" "$@"

CACHE_ROOT=${GPUGUARD_PROMTOOL_CACHE:-$(gpuguard_cache_root)/promtool}
CACHE="$CACHE_ROOT/$PROMETHEUS_VERSION"
BIN="$CACHE/promtool"

cached_or_lock "$BIN" "$CACHE"
go_shared_env "$CACHE"

# What Prometheus's .promu.yml sets for a release (minus revision/branch/user, which the proxy does not carry).
ldflags="-s -w -X github.com/prometheus/common/version.Version=${PROMETHEUS_VERSION#v}"
ldflags+=" -X github.com/prometheus/common/version.Branch=HEAD"

tmp=$(mktemp -d "$CACHE/install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "build.sh: building promtool $PROMETHEUS_VERSION from $MODULE@$MODULE_VERSION (CGO_ENABLED=0; a few minutes cold)" >&2
start=$SECONDS
# remove_all_sd: Prometheus's own build tag that leaves out every service-discovery plugin but file and
# http (cloud SDKs: most of the dependency graph). Checking and unit-testing rules needs none of them, and
# the cold build drops from ~20 to a few minutes on 2 cores.
GOBIN="$tmp" go install -trimpath -tags remove_all_sd -gcflags=all=-dwarf=false -ldflags "$ldflags" \
    "$MODULE/cmd/promtool@$MODULE_VERSION" >&2

got=$("$tmp/promtool" --version 2>&1 | sed -n 's/^promtool, version \([^ ]*\) .*/\1/p')
if [[ "v$got" != "$PROMETHEUS_VERSION" ]]; then
    echo "build.sh: version mismatch: built promtool reports '$got', want '$PROMETHEUS_VERSION'" >&2
    exit 1
fi
mv -f "$tmp/promtool" "$BIN"
echo "build.sh: built promtool $PROMETHEUS_VERSION in $((SECONDS - start)) s" >&2
echo "$BIN"
