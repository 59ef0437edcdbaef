"""The bit-exact numerics files again, compiled with XLA's default code generation.

The suite compiles without XLA's LLVM passes to save time (conftest: `UNOPTIMIZED`). Users run
with those passes on, so the files whose assertions are bit for bit (the quantizers against the
slow oracle, the peers' bytes, the GEMM bodies) run once more here in a child with the flags the
suite started with and no compilation cache (`NVFP4TOOL_TESTS_XLA_DEFAULT=1`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import conftest
import pytest

from fixtures import REPO_ROOT

ROOT = Path(REPO_ROOT)
FILES = [
    "tests/numerics/test_numerics_nvfp4.py",
    "tests/numerics/test_numerics_gemm.py",
    "tests/numerics/test_peers_nvfp4.py",
]


@pytest.mark.slow
def test_the_bit_exact_numerics_pass_with_xla_default_code_generation():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    }
    env["XLA_FLAGS"] = conftest.XLA_FLAGS
    env["NVFP4TOOL_TESTS_XLA_DEFAULT"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES, "-x"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-2000:]
    probe = "import os, sys; sys.path.insert(0, 'tests'); import conftest; print(os.environ.get('XLA_FLAGS', ''))"
    flags = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert conftest.UNOPTIMIZED not in flags.stdout, flags.stdout  # the child really ran the defaults
