"""Step time, throughput, model FLOP utilization and memory of each recipe's train step.

Each recipe's step (`StepFns.train_step`, jitted as the trainer does: no donation) is compiled once
ahead of time from the state's shapes, then run once to warm up and `--iters` times (median,
block_until_ready); one recipe after the other, `--json` rewritten after each ("complete": false
until the last), so a run cut short keeps the recipes it finished. On a CPU or Hopper the FP4/FP8
GEMMs are emulated, so the ratio to bf16 measures the quantizers' cost; on Blackwell the nvfp4
GEMM runs natively. A recipe name may end in `:xla` or `:pallas` (e.g. `nvfp4:xla`) to choose who
quantizes (`RecipeConfig.quantizer`; default "auto": the fused Pallas kernels on a GPU).

Figures per recipe (printed as a table; `--json` writes them all):
* step time (median s), tokens/s (batch x seq-len / step time), the ratio to the bf16 step;
* MFU: model FLOPs per step / step time / the peak, where model FLOPs = 6 * N * tokens (forward
  + backward of every matmul weight; N = parameters less the input embedding table, which is a
  lookup: a tied table counts once, as the LM head) + 12 * L * H * D * T * tokens (attention's
  two score/value matmuls over the full T x T matrix, forward + backward, as PaLM's appendix B
  counts them: causal masking is not subtracted). Peak: `--peak-tflops`, by default the H200's
  dense BF16 989 TFLOP/s (NVIDIA's H200 SXM datasheet). Not computed on a CPU (meaningless there);
* memory: `compiled_bytes`, what the compiled step needs (XLA's memory analysis: arguments +
  outputs + temporaries - aliased), and `peak_bytes_in_use`, the device's peak since the process
  started (`device.memory_stats()`, None on a CPU), read after the recipe ran: recipes run in the
  order given, so a recipe whose own peak is below an earlier one's shows the earlier peak
  (`peak_is_own` is False then).

`--fit`: when a compiled step needs more than the device has free (or running it exhausts device
memory), halve the batch and start over, down to 1; the batch used is reported. Listing the
smallest step first and the largest second (bf16,nvfp4,...) gives both their own peak and finds
a batch that does not fit early.

`--num-layers N` overrides the preset's depth and `--scan-layers true|false` chooses scanned
runs of alike layers or one block per layer (`scan_layers`, default true as in training); the
compile seconds of each recipe are in the table. `--compile-table 6,12,24` instead compiles the
recipes (`--recipes`, e.g. nvfp4) at each depth scanned and unrolled, one after the other, and
prints the compile seconds side by side (no step is run).

    python scripts/bench_train_step.py --model tiny --seq-len 128 --batch-size 16
    python scripts/bench_train_step.py --model small --recipes nvfp4 --compile-table 6,12,24 --json c.json
    python scripts/bench_train_step.py --model 1b --vocab-size 128256 --seq-len 4096 \\
        --batch-size 2 --remat block --recipes nvfp4 --iters 1 --fit --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nvfp4tool.corpus.batch import Batch
from nvfp4tool.model import CausalLM
from nvfp4tool.recipes.precision import RecipeConfig, precision_map
from nvfp4tool.train.presets import preset_config
from nvfp4tool.train.step import StepFns, make_optimizer

H200_DENSE_BF16_TFLOPS = 989.0  # H200 SXM, dense (no sparsity) BF16 tensor-core peak
AMAX_HISTORY = 16


class DoesNotFit(Exception):
    """The step needs more device memory than there is."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a preset: tiny, small, 100m, 1b")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=5, help="timed steps per recipe (median)")
    parser.add_argument("--recipes", default="bf16,fp8,fp8-block,nvfp4")
    parser.add_argument("--remat", default="none", choices=("none", "block", "full"))
    parser.add_argument("--num-layers", type=int, help="override the preset's number of layers")
    parser.add_argument("--scan-layers", default="true", choices=("true", "false"))
    parser.add_argument("--compile-table", help="depths (e.g. 6,12,24): compile only, scanned vs unrolled")
    parser.add_argument("--fit", action="store_true", help="halve the batch until the step fits in device memory")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=H200_DENSE_BF16_TFLOPS,
        help="the device's dense BF16 peak for MFU (default: H200, 989)",
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    batch = args.batch_size
    if args.compile_table:
        compile_table(args, recipes, [int(n) for n in args.compile_table.split(",")])
        return
    while True:
        results = []
        try:
            for name in recipes:  # one compile + run at a time: a timeout keeps the rows done
                results.append(run_step(compile_step(name, args, batch), args))
                write_json(args, batch, results, complete=len(results) == len(recipes))
            break
        except DoesNotFit as error:
            if not args.fit or batch == 1:
                raise SystemExit(f"batch {batch}: {error}") from None
            print(f"batch {batch} does not fit ({error}); trying {batch // 2}", flush=True)
            batch //= 2
    print_table(args, batch, results)


def compile_table(args, recipes: list[str], depths: list[int]) -> None:
    """Compile seconds of each recipe's step at each depth, scanned and unrolled (alternating)."""
    rows = []
    for depth in depths:
        for name in recipes:
            row = {"recipe": name, "num_layers": depth}
            for scan in ("false", "true"):
                step = compile_step(
                    name,
                    argparse.Namespace(**{**vars(args), "num_layers": depth, "scan_layers": scan}),
                    args.batch_size,
                )
                row["unrolled_s" if scan == "false" else "scanned_s"] = step["compile_s"]
                del step
            rows.append(row)
            if args.json:
                Path(args.json).write_text(
                    json.dumps(
                        {
                            "args": vars(args),
                            "backend": jax.default_backend(),
                            "jax": jax.__version__,
                            "rows": rows,
                            "complete": len(rows) == len(depths) * len(recipes),
                        },
                        indent=1,
                    )
                )
    print(
        f"device: {jax.devices()[0].device_kind}; model {args.model}; batch {args.batch_size} x seq "
        f"{args.seq_len}; compile seconds of the train step"
    )
    print("| recipe | layers | unrolled (s) | scanned (s) | scanned / unrolled |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['recipe']} | {r['num_layers']} | {r['unrolled_s']:.1f} | {r['scanned_s']:.1f} "
            f"| {r['scanned_s'] / r['unrolled_s']:.2f} |"
        )


def compile_step(name: str, args, batch: int) -> dict:
    """One recipe's step compiled ahead of time from the state's shapes at `batch`, with what
    running it needs; DoesNotFit when it needs more than the device has free."""
    model_config = preset_config(args.model, args.vocab_size, max(args.seq_len, 2048))
    if args.num_layers:
        model_config = dataclasses.replace(model_config, num_layers=args.num_layers)
    recipe_name, _, quantizer = name.partition(":")
    recipe = RecipeConfig(name=recipe_name, quantizer=quantizer or "auto")
    abstract = nnx.eval_shape(lambda: _model(model_config, args, nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract)
    optimizer = make_optimizer(lambda step: 1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, clip_norm=1.0)
    fns = StepFns(graphdef, recipe, precision_map(recipe, model_config), optimizer, grad_accum=1)
    state_shapes = jax.eval_shape(lambda p: fns.init_state(p, AMAX_HISTORY), abstract_params.to_pure_dict())
    rng = np.random.default_rng(0)
    windows = Batch(jnp.asarray(rng.integers(0, args.vocab_size, (1, batch, args.seq_len + 1)), jnp.int32))
    keys = [jax.random.fold_in(jax.random.key(0), i) for i in range(args.iters + 1)]
    start = time.perf_counter()
    compiled = jax.jit(fns.train_step).lower(state_shapes, windows, keys[0]).compile()
    compile_s = time.perf_counter() - start
    compiled_bytes = _compiled_bytes(compiled)
    stats = jax.devices()[0].memory_stats()
    if stats and compiled_bytes is not None:
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        if compiled_bytes > free:
            raise DoesNotFit(f"{name} needs {compiled_bytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
    print(
        f"{name}: compiled in {compile_s:.1f} s"
        + ("" if compiled_bytes is None else f", needs {compiled_bytes / 1e9:.2f} GB"),
        flush=True,
    )
    return {
        "recipe": name,
        "fns": fns,
        "model_config": model_config,
        "compiled": compiled,
        "windows": windows,
        "keys": keys,
        "batch_size": batch,
        "compile_s": compile_s,
        "compiled_bytes": compiled_bytes,
        "abstract_params": abstract_params,
    }


def run_step(step: dict, args) -> dict:
    """Warm up and time a compiled step (`compile_step`) on freshly initialized parameters; its
    figures as a dict."""
    name, model_config = step["recipe"], step["model_config"]
    device = jax.devices()[0]
    stats = device.memory_stats()
    peak_before = stats.get("peak_bytes_in_use") if stats else None
    params = nnx.split(_model(model_config, args, nnx.Rngs(0)))[1].to_pure_dict()
    state = step["fns"].init_state(params, AMAX_HISTORY)
    del params
    try:
        times = _time_steps(step["compiled"], state, step["windows"], step["keys"])
    except Exception as error:
        if "RESOURCE_EXHAUSTED" in str(error):
            raise DoesNotFit(f"{name}: {str(error).splitlines()[0][:200]}") from None
        raise
    stats = device.memory_stats()
    peak = stats.get("peak_bytes_in_use") if stats else None
    seconds = statistics.median(times)
    batch = step["batch_size"]
    tokens = batch * args.seq_len
    flops = model_flops(model_config, step["abstract_params"], tokens, args.seq_len)
    on_cpu = jax.default_backend() == "cpu"
    print(f"{name}: {1e3 * seconds:.1f} ms per step", flush=True)
    return {
        "recipe": name,
        "batch_size": batch,
        "seq_len": args.seq_len,
        "tokens_per_step": tokens,
        "step_time_s": seconds,
        "step_times_s": times,
        "tokens_per_s": tokens / seconds,
        "model_flops_per_step": flops,
        "mfu": None if on_cpu else flops / seconds / (args.peak_tflops * 1e12),
        "compile_s": step["compile_s"],
        "compiled_bytes": step["compiled_bytes"],
        "peak_bytes_in_use": peak,
        "peak_is_own": None if peak is None else peak > (peak_before or 0),
    }


def model_flops(config, abstract_params, tokens: int, seq_len: int) -> float:
    """6 * N * tokens + 12 * L * H * D * T * tokens (see the module docstring)."""
    n_params = sum(leaf.size for leaf in jax.tree.leaves(abstract_params))
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * seq_len
    return float((6 * (n_params - embedding) + attention) * tokens)


def write_json(args, batch: int, results: list[dict], *, complete: bool) -> None:
    """Set each row's ratio to the bf16 step; write the JSON (`complete`: every recipe ran)."""
    base = next((r["step_time_s"] for r in results if r["recipe"] == "bf16"), None)
    for row in results:
        row["x_bf16"] = None if base is None else row["step_time_s"] / base
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "backend": jax.default_backend(),
                    "device": jax.devices()[0].device_kind,
                    "jax": jax.__version__,
                    "batch_size": batch,
                    "peak_tflops": args.peak_tflops,
                    "complete": complete,
                    "step_time_s": {r["recipe"]: r["step_time_s"] for r in results},
                    "results": results,
                },
                indent=1,
            )
        )


def print_table(args, batch: int, results: list[dict]) -> None:
    print(
        f"device: {jax.devices()[0].device_kind}; model {args.model}, remat {args.remat}, scan_layers "
        f"{args.scan_layers}; batch "
        f"{batch} x seq {args.seq_len} = {batch * args.seq_len} tokens/step; MFU vs "
        f"{args.peak_tflops:g} TFLOP/s"
    )
    print("| recipe | compile (s) | step time (ms) | tokens/s | MFU | peak GB | x bf16 step time |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        peak = (
            "-"
            if r["peak_bytes_in_use"] is None
            else (f"{'' if r['peak_is_own'] else '<='}{r['peak_bytes_in_use'] / 1e9:.1f}")
        )
        ratio = "-" if r["x_bf16"] is None else f"{r['x_bf16']:.2f}"
        print(
            f"| {r['recipe']} | {r['compile_s']:.1f} | {1e3 * r['step_time_s']:.1f} | {r['tokens_per_s']:,.0f} | {mfu} "
            f"| {peak} | {ratio} |"
        )


def _model(config, args, rngs: nnx.Rngs) -> CausalLM:
    return CausalLM(
        config,
        param_dtype=jnp.float32,
        compute_dtype=jnp.bfloat16,
        remat=args.remat,
        scan_layers=args.scan_layers == "true",
        rngs=rngs,
    )


def _compiled_bytes(compiled) -> int | None:
    """Arguments + outputs + temporaries - aliased bytes of a compiled step (None: unknown)."""
    try:
        m = compiled.memory_analysis()
    except Exception:
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def _time_steps(compiled, state, windows, keys) -> list[float]:
    """One warm-up step, then one timed step per remaining key."""
    state, metrics = compiled(state, windows, keys[0])
    jax.block_until_ready((state, metrics))
    times = []
    for key in keys[1:]:
        start = time.perf_counter()
        state, metrics = compiled(state, windows, key)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    main()
