"""mlx-lm's commands with the fused decode-attention kernel enabled.

    python -m attn_kernels.mlx_lm generate --model mlx-community/Qwen3-4B-4bit --prompt "Hello"
    python -m attn_kernels.mlx_lm chat --model mlx-community/Qwen3-4B-4bit
    python -m attn_kernels.mlx_lm server --model mlx-community/Qwen3-4B-4bit --port 8080

Everything after the command name is mlx-lm's own options, passed through unchanged (see `python
-m attn_kernels.mlx_lm generate --help`, which is mlx-lm's). Decode steps the guard accepts run
fused: llama, mistral, qwen2, qwen3, qwen3_moe, gemma3_text and phi3 models as one attention_step
per layer (norms, RoPE, cache write, attention), other models' attention calls as the
DecodeAttention op; prefill and every other call run mlx-lm's attention. On a CPU the decode
steps' linear layers run decode_linear (reading each weight once, over every core). `server` is
mlx_lm.server (its OpenAI-style API): concurrent requests are batched by mlx-lm's BatchGenerator,
and every batched decode step runs fused over its batch cache, each request at its own position.
After the command (a server: once it is stopped, Ctrl-C), one line on stderr says how many
attention calls took each path, and how many linear-layer calls ran decode_linear.
"""

from __future__ import annotations

import importlib
import sys

import attn_kernels.mlx_lm as kernel

COMMANDS = {"generate": "mlx_lm.generate", "chat": "mlx_lm.chat", "server": "mlx_lm.server"}
PROG = "python -m attn_kernels.mlx_lm"


def usage() -> str:
    return f"usage: {PROG} {{{','.join(COMMANDS)}}} [mlx-lm options]\n\n{__doc__.strip()}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(f"{PROG}: a command is needed\n\n{usage()}", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(
            f"{PROG}: unknown command {command!r}: use one of {', '.join(COMMANDS)}\n\n{usage()}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(COMMANDS[command])
    sys.argv = [f"{PROG} {command}", *rest]  # mlx-lm's parsers read sys.argv
    with kernel.enabled():
        module.main()
        counts = kernel.calls()
    print(
        f"[attn_kernels] attention calls: {counts['fused_step']} fused steps, "
        f"{counts['fused']} fused, {counts['fused_quantized']} fused over a quantized cache, "
        f"{counts['mlx_lm']} through mlx-lm's attention; {counts['linear']} linear-layer calls "
        "through decode_linear",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
