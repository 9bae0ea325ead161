# Sourced (from the repository root, after `source .gpu-kit/activate.sh`) by the scripts that
# time the CPU kernel through the CPU-only MLX wheel on the H200 host (tools/h200_cpu_only_mlx.sh,
# tools/h200_cpu16_sweep.sh; docs/cpu-kernel.md, "The 16-core host through the CPU-only MLX"):
#   1. unpack $WHL/mlx-0.32.4-cp312-*.whl and $WHL/mlx_cpu-0.32.4-*.whl into $CPU_SITE,
#   2. build attn-kernels with ATTN_KERNELS_CUDA=OFF against that MLX into $EXT_DIR (build folder
#      $BUILD_DIR; nanobind is the one the caller's Python has, i.e. the kit's; compiler output in
#      $BUILD_LOG, its tail on failure),
#   3. point PYTHONPATH at the extension, that MLX and the workspace's pure-Python packages, and
#      check that the CUDA MLX is nowhere in the process (mlx.core, libmlx, no CUDA library, the
#      default device cpu, mlx-cpu installed) and that the op matches the readable oracle.
# Everything it prints goes to stdout and $LOG; it exits on any failure (the caller has set -e).
WHL="${WHL:-.whl}"
CPU_SITE="${CPU_SITE:-/tmp/cpu-site}"
EXT_DIR="${EXT_DIR:-/tmp/ext-cpu}"
BUILD_DIR="${BUILD_DIR:-/tmp/build-ext-cpu}"
: "${OUT:?}" "${LOG:?}" "${BUILD_LOG:?}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
say() { echo "== [${SECONDS}s] $*"; }

shopt -s nullglob
wheels=("$WHL"/mlx-0.32.4-cp312-*.whl "$WHL"/mlx_cpu-0.32.4-*.whl)
shopt -u nullglob
if [ "${#wheels[@]}" -ne 2 ]; then
  echo "$(basename "$0"): need $WHL/mlx-0.32.4-cp312-*.whl and $WHL/mlx_cpu-0.32.4-*.whl" \
    "(carry .whl); found: ${wheels[*]:-none}" >&2
  exit 1
fi
# nanobind from the caller's Python (the kit's /tmp/gpu-site), linked alone into a folder of its
# own: the kit's folder also holds the CUDA MLX, which must not be on the path.
NB_PKG="$(python3 -c 'import nanobind, os; print(os.path.dirname(nanobind.__file__))')"
NB_DIR="$BUILD_DIR-nanobind"

{
  say "unpack ${wheels[*]} into $CPU_SITE"
  rm -rf "$CPU_SITE" "$EXT_DIR" "$BUILD_DIR" "$NB_DIR"
  python3 -m pip install -q --no-index --no-deps --disable-pip-version-check -t "$CPU_SITE" \
    "${wheels[@]}"
  mkdir -p "$NB_DIR" && ln -s "$NB_PKG" "$NB_DIR/nanobind"
  say "build attn-kernels (ATTN_KERNELS_CUDA=OFF) against $CPU_SITE/mlx into $EXT_DIR"
  env -u FMT_INCLUDE PYTHONPATH="$CPU_SITE:$NB_DIR" MLX_ROOT="$CPU_SITE/mlx" \
    ATTN_KERNELS_CUDA=OFF ATTN_KERNELS_METAL=OFF \
    python3 -m pip install -v --no-build-isolation --no-deps --no-index \
    --disable-pip-version-check -t "$EXT_DIR" --config-settings=build-dir="$BUILD_DIR" \
    packages/attn-kernels > "$BUILD_LOG" 2>&1 \
    || { tail -50 "$BUILD_LOG"; exit 1; }
  # What the extension was linked against, from the build's own files.
  linked="$(grep -r -h -o -E --include=build.ninja --include=link.txt '[^ ]*libmlx\.so' \
    "$BUILD_DIR" | sort -u)"
  echo "linked: $linked"
  if [ "$linked" != "$CPU_SITE/mlx/lib/libmlx.so" ]; then
    echo "FAILED: the extension links $linked, not $CPU_SITE/mlx/lib/libmlx.so" >&2
    exit 1
  fi
} 2>&1 | tee -a "$LOG"

# From here on only the CPU-only MLX, the extension and the workspace's pure-Python packages.
export PYTHONPATH="$EXT_DIR:$CPU_SITE:$PWD/packages/llm-eval/src:$PWD/packages/qwen3-model/src"
unset MLX_ROOT FMT_INCLUDE
{
  say "check the environment"
  echo "nproc $(nproc); cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none);" \
    "load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown); $(uname -r)"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|L3" || true
  python3 - "$CPU_SITE" "$EXT_DIR" <<'PY'
import os
import sys
from importlib import metadata

import mlx.core as mx
import attn_kernels
from attn_kernels import _ext, decode_attention_custom, scaled_dot_product_attention

site, ext = (os.path.realpath(p) for p in sys.argv[1:3])
real = os.path.realpath
maps = [line.split() for line in open("/proc/self/maps").read().splitlines()]
libs = sorted({real(f[5]) for f in maps if len(f) >= 6 and f[5].startswith("/")})
libmlx = [p for p in libs if "libmlx" in p]
cuda_libs = [p for p in libs if any(s in p for s in ("libcuda", "libcudart", "libnv", "nvidia"))]


def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


print("mlx.core", mx.__file__, mx.__version__)
print("attn_kernels._ext", _ext.__file__)
print("libmlx mapped:", libmlx, "CUDA libraries mapped:", cuda_libs or "none")
print("default device", mx.default_device(), "cuda", mx.cuda.is_available(),
      "metal", mx.metal.is_available())
print("packages: mlx", version("mlx"), "mlx-cpu", version("mlx-cpu"),
      "mlx-cuda-13", version("mlx-cuda-13"), "mlx-cuda-12", version("mlx-cuda-12"))
print("paths", _ext.cpu_paths(), "threads", _ext.cpu_threads())
problems = []
if not real(mx.__file__).startswith(site + "/"):
    problems.append(f"mlx.core comes from {mx.__file__}, not {site}")
if not real(_ext.__file__).startswith(ext + "/"):
    problems.append(f"attn_kernels._ext comes from {_ext.__file__}, not {ext}")
if not any(".so" in p for p in libs):
    print("(no file-backed mappings in /proc/self/maps: the library checks are skipped)")
elif libmlx != [f"{site}/mlx/lib/libmlx.so"]:
    problems.append(f"libmlx mapped from {libmlx}, expected only {site}/mlx/lib/libmlx.so")
if cuda_libs:
    problems.append(f"CUDA libraries in the process: {cuda_libs}")
if mx.cuda.is_available() or mx.default_device() != mx.cpu:
    problems.append(f"MLX has CUDA or a non-CPU default device ({mx.default_device()})")
if version("mlx-cpu") != "0.32.4" or version("mlx-cuda-13") or version("mlx-cuda-12"):
    problems.append("the installed MLX backend package is not mlx-cpu 0.32.4 alone")
# The op built here against the readable oracle, on each path, S not a multiple of 32.
k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
q = mx.random.normal((1, 32, 1, 128), key=k1).astype(mx.bfloat16)
k = mx.random.normal((1, 8, 1000, 128), key=k2).astype(mx.bfloat16)
v = mx.random.normal((1, 8, 1000, 128), key=k3).astype(mx.bfloat16)
scale = 128**-0.5
want = scaled_dot_product_attention(
    q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale=scale
)
for path in _ext.cpu_paths():
    os.environ["ATTN_KERNELS_CPU_PATH"] = path
    got = decode_attention_custom(q, k, v, scale=scale).astype(mx.float32)
    err = mx.abs(got - want).max().item()
    print(f"{path}: max |custom - oracle| = {err:.2e}")
    if not err < 2e-2:
        problems.append(f"{path}: the op differs from the oracle by {err}")
os.environ.pop("ATTN_KERNELS_CPU_PATH")
if problems:
    sys.exit("FAILED, not the CPU-only MLX setup this run is for:\n  " + "\n  ".join(problems))
print("ok: the CPU-only MLX, CPU stream, no CUDA in the process")
PY
} 2>&1 | tee -a "$LOG"
