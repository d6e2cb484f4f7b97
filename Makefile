# gpuguard: every target installs what it needs. See README.md.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUNTIME_STAMP := $(VENV)/.installed-runtime
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# A .venv made by another Python (e.g. before an upgrade, or a different $(PYTHON)) is rebuilt, not reused:
# its interpreter may be gone or older than requires-python.
VENV_OK := $(shell test -x $(BIN)/python && test "$$($(BIN)/python -c 'import sys; print(sys.version_info[:2])' 2>/dev/null)" = "$$($(PYTHON) -c 'import sys; print(sys.version_info[:2])' 2>/dev/null)" && echo yes)
ifneq ($(VENV_OK),yes)
$(shell rm -rf $(VENV))
endif

.PHONY: install run test builds e2e unit mutation lint lint-code fakenvml podresources-stubs testenv testenv-oldest kwok karpenter helm promtool image kube-up kube-down kube-status bench fleet-bench gpu-smoke clean

install: $(STAMP)

# Everything the tests and linters need (the dev extra); it includes the runtime.
$(STAMP): pyproject.toml
	@echo "installing gpuguard with its dev extra into $(VENV) (pip; a minute or two the first time)..."
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@ $(RUNTIME_STAMP)

# gpuguard and its runtime dependencies only: what `make run` needs.
$(RUNTIME_STAMP): pyproject.toml
	@echo "installing gpuguard and its runtime dependencies into $(VENV) (pip; about a minute the first time)..."
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e .
	@echo "installed: $(BIN)/gpuguard"
	touch $@

# The demo: 8 mock GPUs, dry run, no GPU and no cluster needed; healthy, then a fault, then the change it
# would make to the node. Stops by itself after 8 s. The mock's driver logs its Xids in build/demo-kmsg, read
# as the kernel log.
run: $(RUNTIME_STAMP)
	@mkdir -p build
	@echo "the demo: 8 mock GPUs in dry run for 8 s (healthy, an ignored Xid 13, an ECC error, a fatal Xid 79)"
	$(BIN)/gpuguard watch --dry-run --backend mock --interval 0.5 --run-for 8 --listen 127.0.0.1:0 --log-format console --kernel-log $(CURDIR)/build/demo-kmsg

# The fake libnvidia-ml.so.1 (tests/fakenvml), built with the machine's gcc against NVIDIA's nvml.h (the dev
# extra installs nvidia-nvml-dev) with -Werror: a signature that differs from nvml.h does not build.
fakenvml: install
	tests/fakenvml/build.sh build/fakenvml

# The kubelet PodResources API's Python stubs (gpuguard/kube/podresources/v1), generated from the committed proto with
# grpcio-tools (pinned in the dev extra); tests/test_podresources.py fails when they differ from what this makes.
podresources-stubs: install
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
		gpuguard/kube/podresources/v1/api.proto

# etcd, kube-apiserver, kube-scheduler and kube-controller-manager built from their official Go modules
# (pinned in hack/testenv/versions.env), cached per user under ~/.cache/gpuguard/testenv/<versions>/
# ($GPUGUARD_CACHE): the first build takes ~10-20 minutes on 2 cores, later ones reuse the binaries.
testenv:
	bash hack/testenv/build.sh

# The oldest supported Kubernetes (versions.env KUBE_VERSION_OLDEST): kube-apiserver and etcd only.
testenv-oldest:
	bash hack/testenv/build.sh --oldest

# kwok (simulated nodes for the scheduling tests), built once from its pinned Go module into
# ~/.cache/gpuguard/kwok/<version>/ (~4-9 min cold on 2 cores).
kwok:
	hack/kwok/build.sh >/dev/null

# Karpenter's kwok provider (the autoscaler of tests/integration/test_karpenter.py) and its CRDs, built once
# from its pinned Go module into ~/.cache/gpuguard/karpenter/<version>/ (~5 min cold on 2 cores; its go.mod
# needs Go 1.26.9+, so the build alone fetches the go1.27.3 toolchain through the Go module proxy).
karpenter:
	hack/karpenter/build.sh >/dev/null

# helm 4 and helm 3, each built once from its pinned Go module into ~/.cache/gpuguard/helm/<version>/
# (~3-5 min each cold on 2 cores).
helm:
	hack/helm/build.sh
	hack/helm/build.sh --v3

# promtool (Prometheus's rule checker), built once from its Go module into ~/.cache/gpuguard/promtool/<version>/.
promtool:
	hack/promtool/build.sh

# The Dockerfile's image, built with buildah on a Debian stand-in base (hack/image/build.sh; root; installs
# buildah and debootstrap with apt-get when missing). The base is cached in ~/.cache/gpuguard/image-base/.
image:
	hack/image/build.sh

# A control plane on 127.0.0.1 for manual use; prints the admin kubeconfig path (.kube-test/kubeconfig).
# kube-controller-manager always (without its namespace controller `kubectl delete namespace`, and so
# README's `kubectl delete -f deploy/...`, never ends: the namespace stays Terminating);
# KUBE_UP_WITH=all also starts kube-scheduler and kwok; all,karpenter also Karpenter.
KUBE_UP_WITH ?=
KUBE_UP_KWOK := $(or $(findstring all,$(KUBE_UP_WITH)),$(findstring kwok,$(KUBE_UP_WITH)))
kube-up: install testenv $(if $(KUBE_UP_KWOK),kwok) $(if $(findstring karpenter,$(KUBE_UP_WITH)),karpenter)
	$(BIN)/python -m harness.controlplane up --with "controller-manager,$(KUBE_UP_WITH)"

kube-down: install
	$(BIN)/python -m harness.controlplane down

kube-status: install
	$(BIN)/python -m harness.controlplane status

# pytest-xdist workers for `make test`: 4 on the 2-core CI machine, because the tests wait on the API server,
# etcd and subprocess agents much of the time (with 2 workers pytest used 576 CPU-s in 621 s of wall clock:
# under half of the two cores, 2026-12-06); each worker starts its own control planes, so each worker adds
# their memory. --dist loadfile keeps a file's tests (and its fixtures) on one worker.
TEST_WORKERS ?= 4

# The linters on the code first (a style or typing regression fails in a minute, before the builds), then
# every pinned build (hack/build-all.sh), the chart's lint, and the tests: unit tests, the nvml backend
# through the fake library, and the integration tests against a real etcd + kube-apiserver that the test
# session starts on 127.0.0.1 and stops again.
test: install fakenvml
	$(MAKE) --no-print-directory lint-code
	hack/build-all.sh
	"$$(hack/helm/build.sh)" lint --strict deploy/helm/gpuguard
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Every pinned build the tests use (Kubernetes twice, etcd, kwok, Karpenter, Helm 4 and 3, promtool, the
# image), each timed; one shared Go module and build cache (hack/lib/gobuild.sh).
builds:
	hack/build-all.sh

# The burst scale-out end to end (bench/burst.py): 40 + 12 kwok GPU nodes, 2 -> 340 replicas, faults mid-burst,
# for gpuguard, the seed design and no agent on the real scheduler and controller-manager; prints the table.
# Then its eviction case (bench/burst_evict.py): a GPU fails under running pods mid-burst, gpuguard with and
# without --evict gpu-pods; prints the time until their replacements Run elsewhere. Then the repair's case
# (bench/repair.py): a GPU reset and returned while its neighbours serve, from the fault to back in service.
e2e: install fakenvml testenv kwok
	$(BIN)/python -m bench.burst
	$(BIN)/python -m bench.burst_evict
	$(BIN)/python -m bench.repair

unit: install fakenvml
	$(BIN)/python -m pytest -q --ignore=tests/integration

# Mutation testing of the pure decision modules (hack/mutation.py; not part of `make test`): every mutant
# against the fast unit tests that run its line (chosen by coverage, pinned in the dev extra), then the kill rate per
# module; docs/reliability.md has the last report. The whole set of 48 modules, 3,367 mutants, took 22.2
# minutes on the 2-core machine beside Go builds (2026-12-06). A part:
# MUTATION_ARGS="--module gpuguard/judge/policy.py" or "--sample 60" (a seeded sample of each module).
MUTATION_ARGS ?=
mutation: install
	$(BIN)/python hack/mutation.py $(MUTATION_ARGS)

# Every performance figure in docs/performance.md comes from here (the whole file; the sections other
# commands measure, e.g. `make e2e`'s, are kept verbatim between their markers). About 13 minutes, then the
# fleet at FLEET_NODES (bench/fleet_scale.py, 5000: about 25 minutes more; FLEET_NODES=0 skips it and says so).
FLEET_NODES ?= 5000
bench: install fakenvml testenv
	mkdir -p build
	FLEET_NODES=$(FLEET_NODES) $(BIN)/python -m bench.run --json build/bench.json

# The fleet at Kubernetes' limit (bench/fleet_scale.py): NODES (5000) agents start at once with the shipped
# FlowSchema, start-up jitter and rate limit, then 10% of them fault at once; docs/performance.md "The
# fleet at 5,000 nodes", with the API server's cost of the agents' budget watches (--watch-cost). Results in
# build/fleet-bench.json and, as a section for docs/performance.md, build/fleet-bench.md. About 30 minutes at
# 5,000 nodes on the 2-core machine.
NODES ?= 5000
fleet-bench: install testenv
	mkdir -p build
	$(BIN)/python -m bench.fleet_scale --nodes $(NODES) --configs shipped --watch-cost \
		--out build/fleet-bench.json --markdown build/fleet-bench.md

# On a machine with an NVIDIA GPU and driver (never run in this project's sessions, which have none):
# check and a 20 s watch --dry-run through the real libnvidia-ml.so.1, compared with nvidia-smi -q -x.
gpu-smoke: install
	$(BIN)/python hack/gpu_smoke.py

# The code's linters (ruff, mypy --strict, the import contracts, hadolint); `make lint` adds the chart's.
lint-code: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/hadolint Dockerfile

lint: lint-code
	"$$(hack/helm/build.sh)" lint --strict deploy/helm/gpuguard

# Everything made in the clone, .venv included; the per-user caches (~/.cache/gpuguard) stay.
clean:
	rm -rf $(VENV) build .kube-test .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
