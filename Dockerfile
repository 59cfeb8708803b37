# syntax=docker/dockerfile:1
# The consumer-proxy image: the package and its runtime dependencies on a slim Python, run as
# a non-root user. No compilers, no dev tools, no Java or Spark (the `pipeline` extra for the
# DLQ Spark jobs is left out; run those from a workstation or a Spark image).
#
#   docker build -t consumer-proxy:0.1.0 .
#   docker run --rm -v "$PWD/conf:/etc/consumer-proxy/config:ro" consumer-proxy:0.1.0 \
#     validate --config /etc/consumer-proxy/config/proxy.yaml

ARG PYTHON_IMAGE=python:3.11-slim

# -- build: a virtualenv with the package and its dependencies (all binary wheels) ------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ONLY_BINARY=:all:
RUN python -m venv /opt/consumer-proxy
WORKDIR /src
COPY pyproject.toml README.md ./
COPY consumer_proxy ./consumer_proxy
# A plain (non-editable) install with the tracing extra only (the OpenTelemetry SDK and OTLP
# exporters, so tracing can be turned on by configuration): no dev tools, no PySpark.
# Byte-compiled here because the running container's root filesystem is read-only. pip and
# setuptools are not needed at run time.
RUN /opt/consumer-proxy/bin/pip install --no-compile ".[tracing]" \
    && /opt/consumer-proxy/bin/python -m compileall -q /opt/consumer-proxy/lib \
    && /opt/consumer-proxy/bin/pip uninstall -y setuptools pip \
    && /opt/consumer-proxy/bin/consumer-proxy --version

# -- runtime ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="consumer-proxy" \
      org.opencontainers.image.description="Kafka consumer push proxy" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric UID/GID so Kubernetes can verify runAsNonRoot (the chart uses 10001).
RUN groupadd --system --gid 10001 proxy \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin proxy
COPY --from=build /opt/consumer-proxy /opt/consumer-proxy
ENV PATH=/opt/consumer-proxy/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
# /metrics, /healthz and /readyz (worker i of --workers N: 9464 + i).
EXPOSE 9464
ENTRYPOINT ["consumer-proxy"]
CMD ["run", "--config", "/etc/consumer-proxy/config/proxy.yaml"]
