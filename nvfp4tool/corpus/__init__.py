"""Training data: documents read from files and datasets, tokenized, cached, packed into rows and
batched (the input stage of `train`)."""
