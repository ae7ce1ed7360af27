# The one image every kvrelay pod runs: the operator, the router, and the Ray head and
# workers of a KVRelayService (KubeRay starts `ray start` in it).
#
#   docker build -t kvrelay:0.1.0 .                       GPU image: CUDA kernels built in
#   docker build --build-arg KERNELS=cpu \
#       --build-arg PIP_EXTRA_INDEX_URL=<cpu wheel index> -t kvrelay:cpu .   CPU-only image
#
# torch is pinned (torch==2.13.0) by pyproject.toml; the default index gives the CUDA build
# for GPU nodes. CUDA_VERSION must have torch's CUDA major version (the kernels stage checks);
# TORCH_CUDA_ARCH_LIST picks the GPU architectures the kernels are compiled for.

ARG PYTHON_VERSION=3.11
ARG CUDA_VERSION=13.0.1
# cuda: compile kvrelay's CUDA kernels into the image; cpu: leave them out.
ARG KERNELS=cuda

# nvcc and the CUDA headers, for the kernels stage only (the final image has no toolkit:
# torch's wheels bring the CUDA runtime libraries).
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu22.04 AS cuda-toolkit
RUN mv "$(readlink -f /usr/local/cuda)" /opt/cuda-toolkit

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}
# A compiler for the few packages without wheels (and nvcc's host compiler); it stays in the
# build stages.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/kvrelay
ENV PATH=/opt/kvrelay/bin:$PATH
WORKDIR /src
# Dependencies first, so a code change does not reinstall torch and Ray. The `cluster` extra
# is ray[default]: Ray's dashboard and its agent (8265, 52365), which KubeRay's probes call;
# plain ray leaves them closed and KubeRay restarts the pods every ~10 minutes.
COPY pyproject.toml README.md setup.py MANIFEST.in ./
RUN python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["cluster"]))' > /tmp/requirements.txt
RUN pip install -q -r /tmp/requirements.txt
COPY services ./services
COPY kernels ./kernels
COPY operators ./operators
COPY proto ./proto
RUN pip install -q --no-deps ".[cluster]" \
 && kvrelay --version \
 && python -c "import aiohttp_cors, ray.dashboard.modules" \
 && python -m kvrelay_operator --help > /dev/null

# kvrelay's CUDA kernels, compiled ahead of time with torch's cpp_extension into the module
# kvrelay_kernels.cuda_backend loads (kvrelay_cuda_kernels), so no pod compiles at start.
FROM build AS kernels-cuda
ARG CUDA_VERSION
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"
COPY --from=cuda-toolkit /opt/cuda-toolkit /usr/local/cuda
ENV CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} MAX_JOBS=4
COPY deploy/docker/build_cuda_kernels.py /tmp/build_cuda_kernels.py
RUN python -c "import sys, torch; v = torch.version.cuda or ''; sys.exit(0 if v.split('.')[0] == '${CUDA_VERSION}'.split('.')[0] else 'torch is built for CUDA ' + (v or 'none (a CPU wheel)') + ': pass --build-arg CUDA_VERSION=<that version>, or KERNELS=cpu')" \
 && python /tmp/build_cuda_kernels.py "$(python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')" \
 && python -c "import torch, kvrelay_cuda_kernels"

FROM build AS kernels-cpu

FROM kernels-${KERNELS} AS kernels

FROM python:${PYTHON_VERSION}-slim-bookworm
# wget: KubeRay's probes of Ray pods call it. g++ and ninja: kvrelay builds its CPU attention
# kernel on first use.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends wget g++ \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 1000 kvrelay \
 && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash kvrelay \
 && mkdir -p /var/cache/kvrelay \
 && chown kvrelay:kvrelay /var/cache/kvrelay
COPY --from=kernels /opt/kvrelay /opt/kvrelay
ENV PATH=/opt/kvrelay/bin:$PATH \
    KVRELAY_CACHE_DIR=/var/cache/kvrelay \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /home/kvrelay
# Router: HTTP 8000, gRPC 50051. Operator: probe 8080, metrics 9090. Ray: GCS 6379, client
# 10001, dashboard 8265 and dashboard agent 52365 (KubeRay's probes).
EXPOSE 8000 50051 8080 9090 6379 10001 8265 52365
CMD ["kvrelay", "--help"]
