# gpuguard: node-level GPU health agent (runs as a DaemonSet; see deploy/daemonset.yaml).
#
#   docker build -t registry.example.com/gpuguard:0.1.0 . && docker push registry.example.com/gpuguard:0.1.0
#
# then name that image in the chart's image.repository (or the two image: lines of deploy/daemonset.yaml).
# The tests build this file with buildah on a Debian stand-in base (hack/image/build.sh, PYTHON_IMAGE below)
# and run the result read-only as uid 65532 (tests/test_image.py).
#
# The image carries no NVIDIA library: libnvidia-ml.so.1 and the /dev/nvidia* device nodes come from the
# node's driver, injected at run time by the NVIDIA container toolkit (see deploy/daemonset.yaml).
#
# Base: the same pinned slim Debian image for both stages, so the venv's interpreter symlinks
# (/opt/venv/bin/python -> /usr/local/bin/python3.11) resolve in the final image. For fully reproducible
# builds, pin the digest too (python:3.11.14-slim-bookworm@sha256:...), after checking it with
# `docker buildx imagetools inspect`. Any base with `python` (>= 3.11) and `pip` on PATH works.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---- builder: build gpuguard's wheel and install it (and its dependencies) into /opt/venv -----------------
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src

# Only what the wheel needs (.dockerignore keeps the rest of the tree out of the context anyway).
# README.md* : pyproject names README.md as the long description; the glob keeps the build working
# while it does not exist (setuptools only warns).
COPY pyproject.toml README.md* ./
COPY gpuguard/ gpuguard/

# The venv has no pip/setuptools of its own (--without-pip): the builder's pip installs into it through
# --python, so the shipped venv holds gpuguard and its runtime dependencies only. pip byte-compiles what
# it installs, so the read-only final image never needs to write .pyc files.
RUN python -m venv --without-pip /opt/venv \
 && pip wheel --no-cache-dir --no-deps --wheel-dir /tmp/wheels . \
 && pip --python /opt/venv/bin/python install --no-cache-dir /tmp/wheels/gpuguard-*.whl \
 && /opt/venv/bin/gpuguard version

# ---- final: the slim base plus the venv; nothing is created or installed at run time ----------------------
FROM ${PYTHON_IMAGE}

LABEL org.opencontainers.image.title="gpuguard" \
      org.opencontainers.image.description="Node-level GPU health agent for Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"

COPY --from=builder /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Numeric, so kubelet can verify runAsNonRoot without an /etc/passwd entry (65532: the conventional
# "nonroot" id). NVML works as non-root on default driver installs; see deploy/daemonset.yaml.
USER 65532:65532

# /healthz, /readyz and /metrics (--listen, default 0.0.0.0:9847).
EXPOSE 9847

# gpuguard installs its own SIGTERM handler, so running as PID 1 stops cleanly without an init shim.
ENTRYPOINT ["gpuguard"]
CMD ["watch"]
