"""Running a program on several ranks with `mlx.launch`, with every rank's outcome checked.

mlx.launch exits 0 even when a rank fails, so each rank reports through `rank_main`: it writes
rank{r}.json (its result, or its error) into the folder named by $QWEN3_RANK_DIR, and `launch`
reads one file per rank and raises an error naming the ranks that failed, or never reported.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

RANK_DIR = "QWEN3_RANK_DIR"


class LaunchError(RuntimeError):
    """A distributed run in which some rank failed, never reported, or ran out of time."""


def rank_main(main: Callable[[mx.distributed.Group], dict]) -> dict:
    """Run main(group) on this rank and report its result (or error) for `launch` to check."""
    group = mx.distributed.init()
    folder = os.environ.get(RANK_DIR)
    try:
        result = {"ok": True, "result": main(group)}
    except BaseException as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        if folder is None:
            raise
    result.update(rank=group.rank(), size=group.size())
    if folder is not None:
        Path(folder, f"rank{group.rank()}.json").write_text(json.dumps(result))
    return result


def _free_port_run(count: int) -> int:
    """A base port with `count` consecutive free ports after it (the ring takes one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise LaunchError("no run of free local ports for the ring backend")


def launch(
    command: list[str], *, n: int = 2, backend: str = "ring", timeout: float = 300.0
) -> list[dict]:
    """Run `python command...` on n local ranks; return each rank's result, rank 0 first.

    Raises LaunchError naming every rank that failed (its error), reported nothing (crashed or was
    killed), or did not finish within `timeout` seconds, with the tail of the ranks' output.
    """
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
    if not Path(launcher).exists():
        raise LaunchError("mlx.launch not found next to this Python (is mlx installed?)")
    with tempfile.TemporaryDirectory(prefix="qwen3-ranks-") as folder:
        argv = [launcher, "--backend", backend, "-n", str(n), "--python", sys.executable]
        argv += ["--env", f"{RANK_DIR}={folder}"]
        if backend == "ring":
            argv += ["--starting-port", str(_free_port_run(n))]
        try:
            done = subprocess.run(
                argv + command, capture_output=True, text=True, timeout=timeout, check=False
            )
            output = done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode(errors="replace") if e.stdout else ""
            raise LaunchError(
                f"{n} ranks did not finish within {timeout:.0f} s (a rank waiting on a peer that "
                f"died?); output tail:\n{output[-2000:]}"
            ) from None
        results, problems = [], []
        for rank in range(n):
            f = Path(folder, f"rank{rank}.json")
            if not f.exists():
                problems.append(f"rank {rank} reported nothing (crashed or killed before the end)")
                continue
            r = json.loads(f.read_text())
            if not r["ok"]:
                problems.append(f"rank {rank} failed: {r['error']}")
            results.append(r)
        if problems:
            raise LaunchError(
                "; ".join(problems)
                + f"\nmlx.launch exit code {done.returncode}; output tail:\n"
                + output[-2000:]
            )
        return [r["result"] for r in results]
