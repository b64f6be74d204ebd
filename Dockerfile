# inference-guard container image (first version; completed with the deployment work).
# Build: docker build -t inference-guard .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all

WORKDIR /opt/inference-guard
COPY pyproject.toml README.md ./
COPY guard_core ./guard_core
COPY guard_adapters ./guard_adapters
COPY guard_trio ./guard_trio
RUN python -m pip install --root-user-action=ignore . \
    && useradd --system --uid 10001 --no-create-home guard

# The attestation route reads the dstack socket and NVML; both are mounted at run time.
USER guard
EXPOSE 8000
ENTRYPOINT ["inference-guard"]
CMD ["serve"]
