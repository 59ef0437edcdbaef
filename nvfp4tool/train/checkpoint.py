"""Training checkpoints with Orbax's CheckpointManager: the whole train state plus a JSON record.

    <out>/checkpoints/<step>/state   params, opt_state, amax history, step (sharded arrays)
    <out>/checkpoints/<step>/meta    {"step", "seed", "batches_seen", "config": {...}}
    <out>/checkpoints/<step>/loader  the Grain iterator's state, one file per process

The data position is the number of batches drawn (`batches_seen`, and the loader's state, which a
checkpoint written before the loader lacks: the step stands in); the batch order and every step's
random key are pure functions of (seed, step), so a resumed run replays the exact stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from nvfp4tool.run.records import CHECKPOINTS_DIR


class Checkpoints:
    """Periodic/final checkpoints of one run folder."""

    def __init__(self, run_dir: str | Path, keep: int) -> None:
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(
            Path(run_dir).absolute() / CHECKPOINTS_DIR, options=options, item_names=("state", "meta", "loader")
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any], loader: Any = None) -> None:
        """Save `state`, `meta` and the position of `loader` (a Grain iterator; None: none)."""
        items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if loader is not None:
            items["loader"] = grain.checkpoint.CheckpointSave(loader)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any, loader: Any = None) -> tuple[Any, dict[str, Any], bool]:
        """(the state at `step`, laid out as `abstract_state` (jax.ShapeDtypeStruct with shardings),
        its meta, whether `loader` (a Grain iterator) was set to the saved position: False where the
        checkpoint holds none (written before the loader was saved) or no loader is given)."""
        items = {"state": ocp.args.StandardRestore(abstract_state), "meta": ocp.args.JsonRestore()}
        has_loader = loader is not None and (self._manager.directory / str(step) / "loader").is_dir()
        if has_loader:
            items["loader"] = grain.checkpoint.CheckpointRestore(loader)
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return restored["state"], restored["meta"], has_loader

    def close(self) -> None:
        self._manager.close()


def abstract_like(state: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
