"""Peak memory and wall time of calibration and validate, the model held whole or streamed layer by
layer, on a synthetic BF16 Llama-shaped model exported NVFP4 (W4A4) beforehand.

    python scripts/bench_validate.py --hidden 2048 --mlp 5632 --layers 8 --vocab 32000 \
        [--samples 4 --seq-len 64 --gen-tokens 4] [--reference fp8|prebuilt] [--workdir DIR]

Made outside any measurement (by child processes): the BF16 source, token ids (.npy), its NVFP4
W4A4 export (calibrated on the ids) and, for `--reference prebuilt`, its FP8 export. Then each kind
runs in its own child process (peak RSS = VmHWM of that child):
* calibrate-<mode>: `calibrate(..., offload=<mode>)` of every quantized linear;
* validate-<mode>:  `validate_export(..., ValidateOptions(reference=..., offload=<mode>))`: with
                    `--reference fp8` the FP8 reference is exported on the fly (which calibrates
                    too), with `prebuilt` it is the FP8 folder made beforehand;
for <mode> "never" (held) and "always" (streamed). The child first runs the same on a warm-up
model, the `--warmup-preset` (default tiny) at the measured model's depth and vocabulary (its peak
is the fixed overhead: imports, XLA compilation and the compiled programs, thread pools); a validate
child then runs it once more, its programs compiled, and reports that run's peak above the resident
set before it (VmHWM reset by /proc/self/clear_refs) beside validate's estimate of it (the largest
`validate.footprint` of the models it ran, held or streamed). The child drops its compiled programs
(the big run compiles its own at its shapes), then runs the big one. Each child reports its peak
and overhead, wall time, the sizes bounds are made of (the source's stored size, its largest decoder
layer, embeddings + final norm + LM head, the activations of the windows) and its numbers (the
amax, or validation.json's models / layer SQNR / resources), so that both modes can be compared.

    python scripts/bench_validate.py --warmup-preset small --layers 6 --vocab 32000 --hidden 256 \
        --mlp 512 --samples 16 --seq-len 256 --reference prebuilt --kinds validate-never,validate-always
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

from bench_export import _vm_hwm  # noqa: E402

WARMUP_PRESET = "tiny"  # the warm-up model's widths (`train.presets`), at the measured model's depth and vocabulary
KINDS = ("calibrate-never", "calibrate-always", "validate-never", "validate-always")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--mlp", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--gen-tokens", type=int, default=4)
    parser.add_argument("--reference", choices=["fp8", "prebuilt"], default="fp8")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--warmup-preset", default=WARMUP_PRESET, help="the warm-up model's widths (a preset name)")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp folder)")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_validate-")
    try:
        setup = Setup(
            workdir,
            hidden=args.hidden,
            mlp=args.mlp,
            layers=args.layers,
            vocab=args.vocab,
            samples=args.samples,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            gen_tokens=args.gen_tokens,
            reference=args.reference,
            warmup_preset=args.warmup_preset,
        )
        results = {kind: setup.measure(kind) for kind in args.kinds.split(",")}
        for kind, r in results.items():
            print(
                f"{kind:17s} peak {r['peak_bytes'] / 1e9:.3f} GB, overhead {r['overhead_bytes'] / 1e9:.3f} GB, "
                f"peak - overhead {(r['peak_bytes'] - r['overhead_bytes']) / 1e9:.3f} GB "
                f"(model {r['sizes']['model_bytes'] / 1e9:.3f} GB, largest layer "
                f"{r['sizes']['largest_layer_bytes'] / 1e9:.3f} GB, embeddings + lm_head "
                f"{r['sizes']['outer_bytes'] / 1e9:.3f} GB), {r['seconds']:.1f} s"
            )
            if "warm" in r:
                w = r["warm"]
                print(
                    f"{kind:17s} warm-up ({args.warmup_preset}) again: peak above its start "
                    f"{w['peak_bytes'] / 1e6:.0f} MB, estimate {w['estimate_bytes'] / 1e6:.0f} MB "
                    f"({w['estimate_bytes'] / w['peak_bytes']:.2f}x)"
                )
        print(json.dumps(results))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


class Setup:
    """The models and data of a measurement under `workdir` (made once, by child processes)."""

    def __init__(
        self,
        workdir: str,
        *,
        hidden: int,
        mlp: int,
        layers: int,
        vocab: int,
        samples: int,
        seq_len: int,
        batch_size: int = 4,
        gen_tokens: int = 4,
        reference: str = "fp8",
        warmup_preset: str = WARMUP_PRESET,
    ) -> None:
        self.workdir, self.reference = workdir, reference
        self.run_options = dict(samples=samples, seq_len=seq_len, batch_size=batch_size, gen_tokens=gen_tokens)
        # the warm-up model has the big one's depth: the same programs compile (their memory is overhead)
        self.tiny = self._prepare(
            f"{warmup_preset}{layers}-{vocab}",
            preset=warmup_preset,
            layers=layers,
            vocab=vocab,
            samples=samples,
            seq_len=seq_len,
        )
        self.big = self._prepare(
            "big", hidden=hidden, mlp=mlp, layers=layers, vocab=vocab, samples=samples, seq_len=seq_len
        )

    def measure(self, kind: str) -> dict:
        """Run `kind` in a child on the tiny model then on the big one; its report."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
        spec = json.dumps(
            {"kind": kind, "tiny": self.tiny, "big": self.big, "reference": self.reference, **self.run_options}
        )
        result = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", spec],
            capture_output=True,
            text=True,
            env=_child_env(),
            cwd=ROOT,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{kind} child failed:\n{result.stderr[-4000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    def _prepare(
        self,
        name: str,
        *,
        layers: int,
        vocab: int,
        samples: int,
        seq_len: int,
        hidden: int = 0,
        mlp: int = 0,
        preset: str | None = None,
    ) -> dict:
        from bench_export import _generate

        folder = os.path.join(self.workdir, name)
        paths = {k: os.path.join(folder, k) for k in ("src", "nvfp4", "fp8")}
        paths["ids"] = os.path.join(folder, "ids.npy")
        if not os.path.isfile(paths["ids"]):
            os.makedirs(folder, exist_ok=True)
            import numpy as np

            np.save(paths["ids"], np.random.default_rng(0).integers(0, vocab, (samples, seq_len)))
        if preset is None:
            _generate(paths["src"], hidden, mlp, layers, vocab)
        else:
            _generate_preset(paths["src"], preset, layers, vocab)
        for quant in ("nvfp4", "fp8") if self.reference == "prebuilt" else ("nvfp4",):
            if not os.path.isdir(paths[quant]):
                _cli(
                    "export",
                    paths["src"],
                    "--out",
                    paths[quant],
                    "--quant",
                    quant,
                    "--calib-data",
                    paths["ids"],
                    "--calib-samples",
                    str(samples),
                    "--calib-seq-len",
                    str(seq_len),
                )
        return paths


def _generate_preset(folder: str, preset: str, layers: int, vocab: int) -> None:
    """A BF16 HF folder of random tensors of the named preset's widths at `layers` layers, written by
    a child process (its memory never counts)."""
    if os.path.isdir(folder):
        return
    code = (
        "import dataclasses, sys; sys.path[:0] = [%r, %r]; from bench_convert import write_synthetic_hf_folder; "
        "from nvfp4tool.train.presets import preset_config; write_synthetic_hf_folder(%r, "
        "dataclasses.replace(preset_config(%r, %d, 4096), num_layers=%d))"
    ) % (ROOT, os.path.join(ROOT, "scripts"), folder, preset, vocab, layers)
    subprocess.run([sys.executable, "-c", code], check=True, env=_child_env())


def _cli(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-c", "from nvfp4tool.cli import main; main()", *args],
        check=True,
        cwd=ROOT,
        env=_child_env(),
        capture_output=True,
    )


def _child_env() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)


# ------------------------------------------------------------------------------------------
# the child


def _child(spec: dict) -> None:
    run = _RUNNERS[spec["kind"].split("-")[0]]
    mode = spec["kind"].split("-")[1]
    overhead, warm = None, {}
    for paths in (spec["tiny"], spec["big"]):
        start = time.perf_counter()
        numbers = run(paths, mode, spec)
        seconds = time.perf_counter() - start
        if overhead is None:
            overhead = _vm_hwm()
            if spec["kind"].startswith("validate"):
                warm = _warm_again(paths, mode, spec)
            _drop_compiled_programs()
    peak = _vm_hwm()
    print(
        json.dumps(
            {
                "kind": spec["kind"],
                **warm,
                "seconds": seconds,
                "peak_bytes": peak,
                "overhead_bytes": overhead,
                "sizes": sizes(spec["big"], spec["samples"], spec["seq_len"], spec["batch_size"]),
                **numbers,
            }
        )
    )


def _warm_again(paths: dict, mode: str, spec: dict) -> dict:
    """{"warm": {peak_bytes, estimate_bytes}}: validate on the warm-up model once more, its programs
    compiled: its peak above the resident set before it (VmHWM reset to VmRSS by clear_refs), and
    validate's estimate (the largest footprint of the models it ran, held or streamed)."""
    from nvfp4tool import memory

    memory.release()
    before = _proc_status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    needs = _validate(paths, mode, spec)["footprints"]
    held = mode == "never"
    estimate = max(n["weights"] + n["working"] if held else n["streamed"] for n in needs.values())
    return {"warm": {"peak_bytes": _vm_hwm() - before, "estimate_bytes": estimate}}


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _drop_compiled_programs() -> None:
    """Free the warm-up's compiled programs. The measured run compiles its own (other shapes), and a
    validate or calibrate process holds one set, which the overhead already counts: kept, the
    warm-up's set would sit on top of the measured run's. A set costs about the same at either size
    (jax.clear_caches after a validate run: 155 MB streamed, 478 MB held on the warm-up model, 167 /
    467 MB on the 1.08 GB one)."""
    import jax

    from nvfp4tool import memory

    jax.clear_caches()
    memory.release()


def _calibrate(paths: dict, mode: str, spec: dict) -> dict:
    from nvfp4tool.checkpoints import open_checkpoint
    from nvfp4tool.export.calibrate import calibrate
    from nvfp4tool.export.plan import make_plan

    source = open_checkpoint(paths["src"])
    names = make_plan(source.config, "nvfp4").quantized
    amax = calibrate(
        source.config,
        source.tensors,
        names,
        paths["ids"],
        samples=spec["samples"],
        seq_len=spec["seq_len"],
        tokenizer_dir=None,
        offload=mode,
    ).input_amax
    return {"amax": amax}


def _validate(paths: dict, mode: str, spec: dict) -> dict:
    import dataclasses

    from nvfp4tool.validate.runner import ValidateOptions, validate_export

    reference = paths["fp8"] if spec["reference"] == "prebuilt" else "fp8"
    options = ValidateOptions(
        data=paths["ids"],
        reference=reference,
        samples=spec["samples"],
        seq_len=spec["seq_len"],
        batch_size=spec["batch_size"],
        prompts=2,
        prompt_len=min(16, spec["seq_len"]),
        gen_tokens=spec["gen_tokens"],
        offload=mode,
    )
    run = validate_export(paths["nvfp4"], options, force=True)  # each mode re-validates
    record = run.record
    return {
        "footprints": {label: need._asdict() for label, need in run.footprints.items()},
        "models": record.models,
        "layers": [dataclasses.asdict(r) for r in record.layers],
        "resources": dataclasses.asdict(record.resources),
        "generation": dataclasses.asdict(record.generation),
    }


def sizes(paths: dict, samples: int, seq_len: int, batch_size: int) -> dict:
    """What the memory bounds are made of, from the safetensors headers: the source's stored size,
    its largest decoder layer, the outer tensors (embeddings, final norm, LM head), its largest
    tensor, the largest layer of the exports (NVFP4, and FP8 when prebuilt) as stored, and per
    activation kind the bytes of the windows in fp32: `carry` (every window's hidden state, all
    held between layers when streamed), `batch` (one batch's largest intermediates: q/k/v/o,
    gate/up, attention scores) and `logits` (one batch's logits)."""
    import numpy as np

    from converters.hf import HFFolderSource

    def layer_bytes(folder: str, check_config: bool = True) -> tuple[dict, list[int]]:
        source = HFFolderSource(folder, check_config=check_config)
        nbytes = {n: int(np.prod(source.shape(n))) * np.dtype(source.dtype(n)).itemsize for n in source.names()}
        count = 1 + max(int(n.split(".")[2]) for n in nbytes if n.startswith("model.layers."))
        return nbytes, [sum(b for n, b in nbytes.items() if n.startswith(f"model.layers.{i}.")) for i in range(count)]

    nbytes, layers = layer_bytes(paths["src"])
    config = HFFolderSource(paths["src"]).config
    exports = [max(layer_bytes(paths[q], check_config=False)[1]) for q in ("nvfp4", "fp8") if os.path.isdir(paths[q])]
    batch = min(batch_size, samples)
    return {
        "model_bytes": sum(nbytes.values()),
        "largest_layer_bytes": max(layers),
        "export_layer_bytes": sum(exports),
        "outer_bytes": sum(b for n, b in nbytes.items() if not n.startswith("model.layers.")),
        "largest_tensor_bytes": max(nbytes.values()),
        "carry_bytes": 4 * samples * seq_len * config.hidden_size,
        "batch_bytes": 4
        * batch
        * seq_len
        * (4 * config.hidden_size + 2 * config.intermediate_size + config.num_heads * seq_len),
        "logits_bytes": 4 * batch * seq_len * config.vocab_size,
    }


_RUNNERS = {"calibrate": _calibrate, "validate": _validate}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(json.loads(sys.argv[2]))
    else:
        main()
