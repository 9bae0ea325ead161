"""Building the emulation runners (kernels-metal/emulation, kernels-cuda/emulation) for the tests."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
KERNELS_METAL = ROOT / "kernels-metal"
KERNELS_CUDA = ROOT / "kernels-cuda"
CSRC = Path(__file__).resolve().parents[1] / "csrc"


def build_runner(tmp_path_factory, source: Path, *flags: str) -> Path:
    """Compile one emulation runner with the host C++ compiler (warnings are errors), or skip."""
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path_factory.mktemp(source.parent.parent.name) / source.stem
    command = [compiler, "-std=c++20", "-O2", "-Wall", "-Werror", "-Wno-attributes"]
    command += ["-Wno-unknown-pragmas", "-pthread", *flags, str(source), "-o", str(exe)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return exe


def write_row_ranges(folder: Path, starts, ends) -> int:
    """starts.bin / ends.bin (int32) for the runners where given; returns the geometry's
    row_ranges flags (1: starts, 2: ends)."""
    flags = 0
    for bit, name, values in ((1, "starts", starts), (2, "ends", ends)):
        if values is not None:
            (folder / f"{name}.bin").write_bytes(np.asarray(values, np.int32).tobytes())
            flags |= bit
    return flags
