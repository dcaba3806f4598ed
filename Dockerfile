# syntax=docker/dockerfile:1
# gpudaemon image: the agent (`gpudaemon run`) and the scheduler extender
# (`gpudaemon extender`). NVML (libnvidia-ml.so) comes from the host driver through the
# NVIDIA container runtime or CDI, so the image carries no CUDA or driver libraries.
# Built for a read-only root filesystem, uid 65532, all capabilities dropped.
#
# BASE is any image with Python >= 3.11 and its venv module at the same path in both
# stages. The default is the public one; where no registry is reachable,
# scripts/build-image makes a Debian bookworm base with mmdebstrap and passes it here.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 LANG=C.UTF-8
RUN python3 -m venv /opt/gpudaemon
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY gpudaemon ./gpudaemon
# Package-index access for this step only: optional build secrets, never in a layer.
#   pipconf: a pip.conf (index URL, credentials)   cacert: a CA bundle for pip to trust
# Wheels only (no compiler anywhere); pip and setuptools leave the venv afterwards, and
# so does the kubernetes client's asyncio twin (kubernetes/aio, ~68 MB that nothing
# imports); the bytecode is compiled now, because at run time the root is read-only.
RUN --mount=type=secret,id=pipconf --mount=type=secret,id=cacert \
    set -e; \
    if [ -s /run/secrets/pipconf ]; then export PIP_CONFIG_FILE=/run/secrets/pipconf; fi; \
    if [ -s /run/secrets/cacert ]; then export PIP_CERT=/run/secrets/cacert; fi; \
    /opt/gpudaemon/bin/pip install --only-binary=:all: --no-binary=gpudaemon . ; \
    /opt/gpudaemon/bin/python -m pip uninstall -q -y pip setuptools; \
    rm -rf /opt/gpudaemon/lib/python3*/site-packages/kubernetes/aio; \
    /opt/gpudaemon/bin/python -m compileall -q /opt/gpudaemon/lib

FROM ${BASE}
LABEL org.opencontainers.image.title="gpudaemon" \
      org.opencontainers.image.description="GPU node agent and scheduler extender for Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/gpudaemon /opt/gpudaemon
ENV PATH=/opt/gpudaemon/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility \
    MALLOC_ARENA_MAX=2
# MALLOC_ARENA_MAX: glibc's per-thread malloc arenas are most of what the agent's few
# threads cost; two arenas save 1.6 MiB of RSS (bench/memory, docs/benchmarks.md).
# The InfluxDB spool's default directory, writable by the agent's user. Under a
# read-only root filesystem the chart mounts a volume here.
RUN mkdir -p /var/lib/gpudaemon/spool && chown -R 65532:65532 /var/lib/gpudaemon
USER 65532:65532
EXPOSE 9445 9446
ENTRYPOINT ["gpudaemon"]
CMD ["run"]
