"""Calibration: the amax of every quantized linear's input (and, for an FP8 KV cache, of every
attention layer's keys and values), by running our JAX model on text.

    found = calibrate(config, source, names, "calib.txt", kv_cache=True, samples=64, seq_len=512,
                      tokenizer_dir=hf_folder)   # found.input_amax, found.kv_amax, found.routed_tokens

The model runs in BF16, held or streamed layer by layer (the same amax); MoE models calibrate all experts.
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from converters.tensor_source import TensorSource
from nvfp4tool import memory, progress
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.families import is_router
from nvfp4tool.model.layers import route
from nvfp4tool.model.layerwise import LayerwiseModel
from nvfp4tool.model.weights import model_from_tensors
from nvfp4tool.numerics import dense, tensor_amax
from nvfp4tool.recipes.precision import GEMM_INPUT_DTYPE

BATCH = 8  # windows per forward


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a calibration pass measured (max |.| over every calibration token)."""

    input_amax: dict[str, float]  # linear module -> max |input|
    kv_amax: dict[str, tuple[float, float]]  # attention module -> (max |K| after RoPE, max |V|); {} without kv_cache
    routed_tokens: dict[str, int]  # MoE expert ("model.layers.0.mlp.experts.7") -> tokens routed to it; {} dense


def calibrate(
    config: ModelConfig,
    source: TensorSource,
    names: Sequence[str],
    data_path: str,
    *,
    samples: int,
    seq_len: int,
    tokenizer_dir: str | None,
    kv_cache: bool = False,
    offload: str = "auto",
    ids_SxL: np.ndarray | None = None,
) -> Calibration:
    """Input amax of every linear in `names` over the calibration windows, with `kv_cache` the
    K / V amax of every attention layer, and the routed-token counts of every MoE expert.
    `ids_SxL`: the windows already read from `data_path` (`load_calibration_ids`), else read here."""
    if ids_SxL is None:
        ids_SxL = load_calibration_ids(
            data_path, samples=samples, seq_len=seq_len, tokenizer_dir=tokenizer_dir, vocab_size=config.vocab_size
        )
    model = open_bf16_model(config, source, seq_len=ids_SxL.shape[1], offload=offload, what="calibration")
    tally = Tally(config, names, kv_cache=kv_cache)
    for _ in model.logits(
        ids_SxL,
        BATCH,
        tap=InputAmax.of(config),
        on_record=tally.record,
        label="calibration",
        kv_tap=KVAmax() if kv_cache else None,
        all_experts=True,
    ):
        pass
    del model
    memory.release()
    return tally.result()


class Tally:
    """What a pass through the model measures, record by record (`record(name, value)`: a linear's
    input amax or a router's token counts from `InputAmax`, an attention's [K, V] amax from
    `KVAmax`), made into a `Calibration` with the refusals of calibration (`result()`): calibrate()
    and the GPTQ pass (`gptq_pass.py`, whose reference stream through the original layers measures the same) both
    tally here."""

    def __init__(self, config: ModelConfig, names: Sequence[str], *, kv_cache: bool) -> None:
        self.names = list(names)
        self.attentions = list(config.modules.attentions) if kv_cache else []
        self.amax = {n: np.zeros(2 if n in self.attentions else 1) for n in (*self.names, *self.attentions)}
        self.seen: set[str] = set()
        # in layer order, and so is `routed`; counted only where the family's experts are a `moe.Experts`
        # record (a plain top-k of the router logits, which `InputAmax` emulates); a family whose choice
        # needs more (`experts()` None: a correction bias, grouped top-k) calibrates its experts on all tokens
        self.routers = config.router_names() if config.family_spec.experts(config) is not None else []
        self._experts = {r: config.modules.experts(r) for r in self.routers}
        self.routed = {expert: 0 for r in self.routers for expert in self._experts[r]}

    def record(self, name: str, value) -> None:
        if name in self.routers:
            for expert, count in zip(self._experts[name], np.asarray(value)):
                self.routed[expert] += int(count)
        elif name in self.amax:
            self.seen.add(name)
            self.amax[name] = np.maximum(self.amax[name], np.asarray(value, np.float64).reshape(-1))

    def result(self) -> Calibration:
        amax = self.amax
        missing = [n for n in amax if n not in self.seen]
        if missing:
            raise NVFP4ToolError(f"calibration: {missing[0]} was never called by the model")
        for name, value in amax.items():
            check_calibrated(name, value, what="keys / values" if name in self.attentions else "input")
        for expert, count in self.routed.items():
            if count == 0:
                progress.warn(
                    f"warning: calibration routed no token to {expert} (its input scales come "
                    f"from all-experts calibration)"
                )
        return Calibration(
            input_amax={n: float(amax[n][0]) for n in self.names},
            kv_amax={a: (float(amax[a][0]), float(amax[a][1])) for a in self.attentions},
            routed_tokens=self.routed,
        )


def check_calibrated(name: str, amax, *, what: str = "input") -> None:
    """Refuse a calibrated amax (`what` of linear / attention `name`, one value or several) that is
    non-finite or zero: a zero input's scale would be a placeholder (1.0), silently wrong when
    served, and GPTQ would round the weight to zeros (its Hessian is 0). The owner of this refusal's
    wording, for calibration and the GPTQ pass alike."""
    value = np.asarray(amax, np.float64).reshape(-1)
    if not np.isfinite(value).all():
        raise NVFP4ToolError(f"calibration: the {what} of {name} have a non-finite amax ({value.tolist()})")
    if not value.all():
        raise NVFP4ToolError(
            f"calibration: the {what} of {name} was zero on every calibration token; "
            f"pass other --calib-data or keep it in BF16 (--keep-bf16)"
        )


def open_bf16_model(
    config: ModelConfig, source: TensorSource, *, seq_len: int, offload: str, what: str
) -> LayerwiseModel:
    """The source in BF16 as a `LayerwiseModel`, held or streamed as `offload` and the memory
    decide (the model calibration and GPTQ run)."""
    itemsize = np.dtype(GEMM_INPUT_DTYPE).itemsize
    model_bytes = sum(int(np.prod(s)) * itemsize for s in config.expected_tensor_shapes().values())
    working = 2 * 4 * BATCH * seq_len * (config.vocab_size + 4 * config.intermediate_size)
    return LayerwiseModel.open(
        config,
        build=lambda mesh: model_from_tensors(config, source, dtype=GEMM_INPUT_DTYPE, mesh=mesh),
        source=_Cast(source),
        offload=offload,
        weights=model_bytes,
        working=working,
        what=f"{what} ({model_bytes / 1e9:.2f} GB in BF16)",
        compute_dtype=GEMM_INPUT_DTYPE,
    )


def load_calibration_ids(
    path: str,
    *,
    samples: int,
    seq_len: int,
    tokenizer_dir: str | None,
    vocab_size: int,
    flags: tuple[str, str] = ("--calib-samples", "--calib-seq-len"),
) -> np.ndarray:
    """Token ids [S, L] (S <= samples, L <= seq_len: what the file has, at most what was asked;
    the caller says and records a shortfall) from a .txt / .jsonl / .npy calibration file; `flags`
    names the samples and sequence-length options as the calling command spells them."""
    for flag, value in zip(flags, (samples, seq_len)):
        if value < 1:
            raise NVFP4UsageError(f"{flag} must be >= 1, got {value}")
    if not os.path.isfile(path):
        raise NVFP4ToolError(f"{path}: calibration data not found")
    if path.endswith(".npy"):
        try:
            ids = np.load(path, allow_pickle=False)
        except (ValueError, EOFError, OSError) as bad:  # not an .npy array, pickled objects, truncated
            raise NVFP4ToolError(f"{path}: not a NumPy token-id array ({bad})") from None
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise NVFP4ToolError(
                f"{path}: expected an integer array [samples, seq_len], got {ids.dtype}{list(ids.shape)}"
            )
        ids = ids[:samples, :seq_len]
    else:
        ids = _tokenize(path, samples, seq_len, tokenizer_dir)
    if ids.size == 0:  # no rows, or rows of no token
        raise NVFP4ToolError(f"{path}: no calibration tokens ({ids.shape[0]} windows of {ids.shape[1]})")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise NVFP4ToolError(f"{path}: token ids outside [0, {vocab_size})")
    return ids.astype(np.int32)


# ------------------------------------------------------------------------------------------
# helpers


@dataclasses.dataclass(frozen=True)
class InputAmax:
    """Tap: the plain BF16 GEMM, recording max|x| of its BF16 input; a router (`families.is_router`)
    records instead how many tokens `route` sends to each expert. Calibration runs it with every
    sparse MLP showing all its experts all tokens (`all_experts=True`)."""

    routes: bool = False  # the model has routers (a MoE model)
    top_k: int = 0

    @classmethod
    def of(cls, config: ModelConfig) -> InputAmax:
        """The tap for `config`'s model (its routers, if it is a MoE model)."""
        experts = config.family_spec.experts(config)
        return cls(routes=experts is not None, top_k=0 if experts is None else experts.num_experts_per_tok)

    def __call__(self, x, w_NxK, b_N, *, name, aux):
        y = dense(x, w_NxK, b_N, compute_dtype=GEMM_INPUT_DTYPE)
        return y, self.measure(x, y, name=name)

    def measure(self, x, y, *, name):
        """The record of the linear `name` whose input is `x` and output `y`."""
        if self.routes and is_router(name):
            _, chosen_BxTxN = route(y, self.top_k, normalize=False)  # the choice ignores normalisation
            return jnp.sum(chosen_BxTxN, axis=(0, 1), dtype=jnp.int32)
        return tensor_amax(x.astype(GEMM_INPUT_DTYPE))


@dataclasses.dataclass(frozen=True)
class KVAmax:
    """KV tap: keys and values cached unchanged, recording [max|k|, max|v|] as computed."""

    def __call__(self, k, v, *, name, aux):
        return (k, v), jnp.stack([tensor_amax(k), tensor_amax(v)]).astype(jnp.float32)


class _Cast:
    """The source with every tensor cast to the compute dtype as it is read (what the held model
    holds), so that both modes compute on the same values."""

    def __init__(self, source: TensorSource) -> None:
        self._source = source

    def get(self, name: str) -> np.ndarray:
        return np.asarray(self._source.get(name)).astype(GEMM_INPUT_DTYPE, copy=False)


def _tokenize(path: str, samples: int, seq_len: int, tokenizer_dir: str | None) -> np.ndarray:
    if tokenizer_dir is None or not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        raise NVFP4ToolError(
            f"{path}: text calibration data needs the source's tokenizer.json "
            f"(not found in {tokenizer_dir}); or pass token ids as .npy"
        )
    from nvfp4tool.corpus.sources import iter_documents
    from nvfp4tool.corpus.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    documents = iter_documents(path)  # the training data reader: one-line errors naming file and line
    if path.endswith(".jsonl"):
        rows = [tokenizer.encode(doc)[:seq_len] for _, doc in zip(range(samples), documents)]
        rows = [r for r in rows if len(r) == seq_len] or rows[:1]
        width = min(len(r) for r in rows) if rows else 0
        return np.array([r[:width] for r in rows], np.int64).reshape(len(rows), width)
    stream = tokenizer.encode("".join(documents))
    count = min(samples, len(stream) // seq_len)
    if count == 0:
        raise NVFP4ToolError(f"{path}: {len(stream)} tokens, fewer than one window of {seq_len}")
    return np.asarray(stream[: count * seq_len], np.int64).reshape(count, seq_len)
