# syntax=docker/dockerfile:1
# kvguard: the sidecar / device exporter image.
#   docker build -t kvguard:0.1.0 .
#   docker run --rm -p 10240:10240 --read-only kvguard:0.1.0 serve --demo   (demo spool in /dev/shm)
# Build stage: the wheel from this repository plus the wheels it depends on.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter ./exporter
# setup.py is left out: the allocator models' optional C engines speed up `simulate` and `plan`, not the
# sidecar, and the slim image has no compiler; the Python models give the same results.
# nvml: NVIDIA's NVML bindings (pure Python) for the DaemonSet's device source. npu-smi comes
# from the host; torch and MindSpore live in the serving image, never here.
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[nvml]"

# Runtime stage: only the installed wheels; no compiler, no pip cache, no source tree.
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Bytecode is compiled at install time, so a read-only root filesystem costs nothing at start.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels "kvguard[nvml]" \
    && groupadd --system --gid 10240 kvguard \
    && useradd --system --uid 10240 --gid kvguard --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin kvguard
USER 10240:10240
WORKDIR /tmp
EXPOSE 10240
ENTRYPOINT ["kvguard"]
CMD ["serve"]
