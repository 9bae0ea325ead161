"""Run under mlx.launch by test_tensor_parallel.py: the same seeded model unsharded and sharded."""

import sys

import mlx.core as mx
import mlx.nn as nn
from qwen3_model import Model, ModelArgs, make_cache
from qwen3_model.distributed import rank_main

# Heads and hidden units divisible by 2 ranks; a rank's o_proj/down_proj input slice (128, 256)
# keeps whole 4-bit groups of 64.
ARGS = ModelArgs(256, 2, 512, 4, 2, 64, 1000)


def greedy(model, prompt, steps):
    cache = make_cache(model)
    logits = [model(prompt, cache)[:, -1]]
    tokens = []
    for _ in range(steps):
        token = mx.argmax(logits[-1], axis=-1)
        tokens.append(token.item())
        logits.append(model(token[None], cache)[:, -1])
    return tokens, mx.stack(logits).astype(mx.float32)


def main(group):
    variant, fail_rank = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else -1
    if group.rank() == fail_rank:
        raise RuntimeError("failing on purpose (launcher test)")
    mx.random.seed(11)
    model = Model(ARGS, "decode-attention")
    model.set_dtype(mx.float32 if variant.endswith("float32") else mx.bfloat16)
    if variant.startswith("4bit"):
        nn.quantize(model, group_size=64, bits=4)
        model.quantization = {"group_size": 64, "bits": 4}
    mx.eval(model.parameters())
    prompt = mx.random.randint(10, 990, (1, 37), key=mx.random.key(5))
    full_prefill = model(prompt).astype(mx.float32)
    full_tokens, full_logits = greedy(model, prompt, 12)
    model.shard(group)
    sharded_prefill = model(prompt).astype(mx.float32)
    sharded_tokens, sharded_logits = greedy(model, prompt, 12)
    heads = model.layers[0].self_attn.n_heads, model.layers[0].self_attn.n_kv_heads
    return {
        "full_tokens": full_tokens,
        "sharded_tokens": sharded_tokens,
        "max_logit_diff": mx.abs(full_logits - sharded_logits).max().item(),
        # Every prompt position's prediction: varied tokens, where greedy decode of a random
        # model soon repeats one.
        "full_prefill_argmax": mx.argmax(full_prefill, axis=-1).tolist(),
        "sharded_prefill_argmax": mx.argmax(sharded_prefill, axis=-1).tolist(),
        "max_prefill_diff": mx.abs(full_prefill - sharded_prefill).max().item(),
        "logit_scale": mx.abs(full_logits).max().item(),
        "rank_heads": heads,
    }


if __name__ == "__main__":
    rank_main(main)
