"""Kernel-by-kernel device time of a program range, read with Nsight Compute (ncu).

The device machine has ncu but no Nsight Systems. ncu times every kernel it profiles
(gpu__time_duration) one at a time, so the sum over a range is the device's busy time without
the gaps between kernels; set beside the range's wall time, it says whether a step is made of
kernels or of waiting (take the wall time outside ncu: a process under ncu runs far slower even
outside its range). The traced program marks its range with `profiled()` (the driver's
cuProfilerStart/Stop); `run_traced` runs it under `ncu_command(...)` with --profile-from-start
off and reads its kernels.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import io
import json
import re
import shutil
import statistics
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

METRIC = "gpu__time_duration.sum"
# Microseconds per unit, as ncu names them: "ns" with --print-units base (2025.3), or spelled out.
MICROSECONDS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def ncu_path() -> str | None:
    """ncu on PATH, else the newest one under /opt/nvidia (where the device machine has it)."""
    found = shutil.which("ncu")
    if found:
        return found
    candidates = sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))
    return str(candidates[-1]) if candidates else None


def ncu_command(ncu: str, log: Path, program: list[str]) -> list[str]:
    """Profile only the marked range; leave the clocks and caches as the program had them (a
    chain of kernels runs on warm caches), one metric: each kernel's duration."""
    return [
        ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "none",
        "--metrics", METRIC, "--csv", "--print-units", "base", "--print-kernel-base", "demangled",
        "--log-file", str(log), *program,
    ]  # fmt: skip


def run_traced(ncu: str, program, what: str) -> tuple[list[dict], dict]:
    """`program(result)`, a command line whose process writes JSON to the Path `result`, run under
    ncu_command: the kernels it profiled (read_log) and the JSON. Raises, naming `what`, when the
    process fails or ncu profiled no kernel."""
    with tempfile.TemporaryDirectory() as folder:
        log, result = Path(folder, "ncu.csv"), Path(folder, "result.json")
        done = subprocess.run(ncu_command(ncu, log, program(result)))
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(f"the traced {what} failed ({done.returncode})")
        kernels = read_log(log)
        if not kernels:
            tail = log.read_text()[-600:] if log.exists() else "no log"
            raise RuntimeError(f"ncu profiled no kernel of the {what}; its log ends:\n{tail}")
        return kernels, json.loads(result.read_text())


@contextlib.contextmanager
def profiled():
    """The range ncu profiles: the driver's cuProfilerStart/Stop on the calling thread's context
    (MLX's, once it has evaluated something on the GPU)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    status = cuda.cuProfilerStart()
    if status != 0:
        raise RuntimeError(f"cuProfilerStart failed with CUresult {status}: no current context?")
    try:
        yield
    finally:
        cuda.cuProfilerStop()


def short_name(demangled: str) -> str:
    """`void mlx::core::cu::rms_norm<__nv_bfloat16, 4>(const T1 *, ...)` -> `rms_norm<...>`:
    the function's own name and its template arguments (which variant ran), no namespaces."""
    name = demangled.removeprefix("void ").strip()
    depth, end = 0, len(name)
    for i, c in enumerate(name):  # cut the parameter list: the first "(" outside <...>
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0 and not name.startswith("(anonymous", i):
            end = i
            break
    name = name[:end]
    head, bracket, args = name.partition("<")
    head = re.sub(r"^.*::", "", head)
    return (head + bracket + args)[:160]


def read_log(log: Path) -> list[dict]:
    """ncu's CSV log: one row per profiled kernel, in launch order (name, µs, grid, block)."""
    text = log.read_text()
    start = text.find('"ID"')
    if start < 0:
        return []
    kernels = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != METRIC:
            continue
        value = float(row["Metric Value"].replace(",", ""))
        scale = MICROSECONDS[row.get("Metric Unit") or "ns"]
        kernels[int(row["ID"])] = {
            "name": short_name(row["Kernel Name"]),
            "us": value * scale,
            "grid": row.get("Grid Size"),
            "block": row.get("Block Size"),
        }
    return [kernels[i] for i in sorted(kernels)]


def summarise(kernels: list[dict], steps: int) -> dict:
    """Per step: the kernels' total time and count, and by kernel name (largest first)."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        by_name[k["name"]].append(k["us"])
    names = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    per_step = len(kernels) // steps if steps else 0
    return {
        "steps": steps,
        "kernels_per_step": len(kernels) / steps,
        "kernel_ms_per_step": sum(k["us"] for k in kernels) / steps / 1e3,
        "by_name": [
            {
                "name": name,
                "calls_per_step": len(times) / steps,
                "ms_per_step": sum(times) / steps / 1e3,
                "median_us": statistics.median(times),
            }
            for name, times in names
        ],
        # the last step's kernels in launch order (the earlier steps' match it when the
        # per-step count is whole)
        "last_step": kernels[len(kernels) - per_step :] if per_step else [],
    }
