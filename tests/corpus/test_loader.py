"""The Grain loader (nvfp4tool/corpus/loader.py): today's batch order kept exactly, whatever the
thread count; each process's rows of a batch; its position through an Orbax checkpoint; mixtures
(the draws follow the weights, each source in its own order, bad specs refused); and a mixture run
killed with SIGKILL after a checkpoint resumes to the uninterrupted run's bits."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from click.testing import CliRunner
from grain.sharding import ShardOptions

from nvfp4tool.checkpoints import run_steps
from nvfp4tool.cli import cli
from nvfp4tool.corpus.batch import Batch
from nvfp4tool.corpus.loader import (
    MIX_SALT,
    BatchSource,
    ConcatWindows,
    Loader,
    batch_indices,
    epoch_order,
    next_index,
    parse_mixture,
)
from nvfp4tool.corpus.prepare import prepare_cache
from nvfp4tool.corpus.sources import embedded_corpus
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.run.config import load_train_config
from nvfp4tool.run.records import RunRecord
from nvfp4tool.train.checkpoint import Checkpoints
from nvfp4tool.train.trainer import train

from fixtures.kill_fixtures import kill_at
from fixtures.train_fixtures import train_args

T1 = 5  # row width (seq_len + 1) of the stand-in windows


class ArrayWindows:
    """A stand-in `Windows`: rows of an in-memory [num_windows, T+1] array, read by index."""

    def __init__(self, num_windows: int, first_token: int = 0) -> None:
        self.array = first_token + np.arange(num_windows * T1, dtype=np.int32).reshape(num_windows, T1)

    def __len__(self) -> int:
        return len(self.array)

    def rows(self, indices: np.ndarray) -> Batch:
        return Batch(tokens=self.array[indices])


def todays_batch_indices(num_windows: int, batch_size: int, seed: int, batch_number: int) -> np.ndarray:
    """The order every run before the loader trained on (nvfp4tool/train/data.py as it was)."""
    per_epoch = num_windows // batch_size
    epoch, offset = divmod(batch_number, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_windows)
    return order[offset * batch_size : (offset + 1) * batch_size]


@pytest.mark.parametrize("num_windows", [1, 2, 1000, 100_003])
def test_epoch_orders_are_numpys_permutations_held_as_int32(num_windows):
    """One source's and a mixture source's epoch orders are the permutations every earlier run
    drew (`default_rng(...).permutation`, int64), at half the memory."""
    for seed, epoch in ((0, 0), (7, 3)):
        order = epoch_order(num_windows, seed, epoch)
        assert order.dtype == np.int32
        np.testing.assert_array_equal(order, np.random.default_rng([seed, epoch]).permutation(num_windows))
    mixture = BatchSource(
        [ArrayWindows(3), ArrayWindows(num_windows)], [0.5, 0.5], batch_size=1, seed=11, num_batches=1, rows=[0]
    )
    expected = np.random.default_rng([MIX_SALT, 11, 1, 2]).permutation(num_windows)
    np.testing.assert_array_equal(mixture._source_order(1, 2), expected)


@pytest.mark.parametrize("threads", [0, 1, 4])
@pytest.mark.parametrize("seed", [0, 7])
def test_one_source_batches_are_todays_order_whatever_the_thread_count(seed, threads):
    windows = ArrayWindows(50)  # 6 batches of 8 an epoch: 20 batches cross three epoch boundaries
    loader = Loader([windows], batch_size=8, seed=seed, num_batches=20, threads=threads, prefetch=3)
    got = [batch.tokens for batch in loader.iterator()]
    assert len(got) == 20
    for b, tokens in enumerate(got):
        np.testing.assert_array_equal(tokens, windows.array[todays_batch_indices(50, 8, seed, b)])
        np.testing.assert_array_equal(batch_indices(50, 8, seed, b), todays_batch_indices(50, 8, seed, b))
    # a start position, and random access out of order, give the same batches
    np.testing.assert_array_equal(next(loader.iterator(start=13)).tokens, got[13])
    for b in (17, 2, 9):
        np.testing.assert_array_equal(loader.dataset()[b].tokens, got[b])


@pytest.mark.parametrize("weights", [None, [0.6, 0.4]])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_two_processes_read_disjoint_rows_whose_union_is_the_batch(grad_accum, weights):
    sources = [ArrayWindows(40), ArrayWindows(30, first_token=10_000)][: 1 if weights is None else 2]
    whole = Loader(sources, weights, batch_size=8, seed=3, num_batches=6, grad_accum=grad_accum)
    halves = [
        Loader(
            sources,
            weights,
            batch_size=8,
            seed=3,
            num_batches=6,
            grad_accum=grad_accum,
            shard=ShardOptions(shard_index=p, shard_count=2),
        )
        for p in (0, 1)
    ]
    micro = 8 // grad_accum  # each micro-batch is split over the processes in order (batch_sharding)
    expected_rows = [
        [a * micro + p * micro // 2 + i for a in range(grad_accum) for i in range(micro // 2)] for p in (0, 1)
    ]
    assert [h.rows.tolist() for h in halves] == expected_rows
    assert sorted(halves[0].rows.tolist() + halves[1].rows.tolist()) == list(range(8))
    for b, batch in enumerate(whole.iterator()):
        parts = [next(h.iterator(start=b)).tokens for h in halves]
        assembled = np.empty_like(batch.tokens)
        for half, part in zip(halves, parts, strict=True):
            assembled[half.rows] = part
        np.testing.assert_array_equal(assembled, batch.tokens)


def test_the_position_round_trips_through_an_orbax_checkpoint(tmp_path):
    def loader():
        return Loader([ArrayWindows(50)], batch_size=4, seed=5, num_batches=30, threads=2)

    state = {"w": np.arange(3, dtype=np.float32)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    running = loader().iterator()
    for _ in range(7):
        next(running)
    checkpoints = Checkpoints(tmp_path, keep=3)
    checkpoints.save(7, state, {"step": 7}, loader=running)
    checkpoints.save(9, state, {"step": 9})  # as a checkpoint written before the loader's state was
    assert (tmp_path / "checkpoints" / "7" / "loader").is_dir()

    restored = loader().iterator()
    _, meta, has_loader = checkpoints.restore(7, abstract, loader=restored)
    assert has_loader and meta == {"step": 7} and next_index(restored) == 7
    for _ in range(5):
        np.testing.assert_array_equal(next(restored).tokens, next(running).tokens)

    old = loader().iterator()
    assert checkpoints.restore(9, abstract, loader=old)[2] is False and next_index(old) == 0
    np.testing.assert_array_equal(next(loader().iterator(start=9)).tokens, loader().dataset()[9].tokens)
    checkpoints.close()


def test_mixture_draws_follow_the_weights_each_source_in_its_own_order():
    sizes, weights = (37, 23, 11), [5.0, 3.0, 2.0]  # normalised by the loader: 0.5, 0.3, 0.2
    sources = [ArrayWindows(n, first_token=100_000 * s) for s, n in enumerate(sizes)]
    batches = 300

    def run(threads):
        loader = Loader(sources, weights, batch_size=16, seed=11, num_batches=batches, threads=threads)
        return loader, [batch.tokens for batch in loader.iterator()]

    loader, tokens = run(threads=0)
    _, again = run(threads=4)
    assert all(np.array_equal(a, b) for a, b in zip(tokens, again, strict=True))  # deterministic
    picked = [loader.source.window_indices(b) for b in range(batches)]
    rows = [pair for batch in picked for pair in batch]
    for b in (0, 150, 299):  # the rows read are the rows named
        expected = np.stack([sources[s].array[w] for s, w in picked[b]])
        np.testing.assert_array_equal(tokens[b], expected)
    total = len(rows)
    for s, share in enumerate(np.asarray(weights) / sum(weights)):
        count = sum(1 for source, _ in rows if source == s)
        assert abs(count - total * share) < 4 * math.sqrt(total * share * (1 - share)), (s, count)
        # the source's own order: each epoch of it is a permutation of its windows
        order = [w for source, w in rows if source == s]
        for start in range(0, len(order) - sizes[s] + 1, sizes[s]):
            assert sorted(order[start : start + sizes[s]]) == list(range(sizes[s]))
    # another seed draws otherwise
    other = Loader(sources, weights, batch_size=16, seed=12, num_batches=batches)
    assert other.source.window_indices(0) != picked[0]
    # a batch read out of order (a resume) continues each source where the batches before left it
    fresh = Loader(sources, weights, batch_size=16, seed=11, num_batches=batches)
    assert fresh.source.window_indices(299) == picked[299] and fresh.source.window_indices(3) == picked[3]


class MarkedWindows(ArrayWindows):
    """A stand-in whose rows carry segment ids and loss marks."""

    def rows(self, indices: np.ndarray) -> Batch:
        tokens = self.array[indices]
        return Batch(tokens, segments=(tokens % 3 + 1).astype(np.int32), loss=tokens % 2 == 0)


def test_concatenated_windows_read_each_source_in_order():
    """A mixture's eval set: the sources' windows one after the other; a source without segments
    or loss marks reads as one document with every token marked, next to one that has them."""
    plain, marked = ArrayWindows(5), MarkedWindows(4, first_token=1000)
    both = ConcatWindows([plain, marked])
    assert len(both) == 9
    batch = both.rows(np.array([7, 0, 4, 5, 8]))
    expected = np.concatenate([plain.array, marked.array])[[7, 0, 4, 5, 8]]  # an oracle: numpy's concatenation
    np.testing.assert_array_equal(batch.tokens, expected)
    whole = np.concatenate([plain.array, marked.array])
    from_marked = np.array([True, False, False, True, True])
    np.testing.assert_array_equal(batch.segments[~from_marked], 1)
    np.testing.assert_array_equal(batch.segments[from_marked], expected[from_marked] % 3 + 1)
    assert batch.loss[~from_marked].all()
    np.testing.assert_array_equal(batch.loss[from_marked], expected[from_marked] % 2 == 0)
    chunks = list(both.batches(4, count=7))
    assert [len(c.tokens) for c in chunks] == [4, 3]
    np.testing.assert_array_equal(np.concatenate([c.tokens for c in chunks]), whole[:7])
    plain_only = ConcatWindows([plain, ArrayWindows(2)]).rows(np.array([6, 1]))
    assert plain_only.segments is None and plain_only.loss is None


def test_mixture_specs(tmp_path):
    assert parse_mixture("A:0.7,B:0.3") == [("A", 0.7), ("B", 0.3)]
    assert parse_mixture("A:3, B:1") == [("A", 0.75), ("B", 0.25)]
    assert parse_mixture("corpus.txt") == [("corpus.txt", 1.0)]
    assert parse_mixture("data/x:y") == [("data/x:y", 1.0)]  # no weight at the end: a path
    odd = tmp_path / "a,b:1"
    odd.write_text("text")
    assert parse_mixture(str(odd)) == [(str(odd), 1.0)]  # an existing path is never split


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("A:0.7,B", "entry 'B' is not PATH:WEIGHT"),
        ("A:0.7,B:x", "entry 'B:x' is not PATH:WEIGHT"),
        ("A:0.7,,B:1", "entry '' is not PATH:WEIGHT"),
        (":1,B:1", "entry ':1' is not PATH:WEIGHT"),
        ("A:0,B:1", "A: weight 0 is not a finite number > 0"),
        ("A:-0.5,B:1", "A: weight -0.5 is not a finite number > 0"),
        ("A:nan,B:1", "A: weight nan is not a finite number > 0"),
        ("A:1,B:inf", "B: weight inf is not a finite number > 0"),
        ("A:1,A:2", "A is given twice"),
    ],
)
def test_bad_mixture_specs_are_refused_in_one_line(spec, says, tmp_path):
    with pytest.raises(NVFP4UsageError, match="data="):
        parse_mixture(spec)
    result = CliRunner().invoke(cli, ["train", f"data={spec}", f"out={tmp_path / 'run'}"])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert f"data={spec}" in errors[0] and says in errors[0], errors[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # three tiny runs, one of them a child process (tests/fixtures/kill_child.py)
def test_a_mixture_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_bits(corpus_tokenizer, tmp_path):
    """`data=A:0.7,B:0.3` (the embedded corpus's training text, and its held-out text prepared
    into a token cache: memory-mapped), kill -9 right after the step-2
    checkpoint is saved: resume=true replays steps 3 and 4 to the uninterrupted run's losses, eval
    loss (each source's held-out windows) and final weights, bit for bit, from the saved loader
    state and from the step alone (the checkpoint without it); run.json records the weights."""
    train_txt, val_txt = embedded_corpus()
    cache = tmp_path / "val-cache"
    prepare_cache([val_txt], corpus_tokenizer, cache, workers=0)
    mixture = f"{train_txt}:7,{cache}:3"

    def args(out, **extra):
        given = train_args(corpus_tokenizer, out, **{"data": mixture, "steps": 4, "checkpoint_every": 2, **extra})
        return [a for a in given if not a.startswith("eval_data=")]  # each source's held-out split

    full = train(load_train_config(None, args(tmp_path / "full")))
    killed = tmp_path / "killed"
    kill_at("checkpoint", ["train", *args(killed)], tmp_path / "ready", env={"CHECKPOINT_AT": "1"})
    assert run_steps(str(killed)) == [2] and (killed / "checkpoints" / "2" / "loader").is_dir()
    assert not (killed / "hf").exists()
    old = tmp_path / "old"  # as a checkpoint written before the loader's state was: its step is the position
    shutil.copytree(killed, old)
    shutil.rmtree(old / "checkpoints" / "2" / "loader")
    for run in (killed, old):
        resumed = train(load_train_config(None, args(run, resume="true")))
        assert sorted(resumed.losses) == [3, 4]
        assert [resumed.losses[s] for s in (3, 4)] == [full.losses[s] for s in (3, 4)]  # to the last bit
        assert resumed.eval_losses == full.eval_losses
        assert (run / "hf/model.safetensors").read_bytes() == (full.out / "hf/model.safetensors").read_bytes()
    with pytest.raises(NVFP4ToolError, match="the training data"):  # other weights are other data
        train(load_train_config(None, args(killed, resume="true", data=f"{train_txt}:1,{cache}:1")))
    record = RunRecord.read(killed)
    assert record.data_weights == {str(train_txt): 0.7, str(cache): 0.3}
    assert record.data_sha256 == RunRecord.read(full.out).data_sha256
    # a run.json written before the loader (one source, no loader keys) still reads, as their defaults
    before = json.loads(Path(RunRecord.path(full.out)).read_text())
    del before["data_weights"], before["config"]["loader_threads"], before["config"]["loader_prefetch"]
    (tmp_path / "before").mkdir()
    (tmp_path / "before" / "run.json").write_text(json.dumps(before))
    assert RunRecord.read(tmp_path / "before").train_config() == RunRecord.read(full.out).train_config()
