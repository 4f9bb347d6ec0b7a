"""Shared machinery that every stage may use and that imports no stage: planned-forward wrappers,
unit names, tensor byte counting, the fake-tensor live-bytes tracker, fake copies, training-step helpers,
human-readable numbers."""
