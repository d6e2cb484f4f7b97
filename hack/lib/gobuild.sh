# Shared by the build scripts under hack/ (sourced, not run): the parts of a cached, pinned
# Go build from the module proxy that do not depend on what is built.

# gpuguard_cache_root: where the pinned Go builds are cached. A per-user cache outside the clone, so a fresh
# clone (CI, a worktree) reuses binaries already built for the same pinned versions; every build lives in a
# directory named after its versions, so a version change builds anew. GPUGUARD_CACHE overrides it.
gpuguard_cache_root() {
    printf '%s' "${GPUGUARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard}"
}

# read_pin KEY: a pinned version (vN.N.N, or goN.N.N for a Go toolchain) from hack/testenv/versions.env, the
# one file of pins that harness/controlplane.py reads too. It is plain KEY=VALUE; only KEY is read, nothing is
# sourced. Needs $ROOT.
read_pin() {
    local value file="$ROOT/hack/testenv/versions.env"
    value=$(sed -n "s/^$1=\(\(v\|go\)[0-9][0-9.]*\)[[:space:]]*$/\1/p" "$file")
    if [[ -z "$value" ]]; then
        echo "build.sh: $1 missing or malformed in $file" >&2
        exit 1
    fi
    printf '%s' "$value"
}

# cache_lock DIR: one build at a time per cache directory (pytest and make may race); a second caller
# waits for the first and then re-checks the cache itself.
cache_lock() {
    mkdir -p "$1"
    exec 9>"$1/.lock"
    if ! flock -n 9; then
        echo "build.sh: another build holds $1/.lock; waiting for it..." >&2
        flock 9
    fi
}

# go_shared_env DIR: the Go environment of every pinned build. One module cache and one build cache for
# all of them, under $(gpuguard_cache_root)/go/: Go's caches are content-addressed and safe to share across
# versions, toolchains and concurrent builds, so a module or package that two pins share (client-go,
# apimachinery, protobuf, grpc, cobra, ... at the same version) is downloaded and compiled once. Separate
# from the user's own Go caches (the build never depends on, or pollutes, them); -modcacherw keeps the module
# cache deletable with rm -rf. Static binaries, the installed Go toolchain only, no workspace. DIR is the
# build's own cache directory: the private gopath/ and gocache/ that earlier layouts kept there (several GB
# each) are removed.
# GOGC is not set here, measured: a set GOGC turns off the compiler's own start-heap boost (cmd/compile grows its
# heap to 128 MB before its first GC unless GOGC or GOMEMLIMIT is set). Cold helm 4 on 2 shared cores, CPU-s
# (user+sys) and peak RSS of the whole build: unset 222 (3 runs, 0.8-0.9 GB), GOGC=200 232 (2 runs, +4%),
# GOGC=400 216 (2 runs, -3%, 1.1 GB), GOGC=off 210 (3 runs, -6%, 1.5-1.6 GB): too little for the memory.
go_shared_env() {
    command -v go >/dev/null || {
        echo "build.sh: 'go' not found in PATH (Go >= 1.26 is needed)" >&2
        exit 1
    }
    local shared
    shared="$(gpuguard_cache_root)/go"
    mkdir -p "$shared"
    rm -rf "$1/gopath" "$1/gocache"
    export GOPATH="$shared/path"
    export GOMODCACHE="$shared/mod"
    export GOCACHE="$shared/build"
    export GOTOOLCHAIN=local
    export CGO_ENABLED=0
    export GOFLAGS="-buildvcs=false -modcacherw"
    export GOWORK=off
    unset GOBIN GOOS GOARCH
}

# parse_force_args SCRIPT ARG...: the arguments of a build script: --force (sets force=1), -h/--help
# (prints SCRIPT's header comment and exits), and whatever the script's own build_arg function accepts
# (if it defines one: build_arg ARG returns 0 when it took ARG); anything else exits 2.
parse_force_args() {
    local script=$1 arg
    shift
    force=0
    for arg in "$@"; do
        case "$arg" in
            --force) force=1 ;;
            -h | --help)
                sed -n '2,/^set -euo/p' "$script" | sed '$d; s/^# \{0,1\}//'
                exit 0
                ;;
            *)
                if ! { declare -F build_arg >/dev/null && build_arg "$arg"; }; then
                    echo "build.sh: unknown argument: $arg" >&2
                    exit 2
                fi
                ;;
        esac
    done
}

# cached_or_lock BIN CACHE: unless --force, print BIN and exit when it is there (the fast path: no lock, no
# go; a binary only ever appears by an atomic rename after it reported its pinned version, so its presence
# means a complete build). Otherwise take CACHE's lock and look again (the build we waited for may have
# made it); returns, holding the lock, when a build is needed.
cached_or_lock() {
    local bin=$1 cache=$2
    if [[ ${force:-0} == 0 && -x "$bin" ]]; then
        echo "$bin"
        exit 0
    fi
    cache_lock "$cache"
    if [[ ${force:-0} == 0 && -x "$bin" ]]; then
        echo "$bin" # built by the build we waited for
        exit 0
    fi
}
