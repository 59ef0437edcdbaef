#!/usr/bin/env bash
# The GPU check (issue 13): numerics, quantizer bytes, quantize bandwidth, train step time.
#
#   OUT=/path/to/results bash scripts/device_check.sh
#
# Steps (each its own process and timeout, all within DEVICE_CHECK_BUDGET_S, 460 s by default:
# with 10 s to kill a step that overran and the summary, the script ends in under 8 minutes; a
# step the budget no longer covers FAILS as "out of time"):
#   quantizers      GPU vs host CPU vs the independent oracle (tests/fixtures/nvfp4_oracle.py), in bytes:
#                   the XLA quantizers (NVFP4 1d/2d/SR, FP8, RHT, the emulated and native GEMM)
#                   and the fused Pallas kernels (numerics/fused.py, compiled for the GPU: modes
#                   packed and operand; 1d, 2d, RHT, transposed, SR with passed bits). A kernel
#                   that fails to compile is a failed row with its error's first line.
#   bench_quantize  scripts/bench_quantize.py --fused: GB/s of each quantizer and its fraction of
#                   the bandwidth of an elementwise pass (x*2) timed in the same run (goal >= 80%).
#   train_1b        scripts/bench_train_step.py: bf16 / nvfp4 (RHT + SR on) / fp8 / fp8-block on
#                   1b at seq 2048 (--fit: the batch halves until the step fits), 3 timed steps
#                   each: step time, tokens/s, MFU vs the H200's 989 TFLOP/s, peak memory, x bf16
#                   (the JSON is rewritten after each recipe: a step that times out keeps those);
#   train_1b_4096   1b at seq 4096 with remat=block, nvfp4, one timed step: that it fits, its peak;
#   train_100m      as train_1b on 100m.
#   numerics_pytest tests/numerics/test_numerics_*.py on the GPU (last: it gets what the budget has left).
# It prints one table and writes JSON under $OUT (a temporary folder when unset): one file per
# step (<step>.json; each step's output in <step>.txt) and summary.json (pass/fail per step).
# Exit status 1 if any step failed. Goals (bandwidth, step-time ratios) are printed, not checked.
#
# Without a GPU (jax.default_backend() == "cpu") or with DEVICE_CHECK_SMOKE=1 it runs as a smoke
# test at tiny sizes (tests/quickstart/test_device_check.py runs it in CI so that it cannot rot): small
# quantizer shapes, a 256^2 benchmark, the tiny preset at seq 64, one numerics test file.
# DEVICE_CHECK_STEPS="train_1b bench_quantize" runs only those steps (e.g. to rerun one; on the GPU
# compiles are cached in JAX_COMPILATION_CACHE_DIR, /tmp/nvfp4tool-jax-cache by default, so a rerun
# skips them). PYTHON: the interpreter (python3).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
: > "$OUT/steps.tsv"
budget="${DEVICE_CHECK_BUDGET_S:-460}"
python="${PYTHON:-python3}"  # the interpreter (tests/quickstart/test_device_check.py passes its own)
steps="${DEVICE_CHECK_STEPS:-quantizers bench_quantize train_1b train_1b_4096 train_100m numerics_pytest}"
status=0

timeout 120 "$python" -c 'import sys, jax
print(jax.default_backend())
print("python", sys.version.split()[0], "jax", jax.__version__, jax.devices()[0].device_kind)' \
  > "$OUT/env.txt" 2> "$OUT/env_stderr.txt"
backend=$(head -1 "$OUT/env.txt")
backend="${backend:-none}"
smoke="${DEVICE_CHECK_SMOKE:-$([ "$backend" = cpu ] && echo 1 || echo 0)}"
echo "device_check: backend $backend, smoke $smoke, budget $budget s, out $OUT"

# run_step NAME LIMIT_S COMMAND...: run it with stdout+stderr in $OUT/NAME.txt under a timeout of
# LIMIT_S or what is left of the budget; one line in steps.tsv (name, rc, seconds, limit).
run_step() {
  local name=$1 cap=$2 left limit start rc
  shift 2
  case " $steps " in *" $name "*) ;; *) return 0 ;; esac
  left=$((budget - SECONDS))
  limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 20 ]; then
    printf '%s\tout of time\t0\t%s\n' "$name" "$limit" >> "$OUT/steps.tsv"
    echo "  $name: not run (out of time)"
    status=1
    return 0
  fi
  start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >> "$OUT/steps.tsv"
  echo "  $name: rc $rc in $((SECONDS - start)) s (limit $limit s)"
  [ "$rc" -eq 0 ] || status=1
}

if [ "$smoke" = 1 ]; then
  # few recipes: each compile of the tiny step takes 7-40 s on 2 cores (nvfp4's the longest)
  bench_args=(--size 256 --runs 1)
  train_100m=(--model tiny --vocab-size 256 --seq-len 64 --batch-size 2 --iters 1
              --recipes 'bf16,nvfp4')
  train_1b=(--model tiny --vocab-size 256 --seq-len 64 --batch-size 2 --iters 1
            --recipes fp8-block)
  train_1b_4096=(--model tiny --vocab-size 256 --seq-len 128 --batch-size 1 --iters 1
                 --remat block --recipes bf16)
  pytest_files=(tests/numerics/test_numerics_hadamard.py)
else
  bench_args=(--size 16384 --runs 5)
  # bf16 first, nvfp4 (the largest step) second: both get their own peak memory (see
  # bench_train_step.py). Batches from XLA's CPU memory analysis (a guide only: a GPU's fusions
  # differ, and the CPU ignores remat): 1b at 4 x 2048 needs 157 GB (bf16) / 194 GB (nvfp4), so 2;
  # 100m at 8 x 2048 nvfp4 92 GB (fp32 attention scores of every layer are kept for backward).
  recipes=bf16,nvfp4,fp8,fp8-block
  # nvfp4:xla last (the XLA quantizers instead of the fused kernels: what fusing buys)
  train_100m=(--model 100m --vocab-size 32000 --seq-len 2048 --batch-size 8 --iters 3
              --recipes "$recipes,nvfp4:xla")
  train_1b=(--model 1b --vocab-size 128256 --seq-len 2048 --batch-size 2 --iters 3
            --recipes "$recipes")
  train_1b_4096=(--model 1b --vocab-size 128256 --seq-len 4096 --batch-size 2 --iters 1
                 --remat block --recipes nvfp4)
  pytest_files=(tests/numerics/test_numerics_*.py)
  # a rerun on the same machine (DEVICE_CHECK_STEPS=...) loads the compiles instead of redoing them
  export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/nvfp4tool-jax-cache}"
fi
# the train steps may use 95% of the device's memory (jax takes 75% by default)
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"

run_step quantizers 100 "$python" - "$OUT/quantizers.json" "$smoke" <<'PYEOF'
"""Quantizers on the device vs the host CPU vs the oracle; every check in a row, none crashes."""
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "tests")  # the fixtures package
from fixtures import nvfp4_oracle as oracle  # noqa: E402
from nvfp4tool.numerics import (  # noqa: E402
    decode_nvfp4, dequantize_nvfp4, fake_quantize_nvfp4, nvfp4_global_scales, nvfp4_matmul,
    quantize_fp8,
    quantize_nvfp4, rht16, stochastic_bits, tensor_amax)
from nvfp4tool.numerics.fused import fused_quantize  # noqa: E402

out_path, smoke = sys.argv[1], sys.argv[2] == "1"
device = jax.devices()[0]
host = jax.devices("cpu")[0]
has_gpu = device.platform == "gpu"
rows = []


def check(name, fn):
    """Record fn() -> (ok, detail); an exception is a failed row with its first line."""
    try:
        ok, detail = fn()
    except Exception as error:  # noqa: BLE001  (a kernel that does not compile, an OOM, ...)
        ok, detail = False, f"FAILED: {type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
    rows.append({"check": name, "ok": bool(ok), "detail": detail})
    print(f"{name:<44} {'yes' if ok else 'NO':<4} {detail}", flush=True)


def run_on(dev, fn, *args):
    with jax.default_device(dev):
        return jax.tree.map(np.asarray, fn(*args))


def raw(a):
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def mismatched(a, b):
    return int((raw(a) != raw(b)).sum())


def tree_mismatched(a, b):
    return sum(mismatched(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


rng = np.random.default_rng(0)

# ---- XLA NVFP4 quantizers: device vs host vs oracle on edge cases
e4m3 = np.array([oracle.e4m3_value(b) for b in range(0x7F)], np.float64)
e4m3_mids = ((e4m3[:-1] + e4m3[1:]) / 2).astype(np.float32)
scale_mids = np.zeros((3 * e4m3_mids.size + 1, 16), np.float32)
scale_mids[:-1, 0] = np.concatenate([e4m3_mids, np.nextafter(e4m3_mids, 0),
                                     np.nextafter(e4m3_mids, 1e9)])
scale_mids[-1, 0] = 448.0  # S_enc = 6: sdb = bamax lands on every E4M3 midpoint
e2m1_mids = np.zeros((1, 32), np.float32)
e2m1_mids[0, :15] = [6.0, .25, .75, 1.25, 1.75, 2.5, 3.5, 5.0, -.25, -.75, -1.25, -1.75, -2.5,
                     -3.5, -5.0]
e2m1_mids[0, 16] = 2688.0  # S_enc = 1, enc = 1 in the first block
extreme = rng.standard_normal((3, 64)).astype(np.float32) * np.array([[1e-39], [1e-37], [1e37]],
                                                                      np.float32)
cases = {
    "normal 1d": (rng.standard_normal((64, 128)).astype(np.float32), {}),
    "normal 2d": (rng.standard_normal((40, 128)).astype(np.float32), {"block": "2d"}),
    "bf16 1d": (jnp.asarray(rng.standard_normal((64, 128)) * 5, jnp.bfloat16), {}),
    "student-t 2d": (rng.standard_t(2, (48, 128)).astype(np.float32), {"block": "2d"}),
    "given amax": (rng.standard_normal((32, 64)).astype(np.float32), {"global_amax": 1.5}),
    "E2M1 midpoints": (e2m1_mids, {}),
    "E4M3 midpoints": (scale_mids, {}),
    "subnormal/extreme": (extreme, {}),
}


def xla_case(x, kwargs):
    want = oracle.quantize(np.asarray(x), **kwargs)
    on_dev = run_on(device, lambda v: quantize_nvfp4(v, **kwargs), x)
    on_host = run_on(host, lambda v: quantize_nvfp4(v, **kwargs), x)
    bad_oracle = (mismatched(on_dev.packed, want["packed"])
                  + mismatched(on_dev.scales, want["scales"])
                  + mismatched(on_dev.global_amax, want["global_amax"]))
    bad_host = tree_mismatched(on_dev, on_host)
    fake = run_on(device, lambda v: fake_quantize_nvfp4(v, dtype=jnp.float32, **kwargs), x)
    deq = run_on(device, lambda v: dequantize_nvfp4(quantize_nvfp4(v, **kwargs)), x)
    bad_fake = mismatched(fake, deq)
    return (bad_oracle == bad_host == bad_fake == 0,
            f"bytes != oracle: {bad_oracle}, != host: {bad_host}, fake != deq(q): {bad_fake}")


if smoke:  # the smoke test proves the plumbing; tests/numerics/test_numerics_*.py test the numerics
    cases = {name: cases[name] for name in ("normal 1d", "normal 2d")}
for name, (x, kwargs) in cases.items():
    check(f"nvfp4 {name}", lambda x=x, kwargs=kwargs: xla_case(x, kwargs))

big_shape = (256, 1024) if smoke else (1024, 4096)
big = jax.random.normal(jax.random.key(0), big_shape, jnp.float32)


def sr_same_key():
    sr = [run_on(d, lambda v: quantize_nvfp4(v, rounding="stochastic", key=jax.random.key(3)), big)
          for d in (device, host)]
    bad = tree_mismatched(sr[0], sr[1])
    return bad == 0, f"mismatched bytes: {bad}"


def big_block(block):
    q = run_on(device, lambda v: quantize_nvfp4(v, block=block), big)
    bad = tree_mismatched(q, run_on(host, lambda v: quantize_nvfp4(v, block=block), big))
    x64 = np.asarray(big, np.float64)
    err = np.linalg.norm(np.asarray(run_on(device, dequantize_nvfp4, q), np.float64) - x64)
    return bad == 0, f"mismatched bytes: {bad}, rel L2 err {err / np.linalg.norm(x64):.4f}"


check("nvfp4 SR same key device vs host", sr_same_key)
for block in ("1d", "2d"):
    check(f"nvfp4 {block} {big_shape[0]}x{big_shape[1]} device vs host",
          lambda block=block: big_block(block))

x8 = rng.standard_t(3, (256, 384)).astype(np.float32) * 10


def fp8_case(fmt, gran):
    a, b = (run_on(d, lambda v: quantize_fp8(v, fmt=fmt, granularity=gran), x8)
            for d in (device, host))
    bad = mismatched(a.data, b.data) + mismatched(a.scale, b.scale)
    return bad == 0, f"mismatched bytes: {bad}"


FP8 = [(fmt, gran) for fmt in ("e4m3", "e5m2")
       for gran in ("tensor", "channel", "block128", "block128x128")]
for fmt, gran in FP8[::3] if smoke else FP8:
    check(f"fp8 {fmt} {gran} device vs host", lambda fmt=fmt, gran=gran: fp8_case(fmt, gran))

xr = rng.standard_normal((64, 256)).astype(np.float32)


def rht_case():
    diff = np.abs(run_on(device, rht16, xr) - run_on(host, rht16, xr)).max()
    return diff <= 1e-6, f"max |diff| {diff:.2e}"


check("rht16 device vs host", rht_case)

# ---- fused Pallas kernels (compiled on the device; interpret mode on a CPU) vs host vs oracle.
# The quantized operand is one matrix X [R, K] (R not a multiple of the 32-row kernel tile: a
# ragged last tile); a transposed case is handed X.T and must give X's bytes.
FUSED = [  # (name, fused_quantize options)
    ("1d", {}),
    ("2d", {"block": "2d"}),
    ("RHT 1d", {"rht": True}),
    ("1d^T", {"transpose": True}),
    ("2d^T", {"block": "2d", "transpose": True}),
    ("RHT 1d^T", {"rht": True, "transpose": True}),  # the wgrad operand
    ("SR 1d", {"rounding": "stochastic"}),
    ("SR RHT 2d^T", {"rounding": "stochastic", "rht": True, "block": "2d", "transpose": True}),
]
SHAPES = [("oracle", (40, 64))] if smoke else [("oracle", (240, 512)), ("large", (2000, 4096))]
oracle_cache = {}


def mixed_range(shape):
    """bf16 values whose 16-blocks span 2^-3 .. 2^3 (as tests/numerics/test_numerics_fused.py)."""
    r = np.random.default_rng(1)
    return jnp.asarray(r.standard_normal(shape) * np.exp2(r.integers(-3, 4, shape)), jnp.bfloat16)


def fused_case(shape_name, x, opts, mode):
    block = opts.get("block", "1d")
    stochastic = opts.get("rounding") == "stochastic"
    key = jax.random.key(5)
    with jax.default_device(host):
        op = rht16(x) if opts.get("rht") else x
        gamax = tensor_amax(op)
        bits = stochastic_bits(key, op.shape) if stochastic else None
        want = quantize_nvfp4(op, block=block, global_amax=gamax,
                              rounding="stochastic" if stochastic else "rne",
                              key=key if stochastic else None)
        want_operand = decode_nvfp4(want.packed, want.scales, 1.0, dtype=jnp.bfloat16)
        want, want_operand = jax.tree.map(np.asarray, (want, want_operand))
    x_in = np.asarray(x).T.copy() if opts.get("transpose") else np.asarray(x)
    fn = jax.jit(lambda v, a, b: fused_quantize(v, a, bits=b, mode=mode, **opts))
    got = jax.tree.map(np.asarray, fn(*jax.device_put((x_in, gamax, bits), device)))
    if mode == "operand":  # an NVFP4Operand: bf16 code x block scale, and S_dec
        want_s_dec = np.asarray(nvfp4_global_scales(gamax)[1])
        bad_host = mismatched(got.values, want_operand) + mismatched(got.s_dec, want_s_dec)
    else:
        bad_host = mismatched(got.packed, want.packed) + mismatched(got.scales, want.scales)
    detail = f"bytes != host: {bad_host}"
    bad_oracle = 0
    if shape_name == "oracle" and not stochastic and mode == "packed":
        ref_key = (bool(opts.get("rht")), block)
        if ref_key not in oracle_cache:
            oracle_cache[ref_key] = oracle.quantize(np.asarray(op, np.float32), block=block,
                                                    global_amax=np.float32(gamax))
        ref = oracle_cache[ref_key]
        bad_oracle = mismatched(got.packed, ref["packed"]) + mismatched(got.scales, ref["scales"])
        detail += f", != oracle: {bad_oracle}"
    return bad_host == bad_oracle == 0, detail


for shape_name, shape in SHAPES:
    x = mixed_range(shape)
    for index, (name, opts) in enumerate(FUSED):
        for mode in ("packed", "operand"):
            # the operand output differs from packed only in the kernel's last lines
            if mode == "operand" and (shape_name == "large" or smoke and 0 < index < len(FUSED) - 1):
                continue
            check(f"fused {name} {mode} {shape[0]}x{shape[1]}",
                  lambda x=x, opts=opts, mode=mode, s=shape_name: fused_case(s, x, opts, mode))

# ---- GEMM: native (jax.nn.scaled_matmul) vs emulated on the device; emulated vs fp64


def timed(fn, *args, runs=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_native_vs_emulated():
    size = 8192 if has_gpu else 256
    a_q = quantize_nvfp4(jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16))
    b_q = quantize_nvfp4(jax.random.normal(jax.random.key(2), (size, size), jnp.bfloat16),
                         block="2d")
    emulated = jax.jit(lambda a, b: nvfp4_matmul(a, b, backend="emulated"))
    flops = 2 * size**3
    detail = f"{size}^3 emulated {flops / timed(emulated, a_q, b_q) / 1e12:.1f} TFLOP/s"
    if not has_gpu:
        return True, detail + ", native skipped (no GPU)"
    native = jax.jit(lambda a, b: nvfp4_matmul(a, b, backend="native"))
    t_native = timed(native, a_q, b_q)
    out_e = np.asarray(emulated(a_q, b_q), np.float64)
    out_n = np.asarray(native(a_q, b_q), np.float64)
    rel = np.abs(out_n - out_e).max() / np.abs(out_e).max()
    detail += f", native {flops / t_native / 1e12:.1f} TFLOP/s, max |native-emulated|/max {rel:.2e}"
    return rel <= 1e-5, detail


def matmul_vs_fp64():
    small = [quantize_nvfp4(rng.standard_normal((64, 256)).astype(np.float32)) for _ in range(2)]
    out_dev = run_on(device, lambda a, b: nvfp4_matmul(a, b, backend="emulated"), *small)
    a64, b64 = (np.asarray(dequantize_nvfp4(q), np.float64) for q in small)
    bound = np.abs(a64) @ np.abs(b64).T
    ok = np.all(np.abs(out_dev - a64 @ b64.T) <= 1e-6 * bound + 1e-30)
    return ok, "64x256 @ 64x256^T"


check("nvfp4_matmul native vs emulated", matmul_native_vs_emulated)
check("nvfp4_matmul emulated vs fp64 of dequantized", matmul_vs_fp64)

with open(out_path, "w") as f:
    json.dump({"device": str(device), "backend": jax.default_backend(), "jax": jax.__version__,
               "checks": rows}, f, indent=2)
sys.exit(0 if all(r["ok"] for r in rows) else 1)
PYEOF

run_step bench_quantize 60 "$python" scripts/bench_quantize.py "${bench_args[@]}" --fused \
  --json "$OUT/bench_quantize.json"
run_step train_1b 200 "$python" scripts/bench_train_step.py "${train_1b[@]}" --fit \
  --json "$OUT/train_1b.json"
run_step train_1b_4096 100 "$python" scripts/bench_train_step.py "${train_1b_4096[@]}" --fit \
  --json "$OUT/train_1b_4096.json"
run_step train_100m 100 "$python" scripts/bench_train_step.py "${train_100m[@]}" --fit \
  --json "$OUT/train_100m.json"

# tests/conftest.py defaults JAX_PLATFORMS to cpu: ask for the GPU explicitly
platforms=$([ "$backend" = gpu ] && echo cuda || echo cpu)
if "$python" -c 'import pytest' 2>/dev/null; then
  run_step numerics_pytest 150 env JAX_PLATFORMS="$platforms" "$python" -m pytest -q \
    -p no:cacheprovider "${pytest_files[@]}"
else
  printf 'numerics_pytest\tskipped: pytest not installed\t0\t0\n' >> "$OUT/steps.tsv"
fi

# the table and summary.json
"$python" - "$OUT" "$backend" "$smoke" "$steps" <<'PYEOF' || status=1
"""Summarize the steps: one table on stdout, <step>.json for the pytest step, summary.json."""
import json
import sys
from pathlib import Path

out, backend, smoke, selected = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4]
ALL = ["quantizers", "bench_quantize", "train_1b", "train_1b_4096", "train_100m",
       "numerics_pytest"]
ran = {}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, seconds, limit = line.split("\t")
    ran[name] = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(seconds),
                 "limit_s": int(limit)}


def load(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def last_line(name):
    path = out / f"{name}.txt"
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return lines[-1][:160] if lines else ""


def quantizers(data):
    checks = data["checks"]
    bad = [c["check"] for c in checks if not c["ok"]]
    text = f"{len(checks) - len(bad)}/{len(checks)} checks equal (bytes)"
    return [text + (f"; failed: {', '.join(bad[:4])}" if bad else "")], []


def bench_quantize(data):
    rows = data["results"]
    fused = [r for r in rows if r["case"].startswith("fused")]
    ok = [r for r in fused if "error" not in r]
    text = f"x*2 {rows[0]['gb_per_s']:.0f} GB/s at {data['size']}^2"
    if ok:
        worst = min(ok, key=lambda r: r["bw_vs_copy"])
        met = sum(r["bw_vs_copy"] >= 0.8 for r in ok)
        text += (f"; worst {worst['case']} {100 * worst['bw_vs_copy']:.0f}% of x*2's GB/s, "
                 f"{met}/{len(fused)} fused >= 80%")
    sub = [(r["case"], "FAILED: " + r["error"] if "error" in r else
            f"{r['gb_per_s']:.1f} GB/s, {100 * r['bw_vs_copy']:.0f}% of x*2") for r in fused]
    return [text], sub


def train(data):
    rows = data["results"]
    first = rows[0]
    text = (f"{data['args']['model']}, seq {first['seq_len']}, batch {data['batch_size']}, "
            f"remat {data['args']['remat']}, {first['tokens_per_step']} tokens/step")
    sub = []
    for r in rows:
        mfu = "" if r["mfu"] is None else f", MFU {100 * r['mfu']:.1f}%"
        peak = "" if r["peak_bytes_in_use"] is None else (
            f", peak {'' if r['peak_is_own'] else '<='}{r['peak_bytes_in_use'] / 1e9:.1f} GB")
        ratio = "" if r["x_bf16"] is None else f", {r['x_bf16']:.2f}x bf16"
        sub.append((r["recipe"], f"{1e3 * r['step_time_s']:.1f} ms, "
                                 f"{r['tokens_per_s']:,.0f} tok/s{mfu}{peak}{ratio}"))
    return [text], sub


FIGURES = {"quantizers": quantizers, "bench_quantize": bench_quantize, "train_100m": train,
           "train_1b": train, "train_1b_4096": train}
summary = {"backend": backend, "smoke": smoke, "steps": {}}
env = (out / "env.txt").read_text().strip() if (out / "env.txt").exists() else ""
table = []
for name in ALL:
    step = ran.get(name)
    if step is None:
        why = "not selected" if f" {name} " not in f" {selected} " else "no record"
        summary["steps"][name] = {"passed": why == "not selected", "status": why}
        table.append((name, "skip" if why == "not selected" else "FAIL", "-", why, []))
        continue
    data = load(name)
    passed = step["rc"] == 0 and (name not in FIGURES or data is not None)
    if isinstance(step["rc"], str):  # "out of time", "skipped: ..."
        passed = step["rc"].startswith("skipped")
        figures, sub = [step["rc"]], []
    elif data is not None and name in FIGURES:
        figures, sub = FIGURES[name](data)
    else:
        figures, sub = [last_line(name) or f"rc {step['rc']}"], []
    if step["rc"] == 124:
        figures = [f"timed out after {step['limit_s']} s"] + figures
    if name == "numerics_pytest":
        (out / f"{name}.json").write_text(json.dumps(dict(step, summary=last_line(name)), indent=1))
    summary["steps"][name] = dict(step, passed=passed, figures=figures,
                                  rows=[{"case": c, "figures": f} for c, f in sub])
    table.append((name, "PASS" if passed else "FAIL", step["seconds"], "; ".join(figures), sub))
summary["passed"] = all(s["passed"] for s in summary["steps"].values())
(out / "summary.json").write_text(json.dumps(summary, indent=1))

print(f"\ndevice check ({'SMOKE, ' if smoke else ''}backend {backend}; {env.splitlines()[-1] if env else ''})")
print(f"| {'step':<20} | result | {'s':>4} | figures")
print(f"|{'-' * 22}|--------|{'-' * 6}|--------")
for name, result, seconds, figures, sub in table:
    print(f"| {name:<20} | {result:<6} | {seconds:>4} | {figures}")
    for case, text in sub:
        print(f"| {'  ' + case:<20} |        |      | {text}")
print(f"device_check: {'PASS' if summary['passed'] else 'FAIL'}; JSON in {out}")
sys.exit(0 if summary["passed"] else 1)
PYEOF
exit "$status"
