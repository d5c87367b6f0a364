# gpuvisor's container image: `docker build -t gpuvisor:latest .`
#
# Two stages from the same base image: the builder makes /opt/gpuvisor/venv and installs the
# project into it; the final stage copies only that venv (no compiler, no pip, no caches). Both
# stages MUST use the same BASE_IMAGE: the venv's bin/python is a symlink to the base image's
# interpreter (/usr/local/bin/python3 in python:*-slim, /usr/bin/python3 in a Debian rootfs).
#
# Offline builds: put wheels for every dependency (and the build backend, setuptools) in a
# wheels/ directory of the build context; they are then used with no index. For example:
#   pip download -d wheels . 'setuptools>=68' wheel
#   docker build --network none --build-arg BASE_IMAGE=local/python:3.11 -t gpuvisor:latest .
# PIP_ARGS passes further pip options (a mirror, --no-index, ...) to the install.

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
ARG PIP_ARGS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
# .dockerignore lets in only what the build needs: pyproject.toml, the three packages, the
# README and license if present, and wheels/.
COPY . /src
# A non-editable install builds a wheel of the project and installs it with its dependencies;
# the bytecode is compiled now, since the final image runs with a read-only root filesystem, and
# so is the code its dataclasses compile at every start (common/methodcache.py: ~35 ms of it).
# pip and setuptools are removed afterwards: nothing at run time needs them.
RUN set -eu; \
    offline=""; \
    if [ -d /src/wheels ] && [ -n "$(ls -A /src/wheels)" ]; then \
        offline="--no-index --find-links /src/wheels"; \
    fi; \
    python3 -m venv /opt/gpuvisor/venv; \
    /opt/gpuvisor/venv/bin/python -m pip install --compile $offline $PIP_ARGS /src; \
    /opt/gpuvisor/venv/bin/python -I -m common.methodcache; \
    /opt/gpuvisor/venv/bin/gpuvisor --help > /dev/null; \
    /opt/gpuvisor/venv/bin/python -m pip uninstall --yes --quiet pip setuptools

FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="gpuvisor" \
      org.opencontainers.image.description="A Kubernetes device plugin for NVIDIA GPUs: a supervisor and one worker process per resource" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /opt/gpuvisor/venv /opt/gpuvisor/venv
ENV PATH=/opt/gpuvisor/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# No USER: the device plugin must run as root to use the kubelet's device-plugins directory and
# kubelet.sock (owned by root, writable by no one else). The DaemonSet drops every capability.
ENTRYPOINT ["/opt/gpuvisor/venv/bin/gpuvisor"]
CMD ["run"]
