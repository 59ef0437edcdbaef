"""The device mesh and how a model's weights, the train state and batches are laid out on it (JAX's
own sharding). Below the model (`weights`, `layerwise` place weights with it) and the trainer.

Mesh axes ("data", "fsdp") over `jax.devices()` (all processes' devices in multi-process runs).
Parameters and optimizer state: each array's largest axis that the fsdp size divides is sharded
over "fsdp" (fully sharded data parallel); everything else is replicated. Batches: the sequence
axis is sharded over both axes. Host data (numpy, identical on every process) becomes a global
array with `jax.make_array_from_callback`, so each process hands over only its own shards; a
training batch, of which each process reads only its own rows, with
`jax.make_array_from_process_local_data` (`from_process_rows`).
Outside training (validate, calibration: `model_mesh`) every device is on the fsdp axis and the
model's weights are laid out as the train state is (`shard`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4tool.errors import NVFP4ToolError

DATA_AXES = ("data", "fsdp")


def make_mesh(data: int = -1, fsdp: int = 1) -> Mesh:
    """A ("data", "fsdp") mesh over all devices; data=-1 takes what fsdp leaves."""
    devices = jax.devices()
    if data == -1:
        if len(devices) % fsdp:
            raise NVFP4ToolError(f"mesh: fsdp={fsdp} does not divide the {len(devices)} devices")
        data = len(devices) // fsdp
    if data * fsdp != len(devices):
        raise NVFP4ToolError(f"mesh: data={data} x fsdp={fsdp} != {len(devices)} devices")
    return Mesh(np.asarray(devices).reshape(data, fsdp), DATA_AXES)


def model_mesh() -> Mesh | None:
    """The mesh a model runs on outside training (validate, calibration, the sensitivity search):
    None on one device, else every device on the fsdp axis (data=1), the weights sharded as training
    shards them, so a model larger than one device's memory runs on several."""
    count = jax.device_count()
    return make_mesh(data=1, fsdp=count) if count > 1 else None


def shard(mesh: Mesh, tree: Any) -> Any:
    """Every array of `tree` on the mesh in the fsdp layout (`state_shardings`); a host array goes
    straight to its shards, never whole onto one device."""
    return jax.device_put(tree, state_shardings(mesh, tree))


def state_shardings(mesh: Mesh, abstract_state: Any) -> Any:
    """A NamedSharding for every leaf of the (abstract) train state."""
    fsdp = mesh.shape["fsdp"]

    def leaf_sharding(leaf) -> NamedSharding:
        shape = getattr(leaf, "shape", ())
        spec = [None] * len(shape)
        if fsdp > 1 and shape:
            for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
                if shape[axis] % fsdp == 0:
                    spec[axis] = "fsdp"
                    break
        return NamedSharding(mesh, P(*spec))

    return jax.tree.map(leaf_sharding, abstract_state)


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int) -> NamedSharding:
    """Shard axis `batch_axis` of an `ndim`-D batch over all devices."""
    spec = [None] * ndim
    spec[batch_axis] = DATA_AXES
    return NamedSharding(mesh, P(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def to_global(host_array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global jax.Array from a host array that every process holds whole."""
    host_array = np.asarray(host_array)
    return jax.make_array_from_callback(host_array.shape, sharding, lambda index: host_array[index])


def from_process_rows(local: np.ndarray, sharding: NamedSharding, global_shape: tuple[int, ...]) -> jax.Array:
    """A global jax.Array of `global_shape` from the rows this process holds (`process_rows`: what
    its devices take of it); one process holds the whole array (`to_global`)."""
    if jax.process_count() == 1:
        return to_global(local, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(local), global_shape)


def process_rows(sharding: NamedSharding, global_shape: tuple[int, ...], axis: int) -> np.ndarray:
    """The positions along `axis` of an array of `global_shape` that this process's devices hold
    under `sharding`, in order."""
    held: set[int] = set()
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        held.update(range(*index[axis].indices(global_shape[axis])))
    return np.asarray(sorted(held), np.int64)


def place_state(state: Any, shardings: Any) -> Any:
    """Move a host/one-device train state onto the mesh (every process holds the same values)."""
    return jax.tree.map(lambda x, s: to_global(np.asarray(x), s), state, shardings)


def check_divisible(batch_size: int, grad_accum: int, mesh: Mesh) -> None:
    micro = batch_size // grad_accum
    if micro % mesh.size:
        raise NVFP4ToolError(
            f"micro-batch of {micro} sequences (batch_size / grad_accum) is not a multiple of the {mesh.size} devices"
        )
