"""Step time of the fp8 and nvfp4 recipes relative to bf16 on the same model and batch.

Compiles each recipe's train step once, then times `--iters` steps (median, block_until_ready).
On a CPU or Hopper the FP4/FP8 GEMMs are emulated, so the ratio measures the quantizers' cost;
on Blackwell the nvfp4 GEMM runs natively.

    python scripts/bench_train_step.py --model tiny --seq-len 128 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nvfp4tool.model import CausalLM  # noqa: E402
from nvfp4tool.recipes.precision import RecipeConfig, precision_map  # noqa: E402
from nvfp4tool.train.presets import preset_config  # noqa: E402
from nvfp4tool.train.step import StepFns, make_optimizer  # noqa: E402


def time_recipe(name: str, model_config, windows, iters: int) -> float:
    recipe = RecipeConfig(name=name)
    model = CausalLM(model_config, param_dtype=jnp.float32, compute_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(lambda step: 1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                               clip_norm=1.0)
    fns = StepFns(graphdef, recipe, precision_map(recipe, model_config), optimizer, grad_accum=1)
    state = fns.init_state(params.to_pure_dict(), 16)
    step = jax.jit(fns.train_step)
    key = jax.random.key(0)
    state, metrics = step(state, windows, key)  # compile
    jax.block_until_ready(metrics)
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        state, metrics = step(state, windows, jax.random.fold_in(key, i))
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--recipes", default="bf16,fp8,fp8-block,nvfp4")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    model_config = preset_config(args.model, args.vocab_size, max(args.seq_len, 2048))
    rng = np.random.default_rng(0)
    windows = jnp.asarray(rng.integers(0, args.vocab_size, (1, args.batch_size, args.seq_len + 1)), jnp.int32)
    results = {name: time_recipe(name, model_config, windows, args.iters) for name in args.recipes.split(",")}
    base = results.get("bf16", next(iter(results.values())))
    tokens = args.batch_size * args.seq_len
    print(f"device: {jax.devices()[0].device_kind}; model {args.model}; {tokens} tokens/step")
    print("| recipe | step time (ms) | tokens/s | x bf16 step time |")
    print("|---|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {1e3 * seconds:.1f} | {tokens / seconds:,.0f} | {seconds / base:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": jax.devices()[0].device_kind,
                                               "step_time_s": results}, indent=1))


if __name__ == "__main__":
    main()
