#!/usr/bin/env bash
# Numerics check for the GPU machine (no installs; uses the packages that are there).
#
#   OUT=/path/to/results bash scripts/device_check.sh
#
# 1. The numerics tests (tests/test_numerics_*.py) under pytest on the GPU, if pytest is there.
# 2. The quantizers on the GPU vs the same functions on the host CPU vs the independent oracle
#    (0 mismatched bytes expected), fake-quant == dequant(quant) on the GPU, FP8 GPU vs CPU,
#    RHT GPU vs CPU, and nvfp4_matmul native (jax.nn.scaled_matmul; emulated by XLA on Hopper)
#    vs emulated, with timings.
# 3. scripts/bench_quantize.py at GPU size (16384^2 bf16; BENCH_ARGS overrides, e.g. "--size 1024").
# 4. With TRAIN_BENCH=1: scripts/bench_train_step.py on the 100m preset (fp8/nvfp4 vs bf16 step time).
# Details go under $OUT (a temporary folder when unset); a short table is printed. Exit status 1
# if any check failed. Without a GPU it still runs (CPU vs CPU, native skipped): a smoke test.
# Each step has a timeout (240 + 180 + 150 s) so the whole script stays under 10 minutes; on the
# 2-core CPU machine step 1 alone took 4 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
status=0

python3 -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__, jax.devices())' \
  > "$OUT/env.txt" 2>&1 || status=1
echo "env: $(tail -1 "$OUT/env.txt")"

# 1. tests (tests/conftest.py defaults JAX_PLATFORMS to cpu: ask for the GPU explicitly)
if python3 -c 'import pytest' 2>/dev/null; then
  platforms=cpu
  python3 -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null \
    && platforms=cuda
  JAX_PLATFORMS=$platforms timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/test_numerics_*.py > "$OUT/pytest_numerics.txt" 2>&1
  rc=$?
  echo "pytest numerics on $platforms: rc=$rc, $(tail -1 "$OUT/pytest_numerics.txt")"
  [ "$rc" -eq 0 ] || status=1
else
  echo "pytest numerics: skipped (pytest not installed here)"
fi

# 2. device vs host vs oracle
timeout 180 python3 - "$OUT" <<'PYEOF' || status=1
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "tests")
import nvfp4_oracle as oracle  # noqa: E402
from nvfp4tool.numerics import (  # noqa: E402
    dequantize_nvfp4, fake_quantize_nvfp4, nvfp4_matmul, quantize_fp8, quantize_nvfp4, rht16)

out_dir = sys.argv[1]
device = jax.devices()[0]
host = jax.devices("cpu")[0]
has_gpu = device.platform == "gpu"
rows = []


def record(check, ok, detail):
    rows.append({"check": check, "ok": bool(ok), "detail": detail})


def run_on(dev, fn, *args):
    with jax.default_device(dev):
        return jax.tree.map(np.asarray, fn(*args))


def raw(a):
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def mismatched(a, b):
    return int((raw(a) != raw(b)).sum())


rng = np.random.default_rng(0)
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
for name, (x, kwargs) in cases.items():
    want = oracle.quantize(np.asarray(x), **kwargs)
    on_dev = run_on(device, lambda v: quantize_nvfp4(v, **kwargs), x)
    on_host = run_on(host, lambda v: quantize_nvfp4(v, **kwargs), x)
    bad_oracle = (mismatched(on_dev.packed, want["packed"])
                  + mismatched(on_dev.scales, want["scales"])
                  + mismatched(on_dev.global_amax, want["global_amax"]))
    bad_host = sum(mismatched(a, b)
                   for a, b in zip(jax.tree.leaves(on_dev), jax.tree.leaves(on_host)))
    fake = run_on(device, lambda v: fake_quantize_nvfp4(v, dtype=jnp.float32, **kwargs), x)
    deq = run_on(device, lambda v: dequantize_nvfp4(quantize_nvfp4(v, **kwargs)), x)
    bad_fake = mismatched(fake, deq)
    record(f"nvfp4 {name}", bad_oracle == bad_host == bad_fake == 0,
           f"bytes != oracle: {bad_oracle}, != host: {bad_host}, fake != deq(q): {bad_fake}")

big = jax.random.normal(jax.random.key(0), (1024, 4096), jnp.float32)
sr = [run_on(d, lambda v: quantize_nvfp4(v, rounding="stochastic", key=jax.random.key(3)), big)
      for d in (device, host)]
bad = sum(mismatched(a, b) for a, b in zip(jax.tree.leaves(sr[0]), jax.tree.leaves(sr[1])))
record("nvfp4 SR same key device vs host", bad == 0, f"mismatched bytes: {bad}")
for block in ("1d", "2d"):
    q = run_on(device, lambda v: quantize_nvfp4(v, block=block), big)
    q_host = run_on(host, lambda v: quantize_nvfp4(v, block=block), big)
    bad = sum(mismatched(a, b) for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(q_host)))
    x64 = np.asarray(big, np.float64)
    err = np.linalg.norm(np.asarray(run_on(device, dequantize_nvfp4, q), np.float64) - x64)
    record(f"nvfp4 {block} 1024x4096 device vs host", bad == 0,
           f"mismatched bytes: {bad}, rel L2 err {err / np.linalg.norm(x64):.4f}")

x8 = rng.standard_t(3, (256, 384)).astype(np.float32) * 10
for fmt in ("e4m3", "e5m2"):
    for gran in ("tensor", "channel", "block128", "block128x128"):
        a, b = (run_on(d, lambda v: quantize_fp8(v, fmt=fmt, granularity=gran), x8)
                for d in (device, host))
        bad = mismatched(a.data, b.data) + mismatched(a.scale, b.scale)
        record(f"fp8 {fmt} {gran} device vs host", bad == 0, f"mismatched bytes: {bad}")

xr = rng.standard_normal((64, 256)).astype(np.float32)
diff = np.abs(run_on(device, rht16, xr) - run_on(host, rht16, xr)).max()
record("rht16 device vs host", diff <= 1e-6, f"max |diff| {diff:.2e}")


def timed(fn, *args, runs=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


size = 8192 if has_gpu else 256
a_q = quantize_nvfp4(jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16))
b_q = quantize_nvfp4(jax.random.normal(jax.random.key(2), (size, size), jnp.bfloat16), block="2d")
emulated = jax.jit(lambda a, b: nvfp4_matmul(a, b, backend="emulated"))
t_emulated = timed(emulated, a_q, b_q)
flops = 2 * size**3
detail = f"{size}^3 emulated {flops / t_emulated / 1e12:.1f} TFLOP/s"
if has_gpu:
    native = jax.jit(lambda a, b: nvfp4_matmul(a, b, backend="native"))
    t_native = timed(native, a_q, b_q)
    out_e = np.asarray(emulated(a_q, b_q), np.float64)
    out_n = np.asarray(native(a_q, b_q), np.float64)
    rel = np.abs(out_n - out_e).max() / np.abs(out_e).max()
    detail += f", native {flops / t_native / 1e12:.1f} TFLOP/s, max |native-emulated|/max {rel:.2e}"
    record("nvfp4_matmul native vs emulated", rel <= 1e-5, detail)
else:
    record("nvfp4_matmul native vs emulated", True, detail + ", native skipped (no GPU)")

small = [quantize_nvfp4(rng.standard_normal((64, 256)).astype(np.float32)) for _ in range(2)]
out_dev = run_on(device, lambda a, b: nvfp4_matmul(a, b, backend="emulated"), *small)
a64, b64 = (np.asarray(dequantize_nvfp4(q), np.float64) for q in small)
bound = np.abs(a64) @ np.abs(b64).T
ok = np.all(np.abs(out_dev - a64 @ b64.T) <= 1e-6 * bound + 1e-30)
record("nvfp4_matmul emulated vs fp64 of dequantized", ok, "64x256 @ 64x256^T")

with open(f"{out_dir}/device_numerics.json", "w") as f:
    json.dump({"device": str(device), "jax": jax.__version__, "checks": rows}, f, indent=2)
print(f"{'check':<46} {'ok':<4} detail")
for row in rows:
    print(f"{row['check']:<46} {'yes' if row['ok'] else 'NO':<4} {row['detail']}")
sys.exit(0 if all(r["ok"] for r in rows) else 1)
PYEOF

# 3. quantize throughput
# shellcheck disable=SC2086
timeout 150 python3 scripts/bench_quantize.py ${BENCH_ARGS:-} --json "$OUT/bench_quantize.json" \
  2>&1 | tee "$OUT/bench_quantize.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# 4. (optional, TRAIN_BENCH=1: about 2 more minutes) train-step time of fp8/nvfp4 vs bf16
if [ "${TRAIN_BENCH:-0}" = "1" ]; then
  timeout 150 python3 scripts/bench_train_step.py --model 100m --vocab-size 32000 --seq-len 1024 \
    --batch-size 8 --json "$OUT/bench_train_step.json" 2>&1 | tee "$OUT/bench_train_step.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

echo "device_check: $([ "$status" -eq 0 ] && echo PASS || echo FAIL); details in $OUT"
exit "$status"
