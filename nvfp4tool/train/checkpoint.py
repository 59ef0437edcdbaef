"""Training checkpoints with Orbax's CheckpointManager: the whole train state plus a JSON record.

    <out>/checkpoints/<step>/state   params, opt_state, amax history, step (sharded arrays)
    <out>/checkpoints/<step>/meta    {"step", "seed", "batches_seen", "config": {...}}

The data position is the number of batches drawn (`batches_seen`); the batch order and every
step's random key are pure functions of (seed, step), so a resumed run replays the exact stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from nvfp4tool.run.records import CHECKPOINTS_DIR


class Checkpoints:
    """Periodic/final checkpoints of one run folder."""

    def __init__(self, run_dir: str | Path, keep: int) -> None:
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(
            Path(run_dir).absolute() / CHECKPOINTS_DIR, options=options, item_names=("state", "meta")
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        self._manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
        )
        self._manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """The state at `step`, laid out as `abstract_state` (jax.ShapeDtypeStruct with shardings)."""
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        )
        return restored["state"], restored["meta"]

    def close(self) -> None:
        self._manager.close()


def abstract_like(state: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
