# gpudaemon image. NVML (libnvidia-ml.so) comes from the host driver through the NVIDIA
# container runtime, so the image carries no CUDA or driver libraries.
# Built for a read-only root filesystem, non-root, all capabilities dropped.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpudaemon ./gpudaemon
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
LABEL org.opencontainers.image.title="gpudaemon" \
      org.opencontainers.image.description="GPU node agent for Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /install /usr/local
# No .pyc writes (read-only root FS); logs unbuffered; NVML visible via the NVIDIA runtime.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
# The InfluxDB spool's default directory, writable by the agent's user. Under a
# read-only root filesystem mount a volume here instead (docs/influxdb.md): without a
# writable spool, `gpudaemon run` with influxdb.url set exits 2 rather than lose points.
RUN mkdir -p /var/lib/gpudaemon/spool && chown -R 65532:65532 /var/lib/gpudaemon
USER 65532:65532
EXPOSE 9445 9446
ENTRYPOINT ["gpudaemon"]
CMD ["run"]
