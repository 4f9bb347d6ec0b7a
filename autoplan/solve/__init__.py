"""Solve stage: the integer program that picks one choice per unit, and the search that re-solves until
the whole-step simulation agrees."""
