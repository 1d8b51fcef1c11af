# kvferry worker image: CUDA runtime, CUDA torch, the project with all its dependencies
# (Triton kernels, Ray transport). Build from the repository root:
#   docker build -f k8s/images/worker.Dockerfile -t kvferry-worker:0.1.0 .
# The model is not baked in: pods mount it read-only at /models. Kubernetes probes the gRPC
# health service, so there is no HEALTHCHECK. Everything writable lives under /tmp (an
# emptyDir in the manifests), so the root filesystem can be read-only.
# NIXL (--kv-transport nixl) comes with the project's dependencies: nixl-cu12, built for CUDA 12
# like this image, with UCX and its InfiniBand/RoCE (mlx5) and CUDA transports bundled. On a
# CUDA 13 base and torch, also `pip install nixl==1.5.1`: that meta-package picks nixl-cu13 at
# import, and kvferry imports `nixl` before `nixl_cu12`.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/kvferry \
    PATH=/opt/kvferry/bin:$PATH \
    HOME=/tmp

# Triton compiles a small C launcher at first use: it needs gcc and the Python headers at run
# time, not only at build time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/kvferry \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvferry/ kvferry/
COPY router/ router/
COPY prefill_worker/ prefill_worker/
COPY decode_worker/ decode_worker/
COPY kernels/ kernels/
COPY deploy/ deploy/
RUN pip install . && rm -rf /src

WORKDIR /tmp
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin kvferry
USER 10001:10001
ENTRYPOINT ["kvferry"]
CMD ["--help"]
