"""Compile: AOT cubins per GPU target through cuda-tile, the cubin cache, and build jobs."""
