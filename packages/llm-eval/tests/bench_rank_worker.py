"""Run under mlx.launch by test_tensor_parallel_bench.py: bench's run on every rank."""

import io
import sys

from llm_eval import bench
from llm_eval.progress import Progress
from qwen3_model.distributed import rank_main


def main(group):
    args = bench.parse_args(sys.argv[1:])
    record = bench.run(args, Progress(stream=io.StringIO()))
    samples = record["results"]["samples"]
    return {
        "ranks": record["config"]["ranks"],
        "per_rank": record["results"]["per_rank"],
        "tokens": {v: [r["tokens"] for r in rows] for v, rows in samples.items()},
        "weight_bytes": record["results"]["weight_bytes"],
    }


if __name__ == "__main__":
    rank_main(main)
