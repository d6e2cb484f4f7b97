#!/usr/bin/env bash
# Build a pinned helm binary used by tests/test_helm.py, tests/integration/test_helm_install.py and
# `make lint`, and print its path. Two pins: Helm 4 (the default) and Helm 3 (`--v3`), still what most
# users run; the chart and the README's install command are tested with both.
#
# Why from source: the machines reach only package registries, so helm's release tarballs
# (get.helm.sh) are out of reach; the Go module proxy serves helm.sh/helm/v4, which builds to
# the same static binary with CGO_ENABLED=0. `go install MODULE/cmd/helm@VERSION` builds with
# helm's own go.mod/go.sum at that tag (checked against sum.golang.org), so no wrapper module is
# needed: the pinned version below pins the whole dependency graph.
#
# The binary lives in ${GPUGUARD_CACHE:-~/.cache/gpuguard}/helm/<HELM_VERSION>/ (the module and build
# caches are the ones all pinned builds share: hack/lib/gobuild.sh), and a second run only checks that the binary is there and prints its path. The binary is
# installed under a temporary name and renamed, so an interrupted build never leaves a
# half-written helm behind; changing HELM_VERSION builds into a new directory.
#
# stdout: exactly one line, the absolute path of the binary. Progress goes to stderr.
#
# Usage: hack/helm/build.sh [--force] [--v3]
#   --force   rebuild even if the cache has the binary
#   --v3      build (or find) the Helm 3 pin instead of the Helm 4 one
# Env: GPUGUARD_HELM_CACHE  cache root (default: ${GPUGUARD_CACHE:-~/.cache/gpuguard}/helm)
set -euo pipefail

# The pins. The module path follows the major (helm.sh/helm/v4, helm.sh/helm/v3).
HELM4_VERSION=v4.3.2
HELM3_VERSION=v3.21.4
HELM_VERSION=$HELM4_VERSION

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=../lib/gobuild.sh
source "$ROOT/hack/lib/gobuild.sh"

build_arg() {
    case "$1" in
        --v3) HELM_VERSION=$HELM3_VERSION ;;
        *) return 1 ;;
    esac
}
parse_force_args "${BASH_SOURCE[0]}" "$@"

if [[ ! $HELM_VERSION =~ ^v([0-9]+)\.[0-9]+\.[0-9]+$ ]]; then
    echo "build.sh: HELM_VERSION '$HELM_VERSION' is not vMAJOR.MINOR.PATCH" >&2
    exit 1
fi
MODULE="helm.sh/helm/v${BASH_REMATCH[1]}"

CACHE_ROOT=${GPUGUARD_HELM_CACHE:-$(gpuguard_cache_root)/helm}
CACHE="$CACHE_ROOT/$HELM_VERSION"
BIN="$CACHE/helm"

cached_or_lock "$BIN" "$CACHE"
go_shared_env "$CACHE"

# What helm's own Makefile sets for a tagged release (minus the git commit, which the module
# proxy does not carry): `helm version` then reports the pinned version.
ldflags="-s -w -X $MODULE/internal/version.version=$HELM_VERSION"
ldflags+=" -X $MODULE/internal/version.metadata= -X $MODULE/internal/version.gitTreeState=clean"
if [[ $MODULE == helm.sh/helm/v3 ]]; then
    # helm 3 takes the Kubernetes version that `helm template` and `helm lint` assume from ldflags
    # (its Makefile derives it from client-go v0.N: 1.N); without them it assumes 1.20.
    gomod=$(go mod download -json "$MODULE@$HELM_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
    minor=$(sed -n 's/^[[:space:]]*k8s\.io\/client-go v0\.\([0-9]*\)\..*/\1/p' "$gomod")
    if [[ -z "$minor" ]]; then
        echo "build.sh: no k8s.io/client-go v0.N requirement in $MODULE@$HELM_VERSION's go.mod" >&2
        exit 1
    fi
    for pkg in pkg/lint/rules pkg/chartutil; do
        ldflags+=" -X $MODULE/$pkg.k8sVersionMajor=1 -X $MODULE/$pkg.k8sVersionMinor=$minor"
    done
fi

tmp=$(mktemp -d "$CACHE/install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "build.sh: building helm $HELM_VERSION from $MODULE (CGO_ENABLED=0; a few minutes cold)" >&2
start=$SECONDS
# -dwarf=false: the linker strips DWARF anyway (-s -w); not generating it saves ~10% of the cold build.
GOBIN="$tmp" go install -trimpath -gcflags=all=-dwarf=false -ldflags "$ldflags" \
    "$MODULE/cmd/helm@$HELM_VERSION" >&2

# Refuse a binary that does not report the pinned version.
got=$("$tmp/helm" version --template '{{.Version}}')
if [[ "$got" != "$HELM_VERSION" ]]; then
    echo "build.sh: version mismatch: built helm reports '$got', want '$HELM_VERSION'" >&2
    exit 1
fi
mv -f "$tmp/helm" "$BIN"
echo "build.sh: built helm $HELM_VERSION in $((SECONDS - start)) s" >&2
echo "$BIN"
