"""Inputs stage: what the person gives (a budget, a device, a model target, a batch, the training loop)
turned into values the pipeline plans for."""
