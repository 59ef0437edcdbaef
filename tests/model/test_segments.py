"""Packed documents that do not see each other: a row of several documents with segment ids runs
each document as if alone, in every family (dense, sliding window, MoE, the hybrid's Mamba-2).

Each packed row is checked three ways: exactly against each document alone in a row of the same
shape (the other documents' tokens replaced by padding, through the padding path: mask and
`cumsum` positions, no segment ids), against transformers on each unpadded document, and scanned
against unrolled layers. Exactness needs the same shapes: XLA:CPU's q.k^T dot rounds differently
for another sequence length (~1e-6), as `test_model.test_padding_does_not_change_real_tokens` notes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from converters.hf import HFFolderSource
from nvfp4tool.config import ModelConfig
from nvfp4tool.model import forward, model_from_tensors
from nvfp4tool.model.mamba import ssd_chunked, ssd_recurrent
from nvfp4tool.model.transformer import segment_positions

from fixtures.hf_fixtures import FAMILY_KEYS, build_torch_model
from fixtures.hybrid_fixtures import DENSE, MOE, _hf_folder

torch = pytest.importorskip("torch")

TOLERANCE = 1e-4  # against transformers, fp32 (test_hf_model's)


def packed_rows(lengths_per_row: list[list[int]], T: int, vocab: int, seed: int = 0):
    """(ids [B, T], segments [B, T]): row b packs documents of `lengths_per_row[b]`, then padding
    (segment 0, id 0)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (len(lengths_per_row), T))
    segments = np.zeros(ids.shape, np.int32)
    for b, lengths in enumerate(lengths_per_row):
        starts = np.cumsum([0, *lengths])
        for d, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
            segments[b, start:end] = d + 1
    ids[segments == 0] = 0
    return ids, segments


def alone(ids, segments, document: int):
    """(ids, mask) of the rows holding only document `document` of each row, in its slots."""
    mine = segments == document
    return np.where(mine, ids, 0), mine.astype(np.int32)


def assert_each_document_alone(model, ids, segments, packed, rows=None):
    """`packed` at each document's slots equals that document alone in its slots (exactly)."""
    for document in range(1, segments.max() + 1):
        solo_ids, mask = alone(ids, segments, document)
        solo = np.asarray(forward(model, solo_ids, mask))
        for b in rows if rows is not None else range(len(ids)):
            slots = mask[b].astype(bool)
            np.testing.assert_array_equal(packed[b, slots], solo[b, slots], err_msg=f"row {b} doc {document}")


def assert_near_torch(torch_model, ids, segments, packed):
    """`packed` at each document's slots is close to transformers' logits of the document alone."""
    for b in range(len(ids)):
        for document in range(1, segments[b].max() + 1):
            slots = segments[b] == document
            with torch.no_grad():
                want = torch_model(input_ids=torch.from_numpy(ids[b : b + 1, slots])).logits.numpy()[0]
            assert np.abs(want).max() > 0.5  # not trivially small
            diff = np.abs(packed[b, slots] - want).max()
            assert diff < TOLERANCE, f"row {b} doc {document}: max |diff| {diff:.3g}"


def test_positions_restart_at_each_segment():
    segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(segment_positions(segments), [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])


@pytest.mark.peers
@pytest.mark.parametrize("key", FAMILY_KEYS)
def test_packed_documents_equal_each_document_alone(key, hf_tiny_models):
    """Llama (llama3 RoPE, tied), Mistral (window 4 < the documents), Qwen2/3, Qwen3-MoE, Mixtral:
    3 documents of lengths 5, 7, 4 and 3 slots of padding; a second row 2, 9, 6, 2."""
    source = HFFolderSource(hf_tiny_models[key])
    model = model_from_tensors(source.config, source)
    ids, segments = packed_rows([[5, 7, 4], [2, 9, 6, 2]], 19, source.config.vocab_size)
    packed = np.asarray(forward(model, ids, segment_ids_BxT=segments))
    assert np.isfinite(packed).all()
    assert_each_document_alone(model, ids, segments, packed)
    assert_near_torch(build_torch_model(key), ids, segments, packed)
    if key == "qwen3_moe":  # runs of alike layers (dense, sparse) scanned; the hybrid's test scans too
        scanned = model_from_tensors(source.config, source, scan_layers=True)
        np.testing.assert_array_equal(np.asarray(forward(scanned, ids, segment_ids_BxT=segments)), packed)


@pytest.mark.peers
@pytest.mark.parametrize("options", [DENSE, MOE], ids=["dense", "moe"])
def test_packed_documents_equal_each_document_alone_in_the_hybrid(options, tmp_path):
    """Nemotron-H (Mamba-2 with chunk 4, attention, MLP / MoE): row 0's documents start at chunk
    starts (4, 8, 5) and the 8 spans two chunks; row 1's start inside chunks (5, 7, 4), so the SSM
    state of one document is dropped mid-chunk and the conv window crosses a boundary."""
    folder, torch_model = _hf_folder(tmp_path, options, seed=5)
    config = ModelConfig.from_hf_folder(folder)
    model = model_from_tensors(config, HFFolderSource(folder))
    ids, segments = packed_rows([[4, 8, 5], [5, 7, 4]], 19, options["vocab_size"])
    packed = np.asarray(forward(model, ids, segment_ids_BxT=segments))
    assert np.isfinite(packed).all()
    # Exact where a document starts a chunk: in a chunk that a document starts inside, the scan's
    # within-chunk decay sums (Mamba-2's, with or without seq_idx) include the decay of the slots
    # before it, which are the previous document's here and the padding's alone (the decay across
    # the boundary is cut either way; the rounding of the sums differs by ~1 ulp).
    assert_each_document_alone(model, ids, segments, packed, rows=[0])
    assert_near_torch(torch_model, ids, segments, packed)
    scanned = model_from_tensors(config, HFFolderSource(folder), scan_layers=True)
    np.testing.assert_array_equal(np.asarray(forward(scanned, ids, segment_ids_BxT=segments)), packed)


def test_chunked_scan_restarts_at_each_segment_as_the_recurrence_per_document():
    """`ssd_chunked` with segments (chunk 4: a document spanning three chunks, one ending and one
    starting mid-chunk, padding at the end) equals the step-by-step recurrence run on each
    document alone from a zero state."""
    bsz, t, h, p, g, n = 1, 15, 2, 3, 1, 4
    k = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(k[0], (bsz, t, h, p))
    dt = jax.nn.softplus(jax.random.normal(k[1], (bsz, t, h)))
    a = -jnp.exp(jax.random.normal(k[2], (h,)))
    b = jax.random.normal(k[3], (bsz, t, g, n))
    c = jax.random.normal(k[4], (bsz, t, g, n))
    segments = jnp.asarray([[1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 0, 0]])
    y, _ = jax.jit(ssd_chunked, static_argnums=5)(x, dt, a, b, c, 4, jnp.zeros((bsz, h, p, n)), segments)
    for document in (1, 2, 3):
        slots = np.flatnonzero(np.asarray(segments[0]) == document)
        xs, dts, bs, cs = (v[:, slots] for v in (x, dt, b, c))
        want, _ = jax.jit(ssd_recurrent)(xs, dts, a, bs, cs, jnp.zeros((bsz, h, p, n)))
        np.testing.assert_allclose(np.asarray(y)[:, slots], np.asarray(want), rtol=0, atol=1e-5)
