# The two commands a newcomer runs: `make serve` and `make test`.
# Both create .venv idempotently; the package is reinstalled only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup model serve test lint typecheck pytest bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Fetch and convert the embedded default model once (a no-op when it is cached).
model: setup
	$(VENV)/bin/kvrelay model pull-default

serve: model
	$(VENV)/bin/kvrelay chat

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

pytest: model
	$(VENV)/bin/pytest -q

test: lint typecheck pytest

bench: model
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info

# Regenerate the committed protobuf / gRPC Python code (tests/transfer checks it is current).
.PHONY: proto
proto: setup
	$(PY) -m grpc_tools.protoc -I proto --python_out=services --grpc_python_out=services \
		--pyi_out=services proto/kvrelay/v1/kv_transfer.proto
