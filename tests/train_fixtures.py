"""Tiny training runs for the train tests: the `tiny` preset on the embedded corpus, as key=value
arguments (`train_args`) or run in-process (`run_train`)."""

from __future__ import annotations

from nvfp4tool.run.config import load_train_config
from nvfp4tool.train.data import embedded_corpus
from nvfp4tool.train.trainer import train


def train_args(tokenizer_dir, out, **extra) -> list[str]:
    train_txt, val_txt = embedded_corpus()
    args = dict(
        model="tiny",
        data=str(train_txt),
        eval_data=str(val_txt),
        tokenizer=str(tokenizer_dir),
        recipe="bf16",
        steps=30,
        seq_len=32,
        batch_size=8,
        lr=3e-3,
        warmup_steps=2,
        eval_every=0,
        eval_batches=2,
        out=str(out),
        seed=1,
    )
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


def run_train(tokenizer_dir, out, **extra):
    return train(load_train_config(None, train_args(tokenizer_dir, out, **extra)))
