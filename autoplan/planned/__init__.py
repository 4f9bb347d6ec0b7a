"""What a rewritten model runs: each unit's planned forward (precision and checkpoint mode), runs of
a Sequential, segments of consecutive blocks, graph units, and the fused loss head; `forwards`
applies a set of choices to a model in place and removes them."""
