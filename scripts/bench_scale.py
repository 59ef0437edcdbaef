"""Wall time and peak RSS of each pipeline stage on a synthetic Llama-shaped BF16 model.

    python scripts/bench_scale.py --preset tiny --workdir /work/scratch/bench/tiny      # smoke test
    python scripts/bench_scale.py --preset 0.63b --workdir /work/scratch/bench/0.63b \\
        --stages export,check,validate --json before_0.63b.json
    python scripts/bench_scale.py --preset 8b --workdir /work/scratch/bench/8b --json 8b.json \\
        --stage-args validate="--offload auto"

Writes the synthetic HF folder (random BF16 weights, `bench_convert.write_synthetic_hf_folder`,
tensor by tensor, in a child process) and token-id files (.npy int32 [samples, seq_len], one for
calibration, another for validation), then runs each stage as its own child process through the
real CLI (`python -c "from nvfp4tool.cli import main; main()" ...`, JAX_PLATFORMS=cpu), in order:

    convert       HF -> MaxText (--dtype bf16, --rope-layout half)
    convert-back  MaxText -> HF (--model-config: the source's config.json)
    export        NVFP4 W4A4 (ModelOpt) with calibration on the .npy ids, from the convert-back
                  folder (or the synthetic folder when convert-back is not run)
    check         the export
    validate      the export against its BF16 source and an FP8 reference made on the fly

A stage's peak RSS is the `ru_maxrss` of that child alone (`os.wait4`), its ratio to the model's
BF16 size is printed next to it. `--stage-args STAGE=ARGS` (repeatable) appends CLI arguments to a
stage. Free disk is checked first against the preset's largest footprint (refused with one line
if short); each stage's output is deleted as soon as no later stage reads it. Output lines that
mention offload are kept in the JSON (what `--offload auto` chose). A failing stage stops the
run and shows its stderr tail. The table is printed; the JSON (machine facts, stages) is written
to --json and printed as the last line.

Presets (untied lm_head, head_dim 128, BF16):
    8b     Llama-3.1-8B: hidden 4096, mlp 14336, 32 layers, 32 heads, 8 KV heads, vocab 128256,
           llama3 RoPE scaling (factor 8), ~16.1 GB
    0.63b  hidden 2048, mlp 8192, 8 layers, 16 heads, 8 KV heads, vocab 32000, ~1.27 GB
    tiny   hidden 128, mlp 256, 2 layers (head_dim 16), vocab 512: checks the script end to end
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path[:0] = [ROOT, SCRIPTS]
STAGES = ("convert", "convert-back", "export", "check", "validate")
MARKER = ".bench_scale"  # a workdir this script made (and may empty)
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Preset:
    shape: dict  # bench_convert.synthetic_config keyword arguments (rope_scaling as a dict)
    calib: tuple[int, int]  # export --calib-samples, --calib-seq-len
    validate: tuple[int, int, int, int, int]  # --samples, --seq-len, --prompts, --prompt-len, --gen-tokens


LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
PRESETS = {
    "8b": Preset(
        dict(
            hidden=4096,
            mlp=14336,
            layers=32,
            vocab=128256,
            kv_heads=8,
            rope_scaling=LLAMA31_ROPE,
            max_position_embeddings=131072,
        ),
        calib=(4, 64),
        validate=(4, 64, 1, 16, 16),
    ),
    "0.63b": Preset(
        dict(hidden=2048, mlp=8192, layers=8, vocab=32000, kv_heads=8), calib=(8, 128), validate=(8, 128, 2, 32, 32)
    ),
    "tiny": Preset(
        dict(hidden=128, mlp=256, layers=2, vocab=512, head_dim=16, kv_heads=4),
        calib=(4, 32),
        validate=(4, 32, 1, 8, 8),
    ),
}


def model_config(preset: str):
    """The preset's ModelConfig (bench_convert's synthetic Llama shape)."""
    from bench_convert import synthetic_config

    from nvfp4tool.config import RopeScaling

    shape = dict(PRESETS[preset].shape)
    if "rope_scaling" in shape:
        shape["rope_scaling"] = RopeScaling(**shape["rope_scaling"])
    return synthetic_config(dtype="bfloat16", **shape)


def write_model(preset: str, folder: str) -> None:
    """Child process entry: the preset's random BF16 HF folder."""
    from bench_convert import write_synthetic_hf_folder

    write_synthetic_hf_folder(folder, model_config(preset))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--workdir", required=True, help="scratch folder (made by this script, emptied first)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {','.join(STAGES)}")
    parser.add_argument(
        "--stage-args",
        action="append",
        default=[],
        metavar="STAGE=ARGS",
        help="extra CLI arguments for a stage (repeatable), e.g. validate='--offload always'",
    )
    parser.add_argument("--json", default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)

    stages = _parse_stages(parser, args.stages)
    extra = _parse_stage_args(parser, args.stage_args)
    config = model_config(args.preset)
    footprint = disk_footprint(config, stages)
    workdir = _prepare_workdir(parser, args.workdir)
    free = shutil.disk_usage(workdir).free
    if free < footprint:
        shutil.rmtree(workdir)
        sys.exit(
            f"bench_scale: {args.workdir}: {free / GB:.1f} GB free, preset {args.preset} "
            f"(stages {','.join(stages)}) needs ~{footprint / GB:.1f} GB"
        )

    paths = {name: os.path.join(workdir, name) for name in ("hf", "mt", "hf2", "export", "tmp", "logs")}
    for name in ("tmp", "logs"):
        os.makedirs(paths[name])
    result = {
        "preset": args.preset,
        "model": _model_facts(config),
        "machine": machine_facts(),
        "stages_requested": stages,
        "stage_args": extra,
        "disk_needed_gb": footprint / GB,
        "disk_free_gb": free / GB,
        "setup": {},
        "stages": [],
    }
    print(
        f"preset {args.preset}: {config.num_parameters():,} parameters, {result['model']['bf16_gb']:.2f} GB "
        f"BF16; {result['machine']['cores']} cores, {result['machine']['ram_gb']:.1f} GB RAM; "
        f"disk {free / GB:.0f} GB free, ~{footprint / GB:.1f} GB needed",
        flush=True,
    )

    preset = PRESETS[args.preset]
    readers = stage_inputs(stages)
    if readers["hf"] is not None:
        code = "import sys; sys.path[:0] = [%r, %r]; import bench_scale; bench_scale.write_model(%r, %r)" % (
            ROOT,
            SCRIPTS,
            args.preset,
            paths["hf"],
        )
        result["setup"]["write_model"] = _run_child(
            "write_model", [sys.executable, "-c", code], "bench_scale.write_model", paths, config
        )
        shutil.copy(os.path.join(paths["hf"], "config.json"), os.path.join(workdir, "config.json"))
    calib = _write_ids(os.path.join(workdir, "calib.npy"), *preset.calib, config.vocab_size, seed=1)
    val = _write_ids(os.path.join(workdir, "val.npy"), *preset.validate[:2], config.vocab_size, seed=2)

    source = paths["hf2"] if "convert-back" in stages else paths["hf"]
    samples, seq_len, prompts, prompt_len, gen_tokens = preset.validate
    commands = {
        "convert": ["convert", paths["hf"], paths["mt"], "--to", "maxtext", "--dtype", "bf16", "--rope-layout", "half"],
        "convert-back": [
            "convert",
            paths["mt"],
            paths["hf2"],
            "--to",
            "hf",
            "--rope-layout",
            "half",
            "--model-config",
            os.path.join(workdir, "config.json"),
        ],
        "export": [
            "export",
            source,
            "--out",
            paths["export"],
            "--quant",
            "nvfp4",
            "--calib-data",
            calib,
            "--calib-samples",
            str(preset.calib[0]),
            "--calib-seq-len",
            str(preset.calib[1]),
        ],
        "check": ["check", paths["export"], "--json-out", os.path.join(workdir, "check.json")],
        "validate": [
            "validate",
            paths["export"],
            "--data",
            val,
            "--samples",
            str(samples),
            "--seq-len",
            str(seq_len),
            "--prompts",
            str(prompts),
            "--prompt-len",
            str(prompt_len),
            "--gen-tokens",
            str(gen_tokens),
            "--json",
            os.path.join(workdir, "validation.json"),
            "--force",
        ],
    }
    cli = [sys.executable, "-c", "from nvfp4tool.cli import main; main()"]
    for i, stage in enumerate(stages):
        stage_argv = commands[stage] + extra.get(stage, [])
        row = _run_child(stage, cli + stage_argv, shlex.join(["nvfp4tool"] + stage_argv), paths, config)
        result["stages"].append(row)
        if row["exit_code"] != 0:
            print(
                f"stage {stage} failed (exit {row['exit_code']}); stderr tail:\n{row['stderr_tail']}", file=sys.stderr
            )
            break
        for name, last_reader in readers.items():
            if last_reader == i:
                shutil.rmtree(paths[name], ignore_errors=True)
    _print_table(result)
    line = json.dumps(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    print(line)
    if any(row["exit_code"] != 0 for row in result["stages"]):
        sys.exit(1)


def stage_inputs(stages: list[str]) -> dict[str, int | None]:
    """Each big folder -> index (in `stages`) of the last stage that reads it (None: none does)."""
    source = "hf2" if "convert-back" in stages else "hf"
    reads = {
        "convert": {"hf"},
        "convert-back": {"mt"},
        "export": {source},
        "check": {"export"},
        "validate": {"export", source},
    }
    last: dict[str, int | None] = {name: None for name in ("hf", "mt", "hf2", "export")}
    for i, stage in enumerate(stages):
        for name in reads[stage]:
            last[name] = i
    for i, stage in enumerate(stages):  # an output nobody reads later goes right after its stage
        made = {"convert": "mt", "convert-back": "hf2", "export": "export"}.get(stage)
        if made and last[made] is None:
            last[made] = i
    return last


def disk_footprint(config, stages: list[str]) -> int:
    """Bytes on disk at the fullest moment of the run (+5% and 0.5 GB of slack)."""
    shapes = config.expected_tensor_shapes()
    quantized = sum(int(np.prod(shapes[f"{n}.weight"])) for n in config.linear_names() if n != "lm_head")
    kept = config.num_parameters() - quantized
    size = {
        "hf": 2 * config.num_parameters(),
        "mt": 2 * config.num_parameters(),
        "hf2": 2 * config.num_parameters(),
        "export": quantized // 2 + quantized // 16 + 2 * kept,
    }
    fp8_temp = quantized + 2 * kept  # validate's FP8 reference, made on the fly
    made = {"convert": "mt", "convert-back": "hf2", "export": "export"}
    last = stage_inputs(stages)
    present = {"hf"} if last["hf"] is not None else set()
    peak = sum(size[n] for n in present)
    for i, stage in enumerate(stages):
        if stage in made:
            present.add(made[stage])
        during = sum(size[n] for n in present) + (fp8_temp if stage == "validate" else 0)
        peak = max(peak, during)
        present -= {n for n, j in last.items() if j == i}
    return int(peak * 1.05 + 0.5 * GB)


def machine_facts() -> dict:
    """Cores, total / available RAM, load average, versions and the repository's commit."""
    meminfo = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            meminfo[key] = int(value.split()[0]) * 1024
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return {
        "cores": os.cpu_count(),
        "ram_gb": meminfo["MemTotal"] / GB,
        "ram_available_gb": meminfo["MemAvailable"] / GB,
        "loadavg_1m": os.getloadavg()[0],
        "python": sys.version.split()[0],
        "commit": commit.stdout.strip() + ("+dirty" if dirty.stdout else ""),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def _run_child(stage: str, command: list[str], label: str, paths: dict, config) -> dict:
    """Run one stage (`label`: its command as shown); wall s, peak RSS of that child alone (wait4
    ru_maxrss), exit code, the output lines mentioning offload, the stderr tail."""
    log_out, log_err = (os.path.join(paths["logs"], f"{stage}.{kind}") for kind in ("out", "err"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, TMPDIR=paths["tmp"])
    print(f"[{stage}] {label}", flush=True)
    with open(log_out, "w") as out, open(log_err, "w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=err, cwd=ROOT, env=env)
        _, status, rusage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    peak = rusage.ru_maxrss * 1024  # KiB on Linux
    output = open(log_out, errors="replace").read() + open(log_err, errors="replace").read()
    row = {
        "stage": stage,
        "wall_s": round(seconds, 1),
        "peak_rss_gb": round(peak / GB, 3),
        "peak_over_bf16": round(peak / (2 * config.num_parameters()), 2),
        "exit_code": proc.returncode,
        "command": label,
        "offload_lines": [line.strip() for line in output.splitlines() if "offload" in line.lower()],
        "stderr_tail": open(log_err, errors="replace").read()[-3000:],
    }
    print(f"[{stage}] {row['wall_s']:.1f} s, peak RSS {row['peak_rss_gb']:.2f} GB, exit {row['exit_code']}", flush=True)
    return row


def _print_table(result: dict) -> None:
    model = result["model"]
    print(
        f"\npreset {result['preset']} ({model['parameters']:,} parameters, {model['bf16_gb']:.2f} GB BF16), "
        f"{result['machine']['cores']} cores, {result['machine']['ram_gb']:.1f} GB RAM, "
        f"commit {result['machine']['commit']}"
    )
    print("| stage | wall s | peak RSS GB | peak / BF16 model | exit |\n|---|---|---|---|---|")
    for row in result["stages"]:
        print(
            f"| {row['stage']} | {row['wall_s']:.1f} | {row['peak_rss_gb']:.2f} | "
            f"{row['peak_over_bf16']:.2f}x | {row['exit_code']} |"
        )
    for row in result["stages"]:
        for line in row["offload_lines"]:
            print(f"{row['stage']}: {line}")


def _model_facts(config) -> dict:
    return {
        "parameters": config.num_parameters(),
        "bf16_gb": 2 * config.num_parameters() / GB,
        "hidden": config.hidden_size,
        "mlp": config.intermediate_size,
        "layers": config.num_layers,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "vocab": config.vocab_size,
        "rope_scaling": config.rope_scaling is not None,
    }


def _write_ids(path: str, samples: int, seq_len: int, vocab: int, *, seed: int) -> str:
    """Deterministic random token ids, int32 [samples, seq_len]."""
    np.save(path, np.random.default_rng(seed).integers(0, vocab, (samples, seq_len), dtype=np.int32))
    return path


def _parse_stages(parser: argparse.ArgumentParser, text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STAGES]
    if unknown or not chosen:
        parser.error(
            f"--stages {text}: unknown stage(s) {', '.join(unknown) or '(none given)'}; choose from {','.join(STAGES)}"
        )
    needs = {"convert-back": "convert", "check": "export", "validate": "export"}
    for stage in chosen:
        if stage in needs and needs[stage] not in chosen:
            parser.error(f"--stages {text}: {stage} needs {needs[stage]}")
    return [s for s in STAGES if s in chosen]


def _parse_stage_args(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, list[str]]:
    extra: dict[str, list[str]] = {}
    for item in items:
        stage, sep, text = item.partition("=")
        if not sep or stage not in STAGES:
            parser.error(f"--stage-args {item}: expected STAGE=ARGS with STAGE in {','.join(STAGES)}")
        extra.setdefault(stage, []).extend(shlex.split(text))
    return extra


def _prepare_workdir(parser: argparse.ArgumentParser, workdir: str) -> str:
    """An empty workdir marked as this script's; refuses a non-empty folder it did not make."""
    workdir = os.path.abspath(workdir)
    if os.path.isdir(workdir) and os.listdir(workdir):
        if not os.path.exists(os.path.join(workdir, MARKER)):
            parser.error(f"--workdir {workdir}: exists, is not empty and was not made by bench_scale.py")
        shutil.rmtree(workdir)
    os.makedirs(workdir, exist_ok=True)
    open(os.path.join(workdir, MARKER), "w").close()
    return workdir


if __name__ == "__main__":
    main()
