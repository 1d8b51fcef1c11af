# kvferry router image, also the CPU image (cpu-dev runs its workers on it). Build from the
# repository root:
#   docker build -f k8s/images/router.Dockerfile -t kvferry-router:0.1.0 .
# The router imports torch (K/V wire layout, sampling parameters), so this image has the CPU
# build of torch, but neither CUDA nor Triton nor Ray: cpu_requirements.py drops those from
# the project's dependencies, and tests/k8s checks the router and the CPU worker path import
# without them. NIXL stays (nixl-cu12, UCX bundled; runs without CUDA): the cpu-dev and nixl
# overlays run their workers on this image, nixl's with --kv-transport nixl.
# The model is mounted at /models; no HEALTHCHECK (Kubernetes probes gRPC health).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/kvferry \
    PATH=/opt/kvferry/bin:$PATH \
    HOME=/tmp

RUN python -m venv /opt/kvferry \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /src
COPY pyproject.toml README.md k8s/images/cpu_requirements.py ./
RUN python cpu_requirements.py pyproject.toml > requirements.txt \
    && pip install -r requirements.txt
COPY kvferry/ kvferry/
COPY router/ router/
COPY prefill_worker/ prefill_worker/
COPY decode_worker/ decode_worker/
COPY kernels/ kernels/
COPY deploy/ deploy/
RUN pip install --no-deps . && rm -rf /src

WORKDIR /tmp
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin kvferry
USER 10001:10001
ENTRYPOINT ["kvferry"]
CMD ["--help"]
