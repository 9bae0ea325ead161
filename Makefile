# Every target sets itself up from python3 alone: uv comes from PATH when you have it, otherwise
# from a project-local tool environment in .tools/ (made once; see `make uv`). The workspace is
# synced before each target (the C++ extension builds on first use).
SHELL := /bin/bash
UV_VERSION := 0.13.9
LOCAL_UV := .tools/uv/bin/uv
UV ?= $(shell command -v uv 2>/dev/null || echo $(LOCAL_UV))
PACKAGES := attn-kernels qwen3-model llm-eval

.PHONY: test bench bench-operators lint format build uv

# uv goes into a virtual environment of its own under .tools/, never into the system Python:
# Debian and Ubuntu refuse `pip install` there (PEP 668, externally managed), and a venv needs
# no root, no network beyond PyPI and nothing on PATH. Where python3 has no venv module
# (Debian without python3-venv), pip's --target folder holds the same uv binary.
$(LOCAL_UV):
	@echo "== uv not on PATH: installing uv $(UV_VERSION) into .tools/uv (python3 -m venv)"
	@rm -rf .tools/uv
	@if python3 -m venv .tools/uv >/dev/null 2>&1; then \
	  .tools/uv/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION); \
	elif python3 -m pip --version >/dev/null 2>&1; then \
	  echo "   (no venv module: using pip --target)"; rm -rf .tools/uv; \
	  python3 -m pip install --quiet --disable-pip-version-check --target .tools/uv uv==$(UV_VERSION); \
	else \
	  echo "error: python3 has neither venv nor pip; install one (Debian/Ubuntu: apt-get install python3-venv)" >&2; \
	  exit 1; \
	fi
	@test -x $(LOCAL_UV) || { echo "error: uv install left no $(LOCAL_UV)" >&2; exit 1; }

uv: $(if $(filter $(LOCAL_UV),$(UV)),$(LOCAL_UV))
	@$(UV) --version

build: uv
	$(UV) sync --all-packages --frozen

# Each package's tests on their own, so a package cannot lean on another's fixtures.
test: build
	@set -e; for p in $(PACKAGES); do echo "== $$p"; $(UV) run --frozen pytest -q packages/$$p/tests; done

# The main job: Qwen3 decode, fused kernel against the readable composition and mlx-lm.
bench: build
	$(UV) run --frozen --package llm-eval bench $(ARGS)

# The CPU operator benchmark (Qwen3-4B attention shapes, bf16, L=1).
bench-operators: build
	$(UV) run --frozen --package llm-eval bench-operators --device cpu \
	  --context 128 --context 1024 --context 4096 --context 16384 --context-repeats 2

lint: build
	$(UV) run --frozen ruff check .
	$(UV) run --frozen ruff format --check .

format: build
	$(UV) run --frozen ruff format .
	$(UV) run --frozen ruff check --fix .
