"""`nvfp4tool convert`: open the source (`nvfp4tool.checkpoints`), dispatch to the writer, summarise.
The convert stage sits with the other stages, above the opener; `converters/` below it holds only
the checkpoint formats it writes with (`converters.hf`, `converters.maxtext`).

Directions: HF -> MaxText, MaxText -> HF, and HF -> HF (reshard / change dtype). Every tensor goes
through a `TensorSource` one at a time; the output is written into a temporary sibling folder and
renamed into place, so a failure leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from converters import layout
from converters.atomic import check_output_path
from converters.hf import write_hf_folder
from converters.maxtext import write_maxtext
from converters.tensor_source import TensorSource
from nvfp4tool import progress
from nvfp4tool.checkpoints import open_checkpoint
from nvfp4tool.errors import NVFP4UsageError

FORMATS = ("hf", "maxtext")
OUTPUT_DTYPES = ("bf16", "fp32")  # --dtype: what every floating tensor is cast to


@dataclasses.dataclass(frozen=True)
class ConvertSummary:
    """What one conversion did."""

    source_format: str  # "hf" | "maxtext"
    target_format: str
    tensors: int  # HF tensors converted
    parameters: int  # model parameters (tied embeddings once)
    bytes_written: int  # size of the output folder on disk
    seconds: float  # wall time of read + transform + write

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / 1e9 / max(self.seconds, 1e-9)

    def line(self) -> str:
        return (
            f"converted {self.source_format} -> {self.target_format}: {self.tensors} tensors, "
            f"{self.parameters:,} parameters, {self.bytes_written / 1e9:.3f} GB in "
            f"{self.seconds:.2f} s ({self.gb_per_s:.3f} GB/s)"
        )


def convert_checkpoint(
    src: str,
    dst: str,
    *,
    to: str,
    model_config: str | None = None,
    scan_layers: bool = True,
    rope_layout: str | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    force: bool = False,
) -> ConvertSummary:
    """Convert checkpoint `src` into `dst` in format `to` ("hf" | "maxtext").

    `src` is opened by `nvfp4tool.checkpoints.open_checkpoint` (an HF folder, a MaxText checkpoint
    or a training run's final weights). model_config: an HF config.json, an HF folder, or a MaxText
    model name (see `converters.maxtext_models`); required for a MaxText source, optional for an
    HF one (whose config.json is used; a MaxText name then also picks the RoPE layout and must
    match it). rope_layout: "interleaved" | "half"; defaults to the MaxText name's layout.
    dtype: "bf16" | "fp32". MaxText output: default fp32 (MaxText's weight dtype). HF output:
    default the model config's dtype from MaxText, each tensor's own dtype from HF.
    Each tensor read advances a "convert" progress task (`nvfp4tool.progress`).
    """
    if to not in FORMATS:
        raise NVFP4UsageError(f"--to must be one of {', '.join(FORMATS)}, got {to!r}")
    if dtype not in (None, *OUTPUT_DTYPES):
        raise NVFP4UsageError(f"--dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {dtype!r}")
    start = time.perf_counter()
    source = open_checkpoint(src, model_config=model_config, rope_layout=rope_layout)
    inputs = [src] + ([model_config] if model_config and os.path.exists(model_config) else [])
    check_output_path(dst, inputs, flag="DST", force=force)
    if to == "maxtext":
        layout.check_supported(source.config, src)  # before asking which RoPE layout it would use
    target_layout = source.maxtext_rope_layout() if to == "maxtext" else None
    config = source.config
    with progress.task("convert", total=len(source.tensors.names()), unit="tensor") as task:
        counted = _ProgressSource(source.tensors, task)
        if to == "maxtext":
            write_maxtext(
                dst,
                config,
                counted,
                scan_layers=scan_layers,
                rope_layout=target_layout,
                dtype=dtype or "fp32",
                force=force,
                inputs=inputs,
                flag="DST",
            )
        else:
            hf_dtype = dtype
            if hf_dtype is None and source.kind == "maxtext":
                hf_dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(config.dtype)
            write_hf_folder(
                dst,
                config,
                counted,
                dtype=hf_dtype,
                max_shard_size=max_shard_size,
                copy_from=source.aux_dir if source.kind != "maxtext" else None,
                force=force,
                inputs=inputs,
                flag="DST",
            )
    seconds = time.perf_counter() - start
    return ConvertSummary(
        source_format="maxtext" if source.kind == "maxtext" else "hf",
        target_format=to,
        tensors=counted.count,
        parameters=config.num_parameters(),
        bytes_written=_folder_bytes(dst),
        seconds=seconds,
    )


# ---------------------------------------------------------------------------------------- helpers


class _ProgressSource:
    """Pass-through TensorSource that counts tensors read and advances a progress task."""

    def __init__(self, inner: TensorSource, task: progress.Task) -> None:
        self._inner = inner
        self._task = task
        self.count = 0

    @property
    def path(self) -> str:
        return self._inner.path

    def names(self) -> list[str]:
        return self._inner.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._inner.shape(name)

    def dtype(self, name: str) -> str:
        return self._inner.dtype(name)

    def get(self, name: str) -> np.ndarray:
        array = self._inner.get(name)
        self.count += 1
        self._task.advance(description=name, nbytes=array.nbytes)
        return array


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
