"""Benchmark records: metadata every record carries, validation, atomic writes."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import mlx.core as mx

SCHEMA_VERSION = 1
REQUIRED_KEYS = ("schema_version", "kind", "metadata", "config", "execution_order", "results")


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def device_info(device: str) -> dict:
    info: dict = {"mlx_device": device}
    try:
        info["mlx_device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    except Exception as e:  # not every backend reports
        info["mlx_device_info_error"] = str(e)
    if device == "gpu" and mx.cuda.is_available():
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        info["gpu"] = smi.stdout.strip() if smi.returncode == 0 else None
    else:
        info["cpu"] = _cpu_name()
        info["cpu_isa"] = _cpu_isa()
        info["cpu_count"] = os.cpu_count()
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction-set extensions that matter to these kernels and MLX's CPU backend.
_ISA_FLAGS = [
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "avx2",
    "fma",
    "f16c",
    "asimd",
    "asimdhp",
    "asimddp",
    "bf16",
    "i8mm",
    "sve",
    "sve2",
]


def _cpu_isa() -> list[str]:
    """The CPU's relevant ISA extensions from /proc/cpuinfo (x86 flags, arm64 Features)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                present = set(line.split(":", 1)[1].split())
                return [f for f in _ISA_FLAGS if f in present]
    except OSError:
        pass
    return [platform.machine()]


def collect_metadata(device: str) -> dict:
    # The caller names the commit where the checkout's own .git is absent or stale (the device
    # machine's copy of the working tree carries an old .git): LLM_EVAL_GIT_SHA wins when set.
    sha = os.environ.get("LLM_EVAL_GIT_SHA")
    dirty = os.environ.get("LLM_EVAL_GIT_DIRTY")
    if not sha:
        sha = _git("rev-parse", "HEAD")
        # Records written earlier in the same run (make bench-operators-records writes seven)
        # are not code: only changes outside benchmark_results/ make a measurement dirty.
        dirty = _git(
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ":(top)",
            ":(top,exclude)benchmark_results",
        )
    return {
        "captured_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "git_sha": sha,
        # git's porcelain output, or the caller's "1" / "0" ("0" is clean: bool("0") is True)
        "git_dirty": dirty.strip() not in ("", "0") if dirty is not None else None,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "device": device_info(device),
        "versions": {
            "python": sys.version.split()[0],
            "mlx": mx.__version__,
            "mlx_backends": _mlx_backends(),
            "mlx_lm": _version("mlx-lm"),
            "numpy": _version("numpy"),
            "attn_kernels": _version("attn-kernels"),
            "llm_eval": _version("llm-eval"),
            "compiler": _compiler_version(),
        },
    }


# The wheels that carry libmlx: one version of mlx is a CPU-only, a CUDA or a Metal build, and a
# CPU stream's eval costs differently in each (docs/cpu-kernel.md, "The 16-core host").
_MLX_BACKENDS = ("mlx-cpu", "mlx-cuda-13", "mlx-cuda-12", "mlx-metal")


def _mlx_backends() -> list[str]:
    return [f"{name} {v}" for name in _MLX_BACKENDS if (v := _version(name))]


def _compiler_version() -> str | None:
    for cc in ("c++", "g++", "clang++"):
        try:
            out = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True)
            return out.stdout.splitlines()[0]
        except (OSError, subprocess.CalledProcessError):
            continue
    return None


def validate(record: dict) -> None:
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise ValueError(f"benchmark record lacks {missing}")
    if record["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"unknown schema_version {record['schema_version']}")
    for key in ("captured_at", "git_sha", "device", "versions"):
        if key not in record["metadata"]:
            raise ValueError(f"benchmark record metadata lacks {key!r}")
    json.dumps(record, allow_nan=False)  # strict JSON: no NaN/inf


def refuse_overwrite(parser, path: Path | None, force: bool) -> None:
    """At argument time, before a long run: the same rule write_record applies at the end."""
    if path and path.exists() and not force:
        parser.error(f"{path} exists; pass --force to replace it")


def write_record(record: dict, path: str | Path, force: bool = False) -> Path:
    """Validate, then write atomically (temp file + rename); never replace without force."""
    path = Path(path)
    validate(record)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (a bandwidth: the floor's fraction divides by it)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def at_least(low: int):
    """argparse type: an integer >= low (counts and lengths: 0 is not "the default")."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    parse.__name__ = "integer"  # argparse's message for text that is not one
    return parse


def add_record_args(
    p: argparse.ArgumentParser,
    help: str = "write the record here",
    path_dest: str = "json_output",
    force_dest: str = "force",
) -> None:
    """The record's path (--output, or --json-output) and permission to replace an existing one
    (--force, or --overwrite): the same spellings in every entry point."""
    p.add_argument(
        "--output", "--json-output", type=Path, dest=path_dest, metavar="PATH", help=help
    )
    p.add_argument(
        "--force",
        "--overwrite",
        action="store_true",
        dest=force_dest,
        help="replace an existing record file",
    )
