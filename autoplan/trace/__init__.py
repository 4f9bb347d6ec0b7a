"""Trace stage: the model's graph and its units (repeated blocks, Sequential runs, graph runs) with
the dataflow between them."""
