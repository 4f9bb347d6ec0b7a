"""The person's training step: its loss, its optimizer, putting a model back after real steps, and
`runner.LoopRunner`, the one step that the simulation and every measurement run."""
