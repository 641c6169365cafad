# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
#
# vllm-afd, cuda flavor: one image for both roles; the role is chosen at run time.
#
#   docker build -t vllm-afd:cuda .
#
# Two hosts over tcp (the same VLLM_AFD_TOKEN exported on both). The FFN publishes its
# AFD port (AFDConfig.port, 7700; FFN rank f listens on 7700 + f) besides its HTTP port;
# the attention server dials FFN_HOST:7700 and serves the API on 8000:
#
#   docker run --gpus all -p 8100:8100 -p 7700:7700 -e PORT=8100 -e VLLM_AFD_TOKEN \
#       vllm-afd:cuda MODEL --port 8100 \
#       --afd-role ffn --afd-config '{"host": "0.0.0.0", "connector": "tcp"}'
#   docker run --gpus all -p 8000:8000 -e VLLM_AFD_TOKEN vllm-afd:cuda MODEL --port 8000 \
#       --afd-role attention --afd-config '{"host": "FFN_HOST", "connector": "tcp"}'
#
# One host: the default shm connector needs both containers in the host's network and
# IPC namespaces (its socket is an abstract unix socket, its segments are in /dev/shm):
# add `--network host --ipc host` to both, drop -p and the tcp settings.
#
# Stage `build` makes the wheel with the README's make target; the CUDA kernels are
# compiled by the pinned toolchain (tools/build/cuda_toolchain.py: nvcc and the CUDA torch's
# headers from PyPI wheels), so it needs no CUDA base image and no GPU. Stage
# `runtime` is a slim Python with that wheel installed, run as a non-root user; the
# NVIDIA container runtime provides the driver. No secret is baked in: pass
# VLLM_AFD_TOKEN at run time (-e VLLM_AFD_TOKEN), or mount a file and name it in
# --afd-config's token_file.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# Build tools only; versions come with the base image's Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ git make quilt \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN make env \
    && VLLM_AFD_CUDA_TOOLCHAIN="$(.venv/bin/python tools/build/cuda_toolchain.py)" \
       make wheel FLAVOR=cuda

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --gid 1000 vllm && useradd --create-home --uid 1000 --gid 1000 vllm
COPY --from=build /src/dist/vllm_afd-*.cuda-*.whl /tmp/wheels/
RUN pip install --no-cache-dir /tmp/wheels/vllm_afd-*.whl \
    && rm -rf /tmp/wheels
USER 1000:1000
WORKDIR /home/vllm
# The HTTP port the health check asks: set it to the --port you serve on.
ENV PORT=8000
# The HTTP port, and the FFN's AFD port (AFDConfig.port) for the attention servers.
EXPOSE 8000 7700
# Both roles answer /health on their HTTP port (503 while an attention server has no FFN).
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('PORT', '8000') + '/health', timeout=4)"]
ENTRYPOINT ["vllm", "serve"]
