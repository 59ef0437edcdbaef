"""How much memory there is, how much this process has used, and whether a model fits (`--offload`).

`peak_rss_bytes()`, `release()`, `available_bytes()` (bytes: host MemAvailable, or every accelerator's
free memory); `choose_offload("never" | "always" | "auto", weights=, working=, what=, devices=)`
decides whether a model is held whole or streamed layer by layer, and says why.
Design notes: docs/design/memory.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource

import jax

from nvfp4tool import progress
from nvfp4tool.errors import NVFP4UsageError

OFFLOAD_MODES = ("auto", "never", "always")
HEADROOM = 0.8  # auto holds a model when it needs at most this share of the available memory


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux VmHWM; getrusage elsewhere)."""
    peak = _proc_bytes("/proc/self/status", "VmHWM:")
    return peak if peak is not None else int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def release() -> None:
    """Collect garbage (a model's arrays may sit in reference cycles) and hand the memory the C
    allocator keeps after frees back to the system (glibc `malloc_trim`; elsewhere nothing), so that
    the next model starts where the last one did instead of on top of its freed pages."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass


def available_bytes() -> int:
    """Memory a new allocation can use now: the accelerators' free memory (summed: a model is
    sharded over all of them), else the host's MemAvailable."""
    if jax.default_backend() != "cpu":
        free = 0
        for device in jax.local_devices():
            stats = device.memory_stats() or {}
            free += int(stats.get("bytes_limit", 0)) - int(stats.get("bytes_in_use", 0))
        if free > 0:
            return free
    available = _proc_bytes("/proc/meminfo", "MemAvailable:")
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def choose_offload(
    mode: str, *, weights: int, working: int, what: str, devices: int = 1, streamed: int | None = None
) -> bool:
    """True to stream `what` layer by layer. `weights`: its bytes as stored, sharded over `devices`
    (`model.sharding.model_mesh`: each holds 1/devices of them); `working`: what a forward needs besides
    the weights, on every device (activations are replicated). Held costs weights + devices x working
    in all, compared with `available_bytes` (the sum over the accelerators, or the host's memory that
    host devices share): per accelerator, weights / devices + working against its free memory.
    `streamed`: the caller's estimate of a streamed run's peak, said beside it when given."""
    if mode not in OFFLOAD_MODES:
        raise NVFP4UsageError(f"--offload {mode}: expected one of {', '.join(OFFLOAD_MODES)}")
    if mode != "auto":
        return mode == "always"
    need = weights + devices * working
    available = available_bytes()
    stream = need > HEADROOM * available
    over = f" over {devices} devices" if devices > 1 else ""
    also = "" if streamed is None else f" ({streamed / 1e9:.2f} GB streamed)"
    progress.info(
        f"--offload auto: {what} needs {need / 1e9:.2f} GB held{over}{also}, {available / 1e9:.2f} GB "
        f"available -> {'streaming it layer by layer' if stream else 'holding it in memory'}"
    )
    return stream


def _proc_bytes(path: str, key: str) -> int | None:
    """A "key: N kB" line of a Linux /proc file in bytes (None where there is no such file or line)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
