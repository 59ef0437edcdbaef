"""Training: data and tokenizer, the trainer loop, checkpoints, sharding, metrics."""
