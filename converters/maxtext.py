"""MaxText (Orbax) checkpoints in and out, one parameter at a time, through `converters.layout`.

`MaxTextSource(path, model_config, rope_layout)`: a `TensorSource` with HF names (only `params/params`
leaves are read); `write_maxtext`: `<out>/0/items`, OCDBT + zarr3, uncompressed. `dtype="fp32"`
(default) stores bf16/fp32 values exactly; `dtype="bf16"` halves the size but rounds.
Design notes: docs/design/converters.md.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import re
import shutil
import weakref
from typing import Iterable, Iterator

import ml_dtypes  # noqa: F401 (registers bfloat16 / float8 / float4 with numpy)
import numpy as np

from converters import atomic, layout, maxtext_models
from converters.atomic import atomic_output_dir
from converters.tensor_source import TensorSource, check_against_config, check_finite
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
STEP = 0  # the step directory a converted checkpoint is written as: <out>/0/items
_CHUNK_BYTES = 64 * 2**20  # 64 MiB zarr chunks: reads of a big array never need it twice in memory
_METADATA_FILE = "_METADATA"  # Orbax's pytree metadata, inside the items directory
_STEP_METADATA_FILE = "_CHECKPOINT_METADATA"  # Orbax's step metadata (custom_metadata lives here)


class MaxTextSource:
    """TensorSource with HF names over a MaxText Orbax checkpoint (the families of `converters.layout`)."""

    def __init__(self, path: str | os.PathLike, model_config: ModelConfig, rope_layout: str) -> None:
        self._label = os.fspath(path)
        maxtext_models.check_family_rope_layout(model_config.family, rope_layout, self._label)
        self._items_dir, step_dir = resolve_items_dir(self._label)
        self.config = model_config
        self.rope_layout = rope_layout
        layout.check_supported(model_config, self._label)
        flags = _read_json(os.path.join(self._items_dir, _METADATA_FILE))
        self._use_ocdbt = bool(flags.get("use_ocdbt", True))
        self._use_zarr3 = bool(flags.get("use_zarr3", False))
        self.custom_metadata = _step_custom_metadata(step_dir)
        params = _params_tree(self._items_dir, self._label)
        self.scanned = _detect_scanned(params, layout.stack_names(model_config), self._label)
        self._meta: dict[tuple[str, ...], object] = {}  # key path -> Orbax ArrayMetadata
        self._index = self._build_index(params)
        self._handles: dict[tuple[str, ...], object] = {}
        self._restaged_handles: dict[tuple[str, ...], object] = {}
        self._scratch_dir: str | None = None  # re-chunked copies of stacks (see `_restaged`)
        self._ts_context = None

    @property
    def path(self) -> str:
        return self._label

    def names(self) -> list[str]:
        """HF names in table order (stack by stack for scanned checkpoints)."""
        return list(self._index)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[3]

    def dtype(self, name: str) -> str:
        return self._entry(name)[4]

    def get(self, name: str) -> np.ndarray:
        """One HF tensor; its stored values and the converted ones must be finite."""
        rule, layer, expert, _, dtype = self._entry(name)
        key, at = layout.placement(rule, self.config, scanned=self.scanned, layer=layer)
        where = f"{self._label}: parameter {_where(key)}"
        if expert is not None:
            where += f" expert {expert}"
        if at is not None:
            where += f" layer {layer}" if at == layer else f" index {at} (layer {layer})"
        axes = layout.sliced_axes(rule, scanned=at is not None)
        index = layout.slice_index(rule, scanned=at is not None, layer=at, expert=expert)
        y = self._read_slice(key, axes, index, where) if axes else self._read(key, where)
        check_finite(y, where)
        hf = layout.maxtext_to_hf(rule, y, self.config, self.rope_layout, dtype)
        check_finite(hf, where, after=f"after its conversion to HF tensor {name!r}")
        return hf

    # ------------------------------------------------------------------------------------ helpers

    def _entry(self, name: str):
        try:
            return self._index[name]
        except KeyError:
            raise NVFP4ToolError(f"{self._label}: no tensor {name!r}") from None

    def _build_index(self, params: dict) -> dict[str, tuple]:
        """HF name -> (rule, layer, expert, HF shape, dtype); every parameter present with the
        config's shape, and none the config does not describe."""
        config = self.config
        hf_shapes = config.expected_tensor_shapes()
        index: dict[str, tuple] = {}
        for rule in layout.rules_for(config):
            layers = layout.layers_of(rule, config)
            for layer in layers:
                key, _ = layout.placement(rule, config, scanned=self.scanned, layer=layer)
                want = layout.maxtext_shape(rule, config, scanned=self.scanned, layer=layer)
                meta = _lookup(params, key)
                where = _where(key)
                if meta is None:
                    raise NVFP4ToolError(
                        f"{self._label}: parameter {where} missing (the {config.family} config expects it)"
                    )
                got = tuple(meta.shape)
                if got != want:
                    raise NVFP4ToolError(
                        f"{self._label}: parameter {where} has shape {list(got)}, the model config expects {list(want)}"
                    )
                dtype = np.dtype(meta.dtype).name
                if dtype not in ("float32", "bfloat16", "float16"):
                    raise NVFP4ToolError(f"{self._label}: parameter {where} has dtype {dtype}; expected a float type")
                for expert in layout.experts_of(rule, config):
                    name = layout.hf_name(rule, layer, expert)
                    index[name] = (rule, layer, expert, hf_shapes[name], dtype)
                self._meta[key] = meta
        extra = sorted(set(_leaf_paths(params)) - set(self._meta))
        if extra:  # e.g. logits_dense with a tied config, or more layers than the config has
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise NVFP4ToolError(
                f"{self._label}: parameter {_where(extra[0])}{more} is not part of the model the config describes"
            )
        return index

    def _open(self, key: tuple[str, ...]):
        if key not in self._handles:
            import orbax.checkpoint as ocp
            import tensorstore as ts

            if self._ts_context is None:
                self._ts_context = ocp.type_handlers.get_ts_context(use_ocdbt=self._use_ocdbt)
            # Orbax's metadata names each array (its key path joined with dots).
            name = getattr(self._meta[key], "name", None) or ".".join(layout.PARAMS_PREFIX + key)
            if self._use_ocdbt:
                kvstore = {"driver": "ocdbt", "base": f"file://{self._items_dir}", "path": name}
            else:
                kvstore = {"driver": "file", "path": os.path.join(self._items_dir, name)}
            spec = {"driver": "zarr3" if self._use_zarr3 else "zarr", "kvstore": kvstore}
            try:
                self._handles[key] = ts.open(spec, open=True, read=True, context=self._ts_context).result()
            except ValueError as err:
                raise NVFP4ToolError(
                    f"{self._label}: cannot open parameter {_where(key)}: {_first_line(err)}"
                ) from None
        return self._handles[key]

    def _read(self, key: tuple[str, ...], where: str) -> np.ndarray:
        return _fetch(self._open(key), where)

    def _read_slice(self, key: tuple[str, ...], axes: tuple[int, ...], index: tuple, where: str) -> np.ndarray:
        """One HF tensor's slice (`index`, taking one index along each of `axes`) of a stack."""
        handle = self._open(key)
        chunk = handle.chunk_layout.read_chunk.shape
        if any(chunk[axis] != 1 for axis in axes):
            handle = self._restaged(key, axes, where)
        return _fetch(handle[index], where)

    def _restaged(self, key: tuple[str, ...], axes: tuple[int, ...], where: str):
        """A scratch copy of an array whose chunks span layers or experts (`axes`), re-chunked
        one index of each of `axes` per chunk.

        Each such array is read whole once (one stored array in memory) and written to the
        scratch folder, so reads in any order cost one HF tensor, not the whole array.
        """
        if key not in self._restaged_handles:
            import tensorstore as ts

            if self._scratch_dir is None:
                self._scratch_dir = atomic.scratch_dir("nvfp4tool-maxtext-")
                weakref.finalize(self, shutil.rmtree, self._scratch_dir, True)
            stacked = self._read(key, where)
            chunk = [1 if axis in axes else n for axis, n in enumerate(stacked.shape)]
            spec = {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": os.path.join(self._scratch_dir, ".".join(key))},
                "metadata": {
                    "shape": list(stacked.shape),
                    "data_type": stacked.dtype.name,
                    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
                },
            }
            copy = ts.open(spec, create=True).result()
            copy.write(stacked, can_reference_source_data_indefinitely=True).result()
            del stacked
            self._restaged_handles[key] = copy
        return self._restaged_handles[key]


def write_maxtext(
    out_dir: str | os.PathLike,
    config: ModelConfig,
    source: TensorSource,
    *,
    scan_layers: bool = True,
    rope_layout: str,
    dtype: str = "fp32",
    force: bool = False,
    inputs: Iterable[str | os.PathLike] = (),
    flag: str = "output",
) -> str:
    """Write `source` (HF names) as a MaxText checkpoint; return `<out_dir>/0/items`.

    Every stored array must be finite (a value the cast or the query scale overflows is an error,
    nothing written); `inputs` (the folders the source reads) must not overlap `out_dir`, which
    messages call `flag` (see `converters.atomic`).
    """
    out_dtype = DTYPES.get(dtype)
    if out_dtype is None:
        raise NVFP4ToolError(f"MaxText dtype {dtype!r} unsupported; supported: fp32, bf16")
    layout.check_supported(config, source.path)
    maxtext_models.check_family_rope_layout(config.family, rope_layout, source.path)
    ignore = ("lm_head.weight",) if config.tie_word_embeddings else ()
    check_against_config(source, config.expected_tensor_shapes(), ignore_extra=ignore, config=config)
    if rope_layout not in layout.ROPE_LAYOUTS:
        raise NVFP4ToolError(f"RoPE layout {rope_layout!r} unknown; supported: {', '.join(layout.ROPE_LAYOUTS)}")
    import orbax.checkpoint as ocp

    leaves = _plan_leaves(config, scan_layers, out_dtype)
    budget = max(nbytes for *_, nbytes in leaves)
    with atomic_output_dir(out_dir, force, inputs=inputs, flag=flag) as tmp_dir:
        items_dir = _save_skeleton(ocp, tmp_dir, scan_layers)
        scratch = os.path.join(tmp_dir, ".leaves")
        tree_metadata = _read_json(os.path.join(items_dir, _METADATA_FILE))
        for group_index, group in enumerate(_groups(leaves, budget), start=1):
            tree, save_args = {}, {}
            for rule, layers, key, shape, _ in group:
                array = _build_leaf(source, config, rule, layers, shape, out_dtype, rope_layout)
                stacked = layers[0][0] is not None
                _set(tree, layout.PARAMS_PREFIX + key, array.view(_Borrowed))
                del array  # the tree holds it now; dropped with the tree once saved
                _set(
                    save_args,
                    layout.PARAMS_PREFIX + key,
                    ocp.SaveArgs(chunk_byte_size=_CHUNK_BYTES, shard_axes=layout.sliced_axes(rule, scanned=stacked)),
                )
            _save_group(
                ocp, tree, save_args, os.path.join(scratch, str(group_index)), items_dir, group_index, tree_metadata
            )
            del tree, save_args
        shutil.rmtree(scratch)
        with open(os.path.join(items_dir, _METADATA_FILE), "w", encoding="utf-8") as f:
            json.dump(tree_metadata, f)
        _merge_ocdbt(ocp, items_dir)
    _release_freed_memory()
    return os.path.join(os.fspath(out_dir), str(STEP), "items")


def resolve_items_dir(path: str) -> tuple[str, str | None]:
    """(items dir, step dir or None) for `<base>/<step>/items`, `<base>/<step>` or `<base>`."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, _METADATA_FILE)):
        parent = os.path.dirname(path)
        return path, parent if os.path.isfile(os.path.join(parent, _STEP_METADATA_FILE)) else None
    if os.path.isfile(os.path.join(path, "items", _METADATA_FILE)):
        return os.path.join(path, "items"), path
    steps = sorted(
        (int(d), d)
        for d in (os.listdir(path) if os.path.isdir(path) else [])
        if re.fullmatch(r"\d+", d) and os.path.isfile(os.path.join(path, d, "items", _METADATA_FILE))
    )
    if steps:
        step_dir = os.path.join(path, steps[-1][1])
        return os.path.join(step_dir, "items"), step_dir
    raise NVFP4ToolError(
        f"{path}: not a MaxText/Orbax checkpoint (no items/{_METADATA_FILE} in it, "
        f"in <step>/items, or in the step directories under it)"
    )


def is_maxtext_checkpoint(path: str) -> bool:
    try:
        resolve_items_dir(path)
    except NVFP4ToolError:
        return False
    return True


# ---------------------------------------------------------------------------------------- helpers


class _Borrowed(np.ndarray):
    """A view Orbax's numpy handler saves without its defensive deep copy (we never mutate it
    while the synchronous save runs), which keeps a save at one extra copy (the encoded chunks)."""

    def __deepcopy__(self, memo):
        return self


def _plan_leaves(config: ModelConfig, scanned: bool, out_dtype: str) -> list[tuple]:
    """(rule, layers, key path, shape, nbytes) for every stored parameter, in table order; `layers`:
    the model layers of a stack in stack order, or [(None, layer)] for one unstacked parameter
    (each entry: (index on the layer axis or None, model layer or None))."""
    itemsize = np.dtype(out_dtype).itemsize
    leaves = []
    for rule in layout.rules_for(config):
        by_key: dict[tuple[str, ...], list[tuple[int | None, int | None]]] = {}
        for layer in layout.layers_of(rule, config):
            key, at = layout.placement(rule, config, scanned=scanned, layer=layer)
            by_key.setdefault(key, []).append((at, layer))
        for key, layers in by_key.items():
            shape = layout.maxtext_shape(rule, config, scanned=scanned, layer=layers[0][1])
            leaves.append((rule, layers, key, shape, int(np.prod(shape)) * itemsize))
    return leaves


def _groups(leaves: list[tuple], budget: int) -> Iterator[list[tuple]]:
    """Consecutive leaves, each group at most `budget` bytes (a bigger leaf goes alone)."""
    group, used = [], 0
    for leaf in leaves:
        if group and used + leaf[-1] > budget:
            yield group
            group, used = [], 0
        group.append(leaf)
        used += leaf[-1]
    if group:
        yield group


def _build_leaf(
    source: TensorSource,
    config: ModelConfig,
    rule: layout.Rule,
    layers: list[tuple[int | None, int | None]],
    shape: tuple[int, ...],
    out_dtype: str,
    rope_layout: str,
) -> np.ndarray:
    """The stored array of one parameter (`layers`: `_plan_leaves`'); a scanned stack or an experts
    array is filled one source tensor (layer, expert) at a time. Each converted tensor must be finite."""
    stacked = layers[0][0] is not None
    if not layout.sliced_axes(rule, scanned=stacked):
        return _converted(source, config, rule, layers[0][1], None, rope_layout, out_dtype)
    array = np.empty(shape, dtype=out_dtype)
    for at, layer in layers:
        for e in layout.experts_of(rule, config):
            index = layout.slice_index(rule, scanned=stacked, layer=at, expert=e)
            array[index] = _converted(source, config, rule, layer, e, rope_layout, out_dtype)
    return array


def _converted(
    source: TensorSource,
    config: ModelConfig,
    rule: layout.Rule,
    layer: int | None,
    expert: int | None,
    rope_layout: str,
    out_dtype: str,
) -> np.ndarray:
    name = layout.hf_name(rule, layer, expert)
    y = layout.hf_to_maxtext(rule, source.get(name), config, rope_layout, out_dtype)
    check_finite(y, f"{source.path}: tensor {name!r}", after=f"as stored in MaxText ({out_dtype})")
    return y


def _save_skeleton(ocp, base_dir: str, scan_layers: bool) -> str:
    """Orbax's own step layout (step metadata with custom_metadata, items with `step`)."""
    manager = ocp.CheckpointManager(
        base_dir,
        item_names=("items",),
        item_handlers={"items": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)},
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    )
    manager.save(
        STEP,
        args=ocp.args.Composite(items=ocp.args.PyTreeSave({"step": np.int32(STEP)})),
        custom_metadata={"scan_layers": bool(scan_layers)},
    )
    manager.wait_until_finished()
    manager.close()
    return os.path.join(base_dir, str(STEP), "items")


def _save_group(
    ocp, tree: dict, save_args: dict, scratch_dir: str, items_dir: str, index: int, tree_metadata: dict
) -> None:
    """Save one group with Orbax, move its OCDBT database in as process `index`, keep its metadata."""
    checkpointer = ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False)
    )  # zstd: 5x slower to save, 4x to load
    checkpointer.save(scratch_dir, args=ocp.args.PyTreeSave(tree, save_args=save_args))
    checkpointer.close()
    process_dir = os.path.join(scratch_dir, "ocdbt.process_0")
    if not os.path.isdir(process_dir):  # pragma: no cover - an Orbax layout change
        raise NVFP4ToolError(f"{scratch_dir}: Orbax wrote no ocdbt.process_0; cannot assemble the checkpoint")
    os.rename(process_dir, os.path.join(items_dir, f"ocdbt.process_{index}"))
    group_metadata = _read_json(os.path.join(scratch_dir, _METADATA_FILE))
    for flag in ("use_ocdbt", "use_zarr3"):
        if group_metadata.get(flag) != tree_metadata.get(flag):  # pragma: no cover
            raise NVFP4ToolError(
                f"{scratch_dir}: Orbax wrote {flag}={group_metadata.get(flag)}, the step has {tree_metadata.get(flag)}"
            )
    tree_metadata["tree_metadata"].update(group_metadata["tree_metadata"])
    shutil.rmtree(scratch_dir)
    _release_freed_memory()


def _release_freed_memory() -> None:
    """Hand memory freed by the last save back to the OS (glibc keeps freed blocks of Orbax's
    worker-thread arenas otherwise, and the next stack would be allocated on top of them)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _merge_ocdbt(ocp, items_dir: str) -> None:
    from etils import epath

    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    asyncio.run(
        ocp.type_handlers.merge_ocdbt_per_process_files(epath.Path(items_dir), ts_context=context, use_zarr3=True)
    )


def _params_tree(items_dir: str, label: str) -> dict:
    """The `params/params` subtree of Orbax's metadata tree (leaves carry name, shape and dtype)."""
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(items_dir))
    except (ValueError, FileNotFoundError, OSError, TypeError) as err:
        raise NVFP4ToolError(f"{label}: cannot read the Orbax tree metadata: {_first_line(err)}") from None
    tree = getattr(metadata, "tree", metadata)
    params = tree.get("params", {}).get("params") if isinstance(tree, dict) else None
    if not isinstance(params, dict):
        raise NVFP4ToolError(f"{label}: no params/params in the checkpoint tree (not a MaxText TrainState checkpoint)")
    return params


def _detect_scanned(params: dict, stacks: list[str], label: str) -> bool:
    """Whether the checkpoint stacks the layers of the model's first MaxText layer stack `stacks[0]`."""
    decoder = params.get("decoder")
    if not isinstance(decoder, dict):
        raise NVFP4ToolError(f"{label}: parameter params/params/decoder missing")
    if stacks[0] in decoder or layout.REMAINDER_LAYERS.split("/")[1] in decoder:  # blocks: maybe no whole one
        return True
    if f"{stacks[0]}_0" in decoder:
        return False
    raise NVFP4ToolError(
        f"{label}: neither params/params/decoder/{stacks[0]} (scanned) nor decoder/{stacks[0]}_0 (unscanned) "
        "is in the checkpoint"
    )


def _fetch(view, where: str) -> np.ndarray:
    """Read a tensorstore view; a corrupted or truncated chunk is one line naming the array."""
    try:
        return np.asarray(view.read().result())
    except (ValueError, OSError) as err:
        raise NVFP4ToolError(
            f"{where} cannot be read (corrupted or truncated checkpoint data: {_first_line(err)})"
        ) from None


def _first_line(err: Exception) -> str:
    """The first line of a (tensorstore) message, without its spec and source-location suffixes."""
    text = str(err).strip()
    return (
        re.split(r" \[(?:source locations|tensorstore_spec)=", text.splitlines()[0])[0] if text else type(err).__name__
    )


def _where(key: tuple[str, ...]) -> str:
    return "/".join(layout.PARAMS_PREFIX + key)


def _lookup(tree: dict, key: tuple[str, ...]):
    node = tree
    for part in key:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return None if isinstance(node, dict) else node


def _leaf_paths(tree: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaf_paths(v, prefix + (k,))
        else:
            yield prefix + (k,)


def _set(tree: dict, key: tuple[str, ...], value) -> None:
    for part in key[:-1]:
        tree = tree.setdefault(part, {})
    tree[key[-1]] = value


def _step_custom_metadata(step_dir: str | None) -> dict:
    if step_dir is None:
        return {}
    path = os.path.join(step_dir, _STEP_METADATA_FILE)
    if not os.path.isfile(path):
        return {}
    return _read_json(path).get("custom_metadata") or {}


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as err:  # ValueError: invalid JSON or UTF-8
        raise NVFP4ToolError(f"{path}: cannot read Orbax metadata ({err})") from None
    if not isinstance(value, dict):
        raise NVFP4ToolError(f"{path}: Orbax metadata is a JSON {type(value).__name__}, not an object")
    return value
