# The one image every kvrelay pod runs: the operator, the router, and the Ray head and
# workers of a KVRelayService (KubeRay starts `ray start` in it).
#
#   docker build -t kvrelay:0.1.0 .
#
# torch is pinned (torch==2.13.0) by pyproject.toml; the default index gives the CUDA
# build for GPU nodes. For a CPU-only image point pip at a CPU wheel index:
#   docker build --build-arg PIP_EXTRA_INDEX_URL=<cpu wheel index> -t kvrelay:cpu .

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}
# A compiler for the few packages without wheels; it stays in this stage.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/kvrelay
ENV PATH=/opt/kvrelay/bin:$PATH
WORKDIR /src
# Dependencies first, so a code change does not reinstall torch and Ray.
COPY pyproject.toml README.md ./
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > /tmp/requirements.txt
RUN pip install -q -r /tmp/requirements.txt
COPY services ./services
COPY kernels ./kernels
COPY operators ./operators
COPY proto ./proto
RUN pip install -q --no-deps . && kvrelay --version

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
COPY --from=build /opt/kvrelay /opt/kvrelay
ENV PATH=/opt/kvrelay/bin:$PATH \
    KVRELAY_CACHE_DIR=/var/cache/kvrelay \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /home/kvrelay
EXPOSE 8000 50051
CMD ["kvrelay", "--help"]
