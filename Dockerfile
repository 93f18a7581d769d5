# The image the Helm chart runs: pdserve with the `gpu` extra (sgl-kernel FA3, FlashInfer) on a
# CUDA base with nvcc (FlashInfer compiles its kernels just in time, into $HOME/.cache).
#   docker build -t pdserve:0.1.0 .
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/pdserve/bin:$PATH FLASHINFER_CUDA_ARCH_LIST="9.0a"
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev ninja-build \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/pdserve

# torch first, from the CUDA 13.0 builds sgl-kernel 0.4.5 is made for.
ARG TORCH_SPEC="torch==2.11.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cu130"
RUN pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX"

WORKDIR /opt/pdserve/src
COPY pyproject.toml README.md ./
COPY protos protos
COPY pdserve pdserve
COPY prefill_service prefill_service
COPY decode_service decode_service
COPY router router
COPY kv_transfer kv_transfer
RUN pip install ".[gpu]"

# The chart runs pods as this user with a read-only root filesystem and /tmp as scratch.
RUN useradd --uid 10001 --user-group --home-dir /tmp --no-create-home pdserve
USER 10001
EXPOSE 50051 9400
CMD ["pdserve", "up", "--host", "0.0.0.0"]
