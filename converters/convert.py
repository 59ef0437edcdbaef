"""`nvfp4tool convert`: detect the source format, dispatch to the reader/writer pair, summarise.

Directions: HF -> MaxText, MaxText -> HF, and HF -> HF (reshard / change dtype). Every tensor goes
through a `TensorSource` one at a time; the output is written into a temporary sibling folder and
renamed into place, so a failure leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import time
from typing import Callable

import numpy as np

from converters import maxtext_models
from converters.hf import HFFolderSource, write_hf_folder
from converters.maxtext import MaxTextSource, is_maxtext_checkpoint, write_maxtext
from converters.tensor_source import TensorSource
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

FORMATS = ("hf", "maxtext")


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
        return (f"converted {self.source_format} -> {self.target_format}: {self.tensors} tensors, "
                f"{self.parameters:,} parameters, {self.bytes_written / 1e9:.3f} GB in "
                f"{self.seconds:.2f} s ({self.gb_per_s:.3f} GB/s)")


def convert_checkpoint(src: str, dst: str, *, to: str, model_config: str | None = None,
                       scan_layers: bool = True, rope_layout: str | None = None,
                       dtype: str | None = None, max_shard_size: str | int = "5GB",
                       force: bool = False,
                       on_tensor: Callable[[str, int], None] | None = None) -> ConvertSummary:
    """Convert checkpoint `src` into `dst` in format `to` ("hf" | "maxtext").

    model_config: an HF config.json, an HF folder, or a MaxText model name (see
    `converters.maxtext_models`); required for a MaxText source, optional for an HF one (whose
    config.json is used; a MaxText name then also picks the RoPE layout and must match it).
    rope_layout: "interleaved" | "half"; defaults to the MaxText name's layout.
    dtype: "bf16" | "fp32". MaxText output: default fp32 (MaxText's weight dtype). HF output:
    default the model config's dtype from MaxText, each tensor's own dtype from HF.
    on_tensor(name, nbytes) is called after each source tensor is read (progress).
    """
    if to not in FORMATS:
        raise NVFP4UsageError(f"--to must be one of {', '.join(FORMATS)}, got {to!r}")
    source_format = detect_format(src)
    start = time.perf_counter()
    if source_format == "maxtext":
        if model_config is None:
            raise NVFP4UsageError(f"{src} is a MaxText checkpoint, which carries no model config: "
                                    f"pass --model-config (an HF config.json/folder or a MaxText "
                                    f"model name such as llama3.1-8b)")
        config, name = load_model_config(model_config)
        layout_name = _rope_layout(rope_layout, name)
        source: TensorSource = MaxTextSource(src, config, layout_name)
    else:
        source = HFFolderSource(src)
        config = source.config
        name = None
        if model_config is not None:
            given, name = load_model_config(model_config)
            if given.expected_tensor_shapes() != config.expected_tensor_shapes():
                raise NVFP4ToolError(f"{src}: its config.json describes a different model than "
                                     f"--model-config {model_config}")
    counted = _ProgressSource(source, on_tensor)
    inputs = [src, *([model_config] if model_config is not None and os.path.exists(model_config) else [])]
    if to == "maxtext":
        write_maxtext(dst, config, counted, scan_layers=scan_layers,
                      rope_layout=_rope_layout(rope_layout, name), dtype=dtype or "fp32", force=force,
                      inputs=inputs, flag="DST")
    else:
        hf_dtype = dtype
        if hf_dtype is None and source_format == "maxtext":
            hf_dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(config.dtype)
        write_hf_folder(dst, config, counted, dtype=hf_dtype, max_shard_size=max_shard_size,
                        copy_from=src if source_format == "hf" else None, force=force,
                        inputs=inputs, flag="DST")
    seconds = time.perf_counter() - start
    return ConvertSummary(source_format=source_format, target_format=to, tensors=counted.count,
                          parameters=config.num_parameters(), bytes_written=_folder_bytes(dst),
                          seconds=seconds)


def detect_format(path: str) -> str:
    """"hf" (a folder with config.json and *.safetensors) or "maxtext" (an Orbax tree)."""
    if not os.path.exists(path):
        raise NVFP4ToolError(f"{path}: no such file or folder")
    if os.path.isfile(os.path.join(path, "config.json")) and glob.glob(os.path.join(path, "*.safetensors")):
        return "hf"
    if is_maxtext_checkpoint(path):
        return "maxtext"
    raise NVFP4ToolError(f"{path}: neither an HF folder (config.json + *.safetensors) nor a MaxText "
                         f"Orbax checkpoint (<base>/<step>/items)")


def load_model_config(spec: str) -> tuple[ModelConfig, str | None]:
    """(config, MaxText model name or None) from a MaxText name, an HF config.json or HF folder."""
    if spec in maxtext_models.MAXTEXT_MODELS:
        hf = maxtext_models.maxtext_hf_config(spec)
        return ModelConfig.from_hf_config(hf, source=f"MaxText model {spec}"), spec
    if os.path.exists(spec):
        return ModelConfig.from_hf_folder(spec), None
    raise NVFP4ToolError(f"--model-config {spec}: neither a file/folder nor a known MaxText model "
                         f"name ({', '.join(maxtext_models.MAXTEXT_MODELS)})")


# ---------------------------------------------------------------------------------------- helpers


def _rope_layout(explicit: str | None, maxtext_name: str | None) -> str:
    if explicit is not None:
        return explicit
    if maxtext_name is not None:
        return maxtext_models.rope_layout_for(maxtext_name)
    raise NVFP4UsageError("which RoPE layout does the MaxText side use? pass --rope-layout "
                            "interleaved|half, or a MaxText model name as --model-config "
                            "(llama3.1-* are interleaved, the others half)")


class _ProgressSource:
    """Pass-through TensorSource that counts tensors read and reports each one."""

    def __init__(self, inner: TensorSource, on_tensor: Callable[[str, int], None] | None) -> None:
        self._inner = inner
        self._on_tensor = on_tensor
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
        if self._on_tensor is not None:
            self._on_tensor(name, array.nbytes)
        return array


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
