"""Shared pytest setup: force JAX onto the CPU with exact fp32 matmuls, compile without XLA's
backend (LLVM) optimization passes, release each module's compiled programs when it ends, common
fixtures."""

import contextlib
import gc
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Compiling dominates the suite on a CPU (XLA's compilation: ~70% of a tiny 3-step NVFP4 train
# run). Without the LLVM passes that run takes 51 s of CPU time instead of 89 s (its losses agree to
# ~6e-5 relative); the HLO passes (fusion, buffer assignment, sharding) still run. Set in the
# environment, so the children tests start inherit it. The memory benches measure with the default
# (`default_xla_backend`): their big models spend their time running.
# `NVFP4TOOL_TESTS_XLA_DEFAULT=1` keeps XLA's defaults: test_numerics_default_flags.py
# reruns the bit-exact numerics files that way, so code generation with the LLVM passes stays tested.
UNOPTIMIZED = "--xla_backend_optimization_level=0"
XLA_DEFAULT = os.environ.get("NVFP4TOOL_TESTS_XLA_DEFAULT") == "1"
# The flags the suite was started with, kept in the environment: pytest-xdist's workers inherit the
# controller's environment, where this file has already added UNOPTIMIZED.
XLA_FLAGS = os.environ.setdefault("NVFP4TOOL_TESTS_ORIGINAL_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
if not XLA_DEFAULT and UNOPTIMIZED not in XLA_FLAGS.split():
    os.environ["XLA_FLAGS"] = f"{XLA_FLAGS} {UNOPTIMIZED}".strip()

# One persistent compilation cache (JAX's own) shared by the workers and the children they start:
# the suite compiles the same programs in many modules (the tiny presets' train steps, validation's
# passes), and each module's in-memory programs are dropped when it ends (below). The cache key
# holds the program, the XLA flags and the backend, so a hit is the program a compile would give.
# The memory benches' children run without it (`default_xla_backend`): their peaks include compiling.
# `NVFP4TOOL_TESTS_JAX_CACHE=` (empty) turns it off; by default it lives in the system's temp folder.
JAX_CACHE = os.environ.setdefault(
    "NVFP4TOOL_TESTS_JAX_CACHE", os.path.join(tempfile.gettempdir(), f"nvfp4tool-tests-jax-cache-{os.getuid()}")
)
CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": JAX_CACHE,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
if JAX_CACHE:
    os.environ.update(CACHE_ENV)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402

# The schedule (longest recorded files first), the time limit of a test not marked slow and
# `--record-durations` (tests/fixtures/schedule.py); the session-wide fixtures of the helpers.
pytest_plugins = (
    "fixtures.schedule",
    "fixtures.backend_fixtures",
    "fixtures.chat_fixtures",
    "fixtures.eval_fixtures",
    "fixtures.hf_fixtures",
    "fixtures.mixed_fixtures",
    "fixtures.train_fixtures",
    "fixtures.conformance_fixtures",  # after train_fixtures, which it imports
)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs when a test module ends. Every XLA:CPU executable JAX keeps
    holds its own memory mappings: one module's runs of the train command left 8,754 mappings in
    the process, 1,185 after `jax.clear_caches()`. Kept for the whole suite they passed the
    kernel's limit (`vm.max_map_count`, 65,530), and the next compilation crashed the process
    (a segfault, once an abort, inside XLA at 92% of the suite)."""
    yield
    jax.clear_caches()
    gc.collect()


@contextlib.contextmanager
def default_xla_backend():
    """The children started inside run with the XLA_FLAGS the suite was started with (the LLVM
    passes on) and no compilation cache: for the memory benches, whose peaks must be those of a
    plain run (their measured runs are big models, not compilation), and for the quickstart's
    end-to-end run, whose 250 training steps are run time (162 s of CPU instead of 272 s)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in CACHE_ENV:
            patch.delenv(name, raising=False)
        if XLA_FLAGS:
            patch.setenv("XLA_FLAGS", XLA_FLAGS)
        else:
            patch.delenv("XLA_FLAGS", raising=False)
        yield


@pytest.fixture(scope="session")
def pristine(tmp_path_factory):
    """The adversarial corpus's read-only originals (`adversarial_harness.build_pristine`), built
    once for `test_adversarial.py` and its friends; a module may define its own `pristine`."""
    from fixtures.adversarial_harness import build_pristine

    return build_pristine(tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """A token to (never) leak, Xet off, and no request to huggingface.co (see test_push.hub_env)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _detect_agent

    monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    from fixtures.adversarial_harness import TOKEN

    monkeypatch.setenv("HF_TOKEN", TOKEN)
