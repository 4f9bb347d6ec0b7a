"""Verify stage: the peak of a planned training step, simulated under fake tensors or measured in real
steps."""
