"""The one interface every checkpoint reader offers: HF-named tensors, loaded one at a time.

Names are Hugging Face tensor names (`model.layers.3.self_attn.q_proj.weight`), weights in HF
orientation `[out_features, in_features]`. Readers (HF folder, MaxText/Orbax, an in-memory dict)
implement `TensorSource`; writers and `model_from_tensors` consume it. `get` loads ONE tensor, so a
consumer that handles tensors one by one holds at most one in memory. bfloat16 tensors come back as
numpy arrays of dtype `ml_dtypes.bfloat16`; `dtype(name)` is the numpy/ml_dtypes name
("bfloat16", "float32", "float16", "uint8", ...).
"""

from __future__ import annotations

from typing import Mapping, Protocol, runtime_checkable

import ml_dtypes  # noqa: F401 (registers bfloat16 / float8 / float4 with numpy)
import numpy as np

from nvfp4tool.errors import NVFP4ToolError

WEIGHT_DTYPES = ("float64", "float32", "float16", "bfloat16")  # what a model weight may be stored as
FLOAT8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")  # the scales of exports
_CHECK_CHUNK_ELEMENTS = 1 << 22  # check_finite holds a bool mask of at most this many elements


@runtime_checkable
class TensorSource(Protocol):
    """Read-only, lazily loaded collection of named tensors."""

    @property
    def path(self) -> str:
        """Where the tensors come from, for messages (a folder, a file, "<memory>")."""
        ...

    def names(self) -> list[str]:
        """All tensor names, in a stable order (the checkpoint's canonical order when it has one)."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape without loading the data."""
        ...

    def dtype(self, name: str) -> str:
        """numpy/ml_dtypes dtype name without loading the data, e.g. "bfloat16"."""
        ...

    def get(self, name: str) -> np.ndarray:
        """Load one tensor (a fresh or read-only array; callers must not mutate it)."""
        ...


class DictTensorSource:
    """A `TensorSource` over an in-memory dict (tests, and results computed in memory)."""

    def __init__(self, tensors: Mapping[str, np.ndarray], path: str = "<memory>") -> None:
        self._tensors = {name: np.asarray(t) for name, t in tensors.items()}
        self._path = path

    @property
    def path(self) -> str:
        return self._path

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._lookup(name).shape)

    def dtype(self, name: str) -> str:
        return self._lookup(name).dtype.name

    def get(self, name: str) -> np.ndarray:
        return self._lookup(name)

    def _lookup(self, name: str) -> np.ndarray:
        try:
            return self._tensors[name]
        except KeyError:
            raise NVFP4ToolError(f"{self._path}: no tensor {name!r}") from None


def tensor_bytes(source: TensorSource, name: str) -> int:
    """Bytes of one tensor as stored (from its shape and dtype, without loading it)."""
    return int(np.prod(source.shape(name))) * np.dtype(source.dtype(name)).itemsize


def check_finite(array: np.ndarray, where: str, *, after: str = "") -> None:
    """NVFP4ToolError unless every value of a floating `array` is finite (other dtypes pass).

    `where` names the file and tensor ("ckpt: tensor 'x'"); `after` says what produced the values
    ("after the cast to bfloat16"). Checked in slices along the first axis, so the mask it builds
    stays small whatever the tensor's size and layout.
    """
    if array.dtype.name not in WEIGHT_DTYPES + FLOAT8_DTYPES:
        return
    rows = array.reshape(1) if array.ndim == 0 else array
    step = max(1, _CHECK_CHUNK_ELEMENTS // max(1, rows[0].size))
    bad, first = 0, None
    for start in range(0, len(rows), step):
        finite = np.isfinite(rows[start : start + step])
        if finite.all():
            continue
        bad += finite.size - int(np.count_nonzero(finite))
        if first is None:
            index = np.unravel_index(int(np.argmin(finite)), finite.shape)
            first = (index[0] + start, *index[1:])[: array.ndim]
    if bad:
        raise NVFP4ToolError(
            f"{where} has {bad} non-finite value{'s' if bad > 1 else ''} (NaN or inf)"
            f"{' ' + after if after else ''}, e.g. {float(array[first])} at index "
            f"{[int(i) for i in first]}"
        )


def check_against_config(
    source: TensorSource,
    expected: Mapping[str, tuple[int, ...]],
    *,
    ignore_extra: tuple[str, ...] = (),
    config_dtype: str | None = None,
    config=None,
) -> None:
    """Raise NVFP4ToolError unless `source` holds exactly the `expected` names with those shapes,
    each in a floating dtype (`WEIGHT_DTYPES`).

    `expected` is `ModelConfig.expected_tensor_shapes()`; names in `ignore_extra` may be present
    without being expected (e.g. a tied `lm_head.weight` some checkpoints still store). With
    `config_dtype` (the dtype config.json declares), a float16 tensor in a bfloat16 model or the
    reverse is refused: the two have the same size, so such a tensor is a relabelled header.
    With `config` (the `ModelConfig` `expected` is of), names that are not the expected ones are
    first put to its family (`Family.tensors_contradiction`): a config.json key the tensors
    contradict is named as the cause, not the tensors it makes missing.
    """
    present = set(source.names())
    missing = [n for n in expected if n not in present]
    if config is not None and (missing or present - set(expected) - set(ignore_extra)):
        contradiction = config.family_spec.tensors_contradiction(config, present)
        if contradiction is not None:
            raise NVFP4ToolError(f"{source.path}: {contradiction}")
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise NVFP4ToolError(f"{source.path}: tensor {missing[0]!r} missing{more}; the config expects it")
    extra = sorted(present - set(expected) - set(ignore_extra))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise NVFP4ToolError(
            f"{source.path}: unexpected tensor {extra[0]!r}{more}; not part of the model the config describes"
        )
    for name, want in expected.items():
        got = tuple(source.shape(name))
        if got != tuple(want):
            raise NVFP4ToolError(
                f"{source.path}: tensor {name!r} has shape {list(got)}, the config expects {list(want)}"
            )
        dtype = source.dtype(name)
        if dtype not in WEIGHT_DTYPES:
            raise NVFP4ToolError(
                f"{source.path}: tensor {name!r} has dtype {dtype}, the config "
                f"expects a floating-point weight ({', '.join(WEIGHT_DTYPES)})"
            )
        if {dtype, config_dtype} == {"float16", "bfloat16"}:
            raise NVFP4ToolError(
                f"{source.path}: tensor {name!r} is {dtype} but config.json declares "
                f"{config_dtype} (a relabelled header?)"
            )
