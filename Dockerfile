# inference-guard container image.
# Build: docker build -t inference-guard .
# Run:   docker run -e UPSTREAM=http://vllm:8000 -e DYNAMIC_METRICS_URL=http://vllm:8000/metrics \
#                   -e TOKEN=... -p 8000:8000 inference-guard
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility

WORKDIR /opt/inference-guard
COPY pyproject.toml README.md ./
COPY guard_core ./guard_core
COPY guard_adapters ./guard_adapters
COPY guard_trio ./guard_trio
RUN python -m pip install --root-user-action=ignore . \
    && useradd --system --uid 10001 --no-create-home guard

# The attestation route reads the dstack socket (/var/run/dstack.sock) and NVML; mount both at
# run time. Everything else is configured by PIG's environment variables (docs/configuration.md).
USER guard
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
# Exec form: the proxy runs as PID 1 and receives SIGTERM directly, so `docker stop` drains the
# requests in flight (PIG_DRAIN_SECONDS) before the container exits.
ENTRYPOINT ["inference-guard"]
CMD ["serve"]
