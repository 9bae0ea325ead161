"""Time one tiny MLX CPU op per mx.eval, alone and with a busy companion process.

MLX's CPU eval hands each op to its stream thread and waits for it: two thread wake-ups per
eval. On a VM whose idle vCPUs halt, a wake-up goes through the hypervisor; keeping the other
vCPU busy shows how much of the per-eval cost is that. Usage (repository root):

    uv run --package llm-eval python tools/cpu_eval_overhead.py [--rounds 2] [--evals 300]
"""

import argparse
import multiprocessing
import time

import mlx.core as mx


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def per_eval_us(evals: int) -> list[float]:
    x = mx.ones((32, 128), dtype=mx.bfloat16, stream=mx.cpu)
    mx.eval(x)
    samples = []
    for _ in range(evals):
        t = time.perf_counter()
        mx.eval(mx.add(x, 1, stream=mx.cpu))
        samples.append((time.perf_counter() - t) * 1e6)
    return sorted(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="alone/busy pairs (default 2)")
    p.add_argument("--evals", type=int, default=300, help="evals per measurement (default 300)")
    args = p.parse_args()
    for r in range(args.rounds):
        for busy in (False, True):
            companion = None
            if busy:
                companion = multiprocessing.Process(target=spin, args=(60.0,), daemon=True)
                companion.start()
                time.sleep(0.3)
            s = per_eval_us(args.evals)
            if companion is not None:
                companion.terminate()
                companion.join()
            n = len(s)
            print(
                f"round {r} {'busy companion' if busy else 'alone         '}: "
                f"x + 1 per eval median {s[n // 2]:.1f} us (p10 {s[n // 10]:.1f}, p90 {s[9 * n // 10]:.1f})"
            )


if __name__ == "__main__":
    main()
