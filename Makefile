# The two commands a newcomer runs: `make serve` and `make test`.
# Both create .venv idempotently; the package is reinstalled only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup model serve test checks lint typecheck kernels-check cpu-kernels pytest prometheus bench clean

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvrelay needs Python 3.11 or newer; $(PYTHON) is " + sys.version.split()[0] + ": run make PYTHON=python3.11 (or newer)")'
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Fetch and convert the embedded default model once (a no-op when it is cached).
model: setup
	$(VENV)/bin/kvrelay model pull-default

# The whole platform on this machine: Ray, 1 prefill + 1 decode worker, router, HTTP + gRPC.
serve: model
	$(VENV)/bin/kvrelay serve

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

# The suite on TEST_WORKERS processes (pytest-xdist), each test file whole in one of them (its
# module fixtures start once). Every worker starts its own Ray cluster and servers: about 3 GB
# of memory each. TEST_WORKERS=0 runs it in this process. Then, by themselves, the tests
# marked `alone`: their wall-time bounds (a killed worker replaced within 30 s, /health within
# 1 s under fuzzing) measure kvrelay, not a second worker's load on two cores.
TEST_WORKERS ?= 2
define RUN_SUITE
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone"
	$(VENV)/bin/pytest -q -m alone
endef
pytest: model prometheus cpu-kernels
	$(RUN_SUITE)

# Debian's Prometheus server, for the dashboards' end-to-end test (it starts its own instance
# on a free loopback port; a system service, if the package starts one, is never used).
prometheus:
	command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)

# Compile every CUDA kernel with nvcc for sm_80 and sm_90 (no GPU needed); fails on any error
# or register spill and prints the registers / shared memory table. Without nvcc on the PATH it
# pip-installs NVIDIA's CUDA 13.0 compiler wheels once into ~/.cache/kvrelay/cuda-toolchain
# ($$KVRELAY_CUDA_TOOLCHAIN to move it) and compiles with those. Then the torch binding is
# compiled (syntax and types) against this torch's headers, and every Triton kernel is compiled
# ahead of time for sm_80 / sm_90 at the engine's constants, so API drift shows before a GPU.
kernels-check: | $(PY)
	$(PY) kernels/csrc/check_kernels.py --jobs 2
	$(PY) kernels/csrc/check_binding.py
	$(PY) kernels/csrc/check_triton.py

# The checks side by side (mypy is one process, the compilers wait on each other), then the
# suite: on the 2-core CI machine this saves minutes of its 45.
test: checks
	$(RUN_SUITE)

checks: setup
	$(MAKE) --no-print-directory -j2 lint typecheck kernels-check cpu-kernels model prometheus

# kvrelay's CPU C++ kernels, built before the suite (two at a time) rather than inside the
# first test or server start that loads each (~30-60 s a build on a 2-core machine).
cpu-kernels: setup
	$(PY) deploy/docker/build_cpu_kernels.py --jobs 2

bench: model
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info

# Regenerate the committed protobuf / gRPC Python code (tests/transfer checks it is current).
# The generator is grpcio-tools at pyproject's grpcio floor, never a newer one: its *_pb2_grpc.py
# refuse a grpcio older than the tools, and its *_pb2.py a protobuf older than its protoc (5.27.2
# for 1.66.0), so the generator's version is the oldest grpc a deployment's image may bring. It
# lives in its own venv under ~/.cache/kvrelay, since its protobuf 5 pin must not replace the
# project's newer protobuf (tests/transfer/pinned_venv.py builds the same folder). Raise it
# only with pyproject's grpc / protobuf floors and the README's line: tests/transfer checks.
GRPC_TOOLS_VERSION := 1.66.0
GRPC_TOOLS := $(HOME)/.cache/kvrelay/grpc-tools-$(GRPC_TOOLS_VERSION)

$(GRPC_TOOLS)/.installed:
	rm -rf $(GRPC_TOOLS)
	$(PYTHON) -m venv $(GRPC_TOOLS)
	$(GRPC_TOOLS)/bin/python -m pip install -q --only-binary=:all: grpcio-tools==$(GRPC_TOOLS_VERSION)
	touch $@

.PHONY: proto
proto: $(GRPC_TOOLS)/.installed
	$(GRPC_TOOLS)/bin/python -m grpc_tools.protoc -I proto --python_out=services \
		--grpc_python_out=services --pyi_out=services \
		proto/kvrelay/v1/kv_transfer.proto proto/kvrelay/v1/generation.proto
