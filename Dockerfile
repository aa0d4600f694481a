# syntax=docker/dockerfile:1
# pd-gateway image: only the gateway package and its dependencies, run as a non-root user.
#
#   docker build -t registry.example.com/ml/pd-gateway:0.1.0 .
#   docker run --rm -p 8000:8000 registry.example.com/ml/pd-gateway:0.1.0 \
#       --host 0.0.0.0 --prefill http://p1:30000 8998 --decode http://d1:30001
#
# The build context is cut down by .dockerignore to pyproject.toml and gateway/: the
# simulator, launcher, tests and load tests never enter the image (so --launch is not
# available in it; the gateway there discovers or is given its servers).

ARG PYTHON_VERSION=3.11

# --- builder: a wheel of the project and wheels of all its dependencies -----------------------
FROM python:${PYTHON_VERSION}-slim AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
COPY gateway ./gateway
RUN python -m pip wheel --wheel-dir /wheels .

# --- runtime -----------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS runtime
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 gateway \
 && useradd --system --uid 10001 --gid gateway --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin gateway
# Install from the builder's wheels only (no index); the wheels stay out of every layer.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m pip install --no-index --find-links=/wheels pd-gateway
USER 10001:10001
EXPOSE 8000
# Docker only (Kubernetes uses the probes in deploy/k8s): the process answers /health.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["python", "-m", "gateway"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
