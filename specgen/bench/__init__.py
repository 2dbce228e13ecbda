"""Bench: timing of generated kernels beside the field's baselines."""
