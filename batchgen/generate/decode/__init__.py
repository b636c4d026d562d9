"""Rows through the model: the decoder and its caches, prefill, sampling, the memory budget."""
