#!/usr/bin/env bash
# Build the pinned Karpenter kwok provider used by the autoscaler test (tests/integration/test_karpenter.py),
# and print its path.
#
# Karpenter's kwok provider (sigs.k8s.io/karpenter/kwok, a main package in the Karpenter module itself) is
# all of Karpenter's core controllers (provisioning, node claims, disruption) with a cloud provider that
# "launches" a node by creating a Node object labelled for kwok: the kwok controller (hack/kwok/build.sh) then
# heartbeats it and runs the pods bound to it. It needs the CRDs of its module (NodePool, NodeClaim,
# NodeOverlay, KWOKNodeClass), which the test applies from the module cache kept beside the binary.
#
# Why from source, and how: as hack/kwok/build.sh. `go install sigs.k8s.io/karpenter/kwok@VERSION` builds with
# Karpenter's own go.mod/go.sum at that tag (no replace directives). Karpenter v1.15.0's go.mod names
# go 1.26.9, newer than the machines' Go, so the build runs with GOTOOLCHAIN=KARPENTER_GO_TOOLCHAIN
# (hack/testenv/versions.env): the go command fetches that toolchain from the Go module proxy, like a module,
# into the shared module cache (hack/lib/gobuild.sh); only this build runs with it.
# The binary lives in ${GPUGUARD_CACHE:-~/.cache/gpuguard}/karpenter/<KARPENTER_VERSION>/ (Go caches: shared); it appears
# only by an atomic rename after its build info named the pinned module version, so its presence means a
# complete build, CRDs included.
#
# stdout: exactly one line, the absolute path of the binary. Progress goes to stderr.
# The CRDs are in "$(dirname BINARY)/crds/" (copied from the module's kwok/charts/crds/ and kwok/apis/crds/).
#
# Usage: hack/karpenter/build.sh [--force]
#   --force   rebuild even if the cache has the binary
# Env: GPUGUARD_KARPENTER_CACHE  cache root (default: ${GPUGUARD_CACHE:-~/.cache/gpuguard}/karpenter)
set -euo pipefail

MODULE=sigs.k8s.io/karpenter
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=../lib/gobuild.sh
source "$ROOT/hack/lib/gobuild.sh"
KARPENTER_VERSION=$(read_pin KARPENTER_VERSION)
TOOLCHAIN=$(read_pin KARPENTER_GO_TOOLCHAIN)

parse_force_args "${BASH_SOURCE[0]}" "$@"

CACHE="${GPUGUARD_KARPENTER_CACHE:-$(gpuguard_cache_root)/karpenter}/$KARPENTER_VERSION"
BIN="$CACHE/karpenter-kwok"

cached_or_lock "$BIN" "$CACHE"
go_shared_env "$CACHE"
# After go_shared_env (which pins the installed Go): this module needs a newer one, taken from the proxy.
export GOTOOLCHAIN="$TOOLCHAIN"

tmp=$(mktemp -d "$CACHE/install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "build.sh: building Karpenter's kwok provider $KARPENTER_VERSION from $MODULE with $TOOLCHAIN" \
    "(CGO_ENABLED=0; about 5 minutes cold on 2 cores)" >&2
start=$SECONDS
# What Karpenter's release build sets (-X .../pkg/operator.Version): its logs and user agent name the version.
ldflags="-s -w -X $MODULE/pkg/operator.Version=$KARPENTER_VERSION"
GOBIN="$tmp" go install -trimpath -gcflags=all=-dwarf=false -ldflags "$ldflags" \
    "$MODULE/kwok@$KARPENTER_VERSION" >&2

# The binary has no --version flag; its build info names the main module and its version.
got=$(go version -m "$tmp/kwok" | awk '$1 == "mod" { print $2 " " $3 }')
if [[ "$got" != "$MODULE $KARPENTER_VERSION" ]]; then
    echo "build.sh: version mismatch: built binary's module is '$got', want '$MODULE $KARPENTER_VERSION'" >&2
    exit 1
fi
src=$(go list -m -f '{{.Dir}}' "$MODULE@$KARPENTER_VERSION")
mkdir -p "$tmp/crds"
cp "$src"/kwok/charts/crds/*.yaml "$src"/kwok/apis/crds/*.yaml "$tmp/crds/"
chmod u+w "$tmp"/crds/*.yaml # read-only in the module cache
rm -rf "$CACHE/crds"
mv -f "$tmp/crds" "$CACHE/crds"
mv -f "$tmp/kwok" "$BIN"
echo "build.sh: built Karpenter's kwok provider $KARPENTER_VERSION in $((SECONDS - start)) s" >&2
echo "$BIN"
