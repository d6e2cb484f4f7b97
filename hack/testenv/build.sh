#!/usr/bin/env bash
# Build the pinned Kubernetes binaries the tests use. The newest supported Kubernetes (KUBE_VERSION,
# ETCD_VERSION): etcd, kube-apiserver, kube-scheduler and kube-controller-manager (the scheduling tests and
# `make e2e`) and kubectl (docs/operations.md's commands are run with it). With --oldest, the oldest
# supported one (KUBE_VERSION_OLDEST, ETCD_VERSION_OLDEST): etcd and kube-apiserver only, on which
# tests/integration/test_oldest_kubernetes.py runs a smoke subset.
#
# Why from source: the machines reach only package registries, so the official release
# tarballs are out of reach; the Go module proxy serves k8s.io/kubernetes and
# go.etcd.io/etcd/server/v3, which build to the same binaries with CGO_ENABLED=0.
#
# Each binary is built through a small wrapper module (hack/testenv/kube-apiserver, which declares the
# Kubernetes commands as tools and builds them in one `go build` so they share their packages;
# hack/testenv/etcd; hack/testenv/oldest/... for --oldest) whose committed go.mod/go.sum pin the
# whole dependency graph. When versions.env changes, the wrappers are regenerated (commit the new
# go.mod/go.sum).
#
# The binaries live in ${GPUGUARD_CACHE:-~/.cache/gpuguard}/testenv/<KUBE_VERSION>-<ETCD_VERSION>/ (the
# module and build caches are the ones all pinned builds share: hack/lib/gobuild.sh), and a second run only checks a stamp file and prints the paths.
#
# Usage: hack/testenv/build.sh [--oldest] [--force] [--regenerate]
#   --oldest      the oldest supported Kubernetes instead of the newest
#   --force       rebuild the binaries even if the cache has them
#   --regenerate  rewrite the wrapper modules' go.mod/go.sum from versions.env
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=../lib/gobuild.sh
source "$ROOT/hack/lib/gobuild.sh"

regenerate=0
suffix=""
build_arg() {
    case "$1" in
        --oldest) suffix=_OLDEST ;;
        --regenerate) regenerate=1 ;;
        *) return 1 ;;
    esac
}
parse_force_args "${BASH_SOURCE[0]}" "$@"

KUBE_VERSION=$(read_pin "KUBE_VERSION$suffix")
ETCD_VERSION=$(read_pin "ETCD_VERSION$suffix")
# The wrapper modules of this pair.
WRAPPERS=$HERE
[[ -n $suffix ]] && WRAPPERS=$HERE/oldest
# k8s.io/kubernetes vX.Y.Z publishes its staging modules (k8s.io/api, ...) as v0.Y.Z.
STAGING_VERSION="v0.${KUBE_VERSION#v1.}"
IFS=. read -r KUBE_MAJOR KUBE_MINOR _ <<<"${KUBE_VERSION#v}"

CACHE_ROOT=${GPUGUARD_TESTENV_CACHE:-$(gpuguard_cache_root)/testenv}
CACHE="$CACHE_ROOT/$KUBE_VERSION-$ETCD_VERSION"
BIN="$CACHE/bin"
STAMP="$CACHE/.complete"
# The Kubernetes commands built from the one pinned k8s.io/kubernetes module.
KUBE_COMMANDS=(kube-apiserver kube-scheduler kube-controller-manager kubectl)
[[ -n $suffix ]] && KUBE_COMMANDS=(kube-apiserver)
STAMP_WANT="${KUBE_COMMANDS[*]} $KUBE_VERSION etcd $ETCD_VERSION"

cache_lock "$CACHE"

print_paths() {
    local cmd
    for cmd in "${KUBE_COMMANDS[@]}"; do
        echo "$cmd: $BIN/$cmd"
    done
    echo "etcd: $BIN/etcd"
}

# wrapper_tools_current: the kube wrapper declares every command as a tool.
wrapper_tools_current() {
    local cmd
    for cmd in "${KUBE_COMMANDS[@]}"; do
        grep -Eq "^[[:space:]]*(tool[[:space:]]+)?k8s\.io/kubernetes/cmd/$cmd\$" \
            "$WRAPPERS/kube-apiserver/go.mod" 2>/dev/null || return 1
    done
}

binaries_present() {
    local cmd
    for cmd in etcd "${KUBE_COMMANDS[@]}"; do
        [[ -x "$BIN/$cmd" ]] || return 1
    done
}

wrappers_current() {
    local req='^[[:space:]]*(require[[:space:]]+)?'
    grep -Eq "${req}k8s\.io/kubernetes $KUBE_VERSION([[:space:]]|\$)" \
        "$WRAPPERS/kube-apiserver/go.mod" 2>/dev/null &&
        grep -Eq "${req}go\.etcd\.io/etcd/server/v3 $ETCD_VERSION([[:space:]]|\$)" \
            "$WRAPPERS/etcd/go.mod" 2>/dev/null &&
        [[ -s "$WRAPPERS/kube-apiserver/go.sum" && -s "$WRAPPERS/etcd/go.sum" ]] && wrapper_tools_current
}

if [[ $force == 0 && $regenerate == 0 ]] && binaries_present &&
    [[ "$(cat "$STAMP" 2>/dev/null)" == "$STAMP_WANT" ]]; then
    echo "build.sh: reusing cached binaries for $STAMP_WANT"
    print_paths
    exit 0
fi

go_shared_env "$CACHE"
command -v python3 >/dev/null || {
    echo "build.sh: 'python3' not found in PATH" >&2
    exit 1
}

# json_field FILE_OR_- KEY...: print a field of a JSON document (python3 is always there).
json_field() {
    python3 -c '
import json, sys
src = sys.argv[1]
doc = json.load(sys.stdin if src == "-" else open(src))
for key in sys.argv[2:]:
    doc = doc[key]
print(doc if not isinstance(doc, (list, dict)) else json.dumps(doc))
' "$@"
}

# gen_wrapper DIR MODULE VERSION "TOOL_PKG..." STAGING_VERSION
# Writes DIR/go.mod and DIR/go.sum for a module that requires MODULE@VERSION and
# declares each TOOL_PKG as a tool. When STAGING_VERSION is set, every requirement that
# MODULE's go.mod lists at v0.0.0 (its staging modules, resolved upstream through
# local replaces that do not apply to dependents) is replaced by STAGING_VERSION.
# The go and godebug directives follow MODULE's so runtime defaults match upstream.
gen_wrapper() {
    local dir=$1 module=$2 version=$3 tools=$4 staging=${5:-}
    local dl gomod_path modjson gover godebugs staged line tmp
    echo "build.sh: generating wrapper module $dir for $module@$version"
    dl=$(go mod download -json "$module@$version")
    gomod_path=$(json_field - GoMod <<<"$dl")
    modjson=$(go mod edit -json "$gomod_path")
    gover=$(json_field - Go <<<"$modjson")

    # The tool directive needs go >= 1.24 in go.mod; older releases keep their runtime defaults
    # through the godebug lines copied below (e.g. default=go1.23).
    if [[ $(printf '%s\n' "$gover" 1.24 | sort -V | head -n 1) != 1.24 ]]; then
        gover=1.24
    fi
    local -a edits=("-go=$gover" "-require=$module@$version")
    for line in $tools; do
        edits+=("-tool=$line")
    done
    godebugs=$(python3 -c '
import json, sys
for d in json.load(sys.stdin).get("GoDebug") or []:
    print(d["Key"] + "=" + d["Value"])
' <<<"$modjson")
    while IFS= read -r line; do
        [[ -n "$line" ]] && edits+=("-godebug=$line")
    done <<<"$godebugs"
    if [[ -n "$staging" ]]; then
        staged=$(python3 -c '
import json, sys
for r in json.load(sys.stdin).get("Require") or []:
    if r["Version"] == "v0.0.0":
        print(r["Path"])
' <<<"$modjson")
        local count=0
        while IFS= read -r line; do
            [[ -z "$line" ]] && continue
            edits+=("-replace=$line=$line@$staging")
            count=$((count + 1))
        done <<<"$staged"
        if [[ $count == 0 ]]; then
            echo "build.sh: $module@$version lists no v0.0.0 staging modules?" >&2
            exit 1
        fi
        echo "build.sh: replacing $count staging modules with $staging"
    fi

    tmp=$(mktemp -d "$CACHE/wrapper.XXXXXX")
    (
        cd "$tmp"
        printf '// Generated by hack/testenv/build.sh from versions.env; do not edit.\n' >go.mod
        printf 'module gpuguard.test/testenv/%s\n' "$(basename "$dir")" >>go.mod
        go mod edit "${edits[@]}"
        go mod tidy
    )
    mkdir -p "$dir"
    mv -f "$tmp/go.mod" "$dir/go.mod"
    mv -f "$tmp/go.sum" "$dir/go.sum"
    rm -rf "$tmp"
}

if [[ $regenerate == 1 ]] || ! wrappers_current; then
    gen_wrapper "$WRAPPERS/etcd" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/server/v3
    gen_wrapper "$WRAPPERS/kube-apiserver" k8s.io/kubernetes "$KUBE_VERSION" \
        "${KUBE_COMMANDS[*]/#/k8s.io/kubernetes/cmd/}" "$STAGING_VERSION"
    echo "build.sh: wrapper modules regenerated; commit hack/testenv/{etcd,kube-apiserver}/go.{mod,sum}"
fi

mkdir -p "$BIN"

# The release's publication time stands in for the build date: reproducible, and close.
kube_info=$(cd "$WRAPPERS/kube-apiserver" && go mod download -json "k8s.io/kubernetes@$KUBE_VERSION")
build_date=$(json_field "$(json_field - Info <<<"$kube_info")" Time)

kube_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    kube_ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION"
    kube_ldflags+=" -X $pkg.gitMajor=$KUBE_MAJOR -X $pkg.gitMinor=$KUBE_MINOR"
    kube_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit="
    kube_ldflags+=" -X $pkg.buildDate=$build_date"
done
etcd_ldflags="-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=module-$ETCD_VERSION"

rm -f "$STAMP"
echo "build.sh: building etcd $ETCD_VERSION (CGO_ENABLED=0)"
# The same compile flags as every other pinned build (-trimpath -gcflags=all=-dwarf=false): the compile
# actions of the standard library, and of each package whose whole dependency graph etcd and Kubernetes pin
# alike (etcd's client, zap, cobra, ...), are then one entry of the shared build cache, compiled once.
(cd "$WRAPPERS/etcd" && go build -mod=readonly -trimpath -gcflags=all=-dwarf=false -ldflags "$etcd_ldflags" \
    -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3)
echo "build.sh: building ${KUBE_COMMANDS[*]} $KUBE_VERSION (CGO_ENABLED=0; several minutes cold)"
# One invocation for all the commands: their shared packages compile once. -o names a directory.
rm -rf "$BIN/kube.tmp"
mkdir -p "$BIN/kube.tmp"
(cd "$WRAPPERS/kube-apiserver" && go build -mod=readonly -trimpath -gcflags=all=-dwarf=false \
    -ldflags "$kube_ldflags" -o "$BIN/kube.tmp/" "${KUBE_COMMANDS[@]/#/k8s.io/kubernetes/cmd/}")

# Refuse a binary that does not report the pinned version before marking the cache done.
got_etcd=$("$BIN/etcd.tmp" --version | sed -n 's/^etcd Version: //p')
if [[ "v$got_etcd" != "$ETCD_VERSION" ]]; then
    echo "build.sh: version mismatch: etcd reports '$got_etcd'" >&2
    exit 1
fi
for cmd in "${KUBE_COMMANDS[@]}"; do
    if [[ $cmd == kubectl ]]; then
        got_kube=$("$BIN/kube.tmp/kubectl" version --client -o json | json_field - clientVersion gitVersion)
    else
        got_kube=$("$BIN/kube.tmp/$cmd" --version | sed -n 's/^Kubernetes //p')
    fi
    if [[ "$got_kube" != "$KUBE_VERSION" ]]; then
        echo "build.sh: version mismatch: $cmd reports '$got_kube'" >&2
        exit 1
    fi
done
mv -f "$BIN/etcd.tmp" "$BIN/etcd"
for cmd in "${KUBE_COMMANDS[@]}"; do
    mv -f "$BIN/kube.tmp/$cmd" "$BIN/$cmd"
done
rmdir "$BIN/kube.tmp"
printf '%s' "$STAMP_WANT" >"$STAMP.tmp"
mv -f "$STAMP.tmp" "$STAMP"

echo "build.sh: built $STAMP_WANT"
print_paths
