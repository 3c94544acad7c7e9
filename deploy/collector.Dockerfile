# syntax=docker/dockerfile:1
# The standalone rankwatch collector (`rankwatch collector serve`): slim Python, no torch,
# non-root fixed UID 10001 (the Helm chart's collector.uid). Build from the repository root:
#   docker build -f deploy/collector.Dockerfile -t rankwatch/collector:0.1.0 .
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY rankwatch ./rankwatch
COPY agent ./agent
COPY collector ./collector
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# torch is a dependency of the agent (inside the training processes), not of the collector:
# install rankwatch without dependencies, then only what the collector imports: pyyaml, the
# Prometheus client and aiohttp (its default HTTP server). tests/test_helm.py runs the collector
# with torch made unimportable.
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl \
    && pip install --no-cache-dir "pyyaml==6.0.3" "prometheus-client==0.26.0" "aiohttp==3.14.5" \
    && rm -rf /wheels \
    && groupadd --gid 10001 rankwatch \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin rankwatch \
    && mkdir -p /var/lib/rankwatch \
    && chown 10001:10001 /var/lib/rankwatch
USER 10001:10001
WORKDIR /var/lib/rankwatch
EXPOSE 8765
# The chart gives the token as RANKWATCH_TOKEN (from a Secret) and mounts a PVC on the data dir.
CMD ["rankwatch", "collector", "serve", "--host", "0.0.0.0", "--port", "8765", "--data-dir", "/var/lib/rankwatch"]
