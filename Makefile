# Every target sets itself up from python3 alone: uv comes from PATH when you have it, otherwise
# from a project-local tool environment in .tools/ (made once; see `make uv`). The workspace is
# synced before each target (the C++ extension builds on first use).
SHELL := /bin/bash
UV_VERSION := 0.13.9
LOCAL_UV := .tools/uv/bin/uv
UV ?= $(shell command -v uv 2>/dev/null || echo $(LOCAL_UV))
PACKAGES := attn-kernels qwen3-model llm-eval
# uv trusts the system's certificate store (as pip and curl do), not only its bundled roots: a
# network that inspects TLS with its own CA (a company's, or this build machine's) then works.
export UV_SYSTEM_CERTS ?= 1

.PHONY: test test-grids test-full check-evidence test-cpu-kernel test-arm64 bench bench-operators \
  bench-operators-records bench-cpu-kernel ab-cpu-kernel bench-linear-kernel lint format build uv

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

# Two tiers (docs/contributing.md). `make test`: every behaviour once (each dtype, backend path
# and bad input, the oracle comparisons on ragged shapes), a few minutes. `make test-full` adds
# the grids (tests marked `full`: the same checks over every shape, schedule and split) and the
# CPU kernels' own checks. Each package's tests run on their own, so a package cannot lean on
# another's fixtures.
# TEST_WORKERS: pytest-xdist processes, one test file each at a time (a file's emulators and
# subprocess servers stay in one process); `TEST_WORKERS=0` runs in this process.
TEST_WORKERS ?= auto
PYTEST = $(UV) run --frozen pytest -q -n $(TEST_WORKERS) --dist loadfile

test: build check-evidence
	@set -e; for p in $(PACKAGES); do echo "== $$p"; $(PYTEST) -m "not full" packages/$$p/tests; done

# pytest's status 5 (no test selected): a package without grids.
test-grids: build
	@set -e; for p in $(PACKAGES); do echo "== $$p (grids)"; \
	  $(PYTEST) -m full packages/$$p/tests || [ $$? -eq 5 ]; done

test-full: test test-grids test-cpu-kernel

# Every record and raw log a doc cites exists, and every one there is cited.
check-evidence:
	@python3 tools/check_evidence.py

# The CPU kernels alone (no MLX, no Python) against a float64 reference, every path this CPU
# runs: attention (cpu_kernel_check) and linear layers (cpu_linear_check), the kernel files
# compiled as CMakeLists.txt compiles them (each path with its target flags).
CPU_SRC := packages/attn-kernels/csrc
CPU_TESTS := packages/attn-kernels/tests
CPU_CHECKS := cpu_kernel_check cpu_linear_check
CPU_FLAGS := -O2 -std=gnu++20 -Wall -Wextra -Wno-unused-parameter -Wno-psabi -ffp-contract=fast \
  -I $(CPU_SRC) -pthread
FLAGS_avx512 := -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c
FLAGS_avx2 := -mavx2 -mfma -mf16c
ifeq ($(shell uname -m),x86_64)
HOST_PATHS := avx512 avx2 portable
else ifeq ($(shell uname -m),aarch64)
HOST_PATHS := neon
else
HOST_PATHS := portable
endif
CPU_BUILD := build/cpu-kernel

$(CPU_BUILD)/host/%.o: $(CPU_SRC)/%.cpp $(wildcard $(CPU_SRC)/*.h)
	@mkdir -p $(@D)
	$(CXX) $(CPU_FLAGS) -O3 $(FLAGS_$(patsubst cpu_kernel_%,%,$*)) -c $< -o $@

CPU_HOST_OBJECTS := $(CPU_BUILD)/host/decode_attention_cpu.o $(CPU_BUILD)/host/linear_cpu.o \
  $(foreach p,$(HOST_PATHS),$(CPU_BUILD)/host/cpu_kernel_$(p).o)

$(CPU_BUILD)/host/%_check: $(CPU_TESTS)/%_check.cpp $(CPU_TESTS)/cpu_check.h $(CPU_HOST_OBJECTS)
	$(CXX) $(CPU_FLAGS) -I $(CPU_TESTS) $< $(CPU_HOST_OBJECTS) -o $@

test-cpu-kernel: $(foreach c,$(CPU_CHECKS),$(CPU_BUILD)/host/$(c))
	@set -e; for c in $^; do $$c; done

# Kernel-only timing of every path here, interleaved (packages/attn-kernels/dev/bench_cpu.cpp).
$(CPU_BUILD)/host/bench_cpu: packages/attn-kernels/dev/bench_cpu.cpp $(CPU_HOST_OBJECTS)
	$(CXX) $(CPU_FLAGS) -O3 -I packages/attn-kernels/dev $^ -o $@

bench-cpu-kernel: $(CPU_BUILD)/host/bench_cpu
	$< $(ARGS)

# In-process A/B of the CPU attention kernel (packages/attn-kernels/dev/ab_cpu.cpp): this tree's
# against the one at BASE (a git revision; default HEAD), whose sources are compiled with their
# namespace renamed. ARGS: ab_cpu's (--hot, shapes HQ/HKV/D/DTYPE/S[/L]). For example
#   make ab-cpu-kernel BASE=HEAD~1 ARGS="32/32/128/f32/16384 32/8/128/bf16/4096"
AB_BUILD := $(CPU_BUILD)/ab
ab-cpu-kernel: $(CPU_HOST_OBJECTS)
	@rm -rf $(AB_BUILD) && mkdir -p $(AB_BUILD)/base
	git archive $(or $(BASE),HEAD) $(CPU_SRC) | tar -x -C $(AB_BUILD)/base
	$(foreach f,$(notdir $(basename $(CPU_HOST_OBJECTS))),$(CXX) $(CPU_FLAGS) -O3 \
	  $(FLAGS_$(patsubst cpu_kernel_%,%,$(f))) -Dattn_kernels=attn_old -I $(AB_BUILD)/base/$(CPU_SRC) \
	  -c $(AB_BUILD)/base/$(CPU_SRC)/$(f).cpp -o $(AB_BUILD)/$(f).o &&) true
	$(CXX) $(CPU_FLAGS) -O3 -I packages/attn-kernels/dev packages/attn-kernels/dev/ab_cpu.cpp \
	  $(CPU_HOST_OBJECTS) $(AB_BUILD)/*.o -o $(AB_BUILD)/ab_cpu
	$(AB_BUILD)/ab_cpu $(ARGS)

# Kernel-only timing of the CPU linear kernel (packages/attn-kernels/dev/bench_linear.cpp).
$(CPU_BUILD)/host/bench_linear: packages/attn-kernels/dev/bench_linear.cpp $(CPU_HOST_OBJECTS)
	$(CXX) $(CPU_FLAGS) -O3 $^ -o $@

bench-linear-kernel: $(CPU_BUILD)/host/bench_linear
	$< $(ARGS)

# arm64: the NEON path cross-compiled (Debian: g++-aarch64-linux-gnu) and run under qemu-user,
# the same check as test-cpu-kernel.
ARM64_CXX ?= aarch64-linux-gnu-g++
QEMU_ARM64 ?= $(shell command -v qemu-aarch64-static 2>/dev/null || echo qemu-aarch64)

ARM64_SOURCES := $(CPU_SRC)/decode_attention_cpu.cpp $(CPU_SRC)/linear_cpu.cpp \
  $(CPU_SRC)/cpu_kernel_neon.cpp

$(CPU_BUILD)/arm64/%_check: $(CPU_TESTS)/%_check.cpp $(CPU_TESTS)/cpu_check.h $(ARM64_SOURCES) \
    $(wildcard $(CPU_SRC)/*.h)
	@mkdir -p $(@D)
	@command -v $(ARM64_CXX) >/dev/null || { echo "error: no $(ARM64_CXX) (Debian/Ubuntu:" \
	  "apt-get install g++-aarch64-linux-gnu qemu-user)" >&2; exit 1; }
	$(ARM64_CXX) $(CPU_FLAGS) -I $(CPU_TESTS) -march=armv8-a+simd -static $< $(ARM64_SOURCES) -o $@

test-arm64: $(foreach c,$(CPU_CHECKS),$(CPU_BUILD)/arm64/$(c))
	@command -v $(QEMU_ARM64) >/dev/null || { echo "error: no $(QEMU_ARM64) (Debian/Ubuntu:" \
	  "apt-get install qemu-user)" >&2; exit 1; }
	@set -e; for c in $^; do $(QEMU_ARM64) $$c --seeds 1; done

# The main job: Qwen3 decode, fused kernel against the readable composition and mlx-lm.
bench: build
	$(UV) run --frozen --package llm-eval bench $(ARGS)

# The CPU operator benchmark (Qwen3-4B attention shapes, bf16, L=1).
bench-operators: build
	$(UV) run --frozen --package llm-eval bench-operators --device cpu \
	  --context 128 --context 1024 --context 4096 --context 16384 --context-repeats 2

# This CPU's operator records and their charts (docs/results-cpu.md; ~10 minutes on 2 cores).
# RECORDS names their folder and prefix.
RECORDS ?= benchmark_results/cpu-2core-qwen3-4b-attention
OPS = $(UV) run --frozen --package llm-eval bench-operators --device cpu --force
bench-operators-records: build
	$(OPS) --context 32 --context 128 --context 256 --context 1024 --context 4096 \
	  --context 16384 --context-repeats 4 --json-output $(RECORDS)-L1-mlx-0.32.4.json
	$(OPS) --context 256 --context 1024 --context 4096 --context 16384 --calls-per-eval 8 \
	  --context-repeats 2 --json-output $(RECORDS)-L1-8-calls-per-eval-mlx-0.32.4.json
	$(OPS) --query-length 2 --query-length 4 --query-length 8 --attention-mask causal \
	  --context 32 --context 128 --context 256 --context 1024 --context 4096 --context 16384 \
	  --context-repeats 2 --json-output $(RECORDS)-L2-L8-causal-mlx-0.32.4.json
	$(OPS) --context 32 --context 128 --context 160 --context 192 --context 256 \
	  --context-repeats 6 --json-output $(RECORDS)-context-sweep-mlx-0.32.4.json
	$(OPS) --context 128 --query-length 1 --query-length 2 --query-length 4 --query-length 8 \
	  --attention-mask causal --context-repeats 6 --json-output $(RECORDS)-query-sweep-mlx-0.32.4.json
	$(OPS) --gqa-ratio 1 --context 128 --context 1024 --context-repeats 2 \
	  --json-output $(RECORDS)-gqa1-mlx-0.32.4.json
	$(OPS) --attention-mask explicit --context 128 --context 1024 --context-repeats 2 \
	  --json-output $(RECORDS)-explicit-mask-mlx-0.32.4.json
	$(UV) run --frozen --package llm-eval plot $(RECORDS)-*.json

lint: build
	$(UV) run --frozen ruff check .
	$(UV) run --frozen ruff format --check .

format: build
	$(UV) run --frozen ruff format .
	$(UV) run --frozen ruff check --fix .
