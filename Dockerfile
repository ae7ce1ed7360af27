# The image every kvrelay service pod runs: the router, and the Ray head and workers of a
# KVRelayService (KubeRay starts `ray start` in it); and, as its own target, the operator's.
#
#   docker build -t kvrelay:0.1.0 .                       GPU image: CUDA kernels built in
#   docker build --build-arg KERNELS=cpu \
#       --build-arg PIP_EXTRA_INDEX_URL=<cpu wheel index> -t kvrelay:cpu .   CPU-only image:
#                                                         CPU kernels built in
#   docker build --target operator -t kvrelay-operator:0.1.0 .   the operator and the CRD
#                                                         hook: no torch, no CUDA, no Ray
#   --build-arg PYTHON_FILE_CAPS=cap_ipc_lock+ep          python may pin memory for RDMA as
#                                                         uid 1000 (rdma.privilege FileCapabilities)
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
RUN python -m venv /opt/kvrelay \
 && mkdir -p /opt/torch_extensions
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

# kvrelay's CPU kernels, built with torch's cpp_extension into TORCH_EXTENSIONS_DIR, which
# the final image keeps: a node with the build machine's CPU flags compiles nothing at start
# (the builds are -march=native, keyed on the flags; other CPUs build their own on first use).
FROM build AS kernels-cpu
ENV TORCH_EXTENSIONS_DIR=/opt/torch_extensions MAX_JOBS=4
COPY deploy/docker/build_cpu_kernels.py /tmp/build_cpu_kernels.py
RUN python /tmp/build_cpu_kernels.py

FROM kernels-${KERNELS} AS kernels

# The operator's image (--target operator): kopf, the Kubernetes client and Prometheus'
# client as pyproject pins them, and the package's code for its metadata (the version names
# what the operator runs); none of the package's heavy dependencies. The chart's operator
# Deployment and CRD upgrade hook run it.
FROM python:${PYTHON_VERSION}-slim-bookworm AS operator
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN groupadd --gid 1000 kvrelay \
 && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash kvrelay
WORKDIR /src
COPY pyproject.toml README.md setup.py MANIFEST.in ./
COPY deploy/docker/operator_requirements.py /tmp/operator_requirements.py
RUN python /tmp/operator_requirements.py pyproject.toml > /tmp/requirements.txt \
 && pip install -q -r /tmp/requirements.txt
COPY services ./services
COPY kernels ./kernels
COPY operators ./operators
COPY proto ./proto
RUN pip install -q --no-deps . \
 && python -m kvrelay_operator --help > /dev/null \
 && python -c "import kvrelay_operator.handlers, kvrelay_operator.crds" \
 && if python -c "import torch" 2>/dev/null; then echo "torch in the operator image" >&2; exit 1; fi \
 && rm -rf /src
USER 1000:1000
WORKDIR /home/kvrelay
# Probe 8080, metrics 9090.
EXPOSE 8080 9090
CMD ["python", "-m", "kvrelay_operator", "--help"]

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
# Writable: a node whose CPU differs from the build machine's builds its kernels here.
COPY --from=kernels --chown=1000:1000 /opt/torch_extensions /opt/torch_extensions
# rdma.privilege FileCapabilities: python (what Ray's workers exec) carries the capability;
# the pod adds it to the bounding set and allows the exec to gain it.
ARG PYTHON_FILE_CAPS=""
RUN if [ -n "$PYTHON_FILE_CAPS" ]; then \
      apt-get update -qq \
      && apt-get install -y -qq --no-install-recommends libcap2-bin \
      && setcap "$PYTHON_FILE_CAPS" "$(readlink -f /opt/kvrelay/bin/python)" \
      && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PATH=/opt/kvrelay/bin:$PATH \
    KVRELAY_CACHE_DIR=/var/cache/kvrelay \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /home/kvrelay
# Router: HTTP 8000, gRPC 50051. Operator: probe 8080, metrics 9090. Ray: GCS 6379, client
# 10001, dashboard 8265 and dashboard agent 52365 (KubeRay's probes).
EXPOSE 8000 50051 8080 9090 6379 10001 8265 52365
CMD ["kvrelay", "--help"]
