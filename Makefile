# Every target sets itself up: uv is installed if missing, the workspace synced (the C++
# extension builds on first use).
SHELL := /bin/bash
UV ?= $(shell command -v uv 2>/dev/null || echo "python3 -m uv")
PACKAGES := attn-kernels qwen3-model llm-eval

.PHONY: test bench lint format build uv

uv:
	@$(UV) --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
	@$(UV) --version

build: uv
	$(UV) sync --all-packages --frozen

# Each package's tests on their own, so a package cannot lean on another's fixtures.
test: build
	@set -e; for p in $(PACKAGES); do echo "== $$p"; $(UV) run --frozen pytest -q packages/$$p/tests; done

lint: build
	$(UV) run --frozen ruff check .
	$(UV) run --frozen ruff format --check .

format: build
	$(UV) run --frozen ruff format .
	$(UV) run --frozen ruff check --fix .

# The CPU operator benchmark (Qwen3-4B attention shapes, bf16, L=1).
bench: build
	$(UV) run --frozen --package llm-eval bench-operators --device cpu \
	  --context 128 --context 1024 --context 4096 --context 16384 --context-repeats 2
