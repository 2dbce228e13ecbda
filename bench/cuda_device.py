"""Imported first by the bench scripts that run kernels: where torch sees no CUDA GPU,
one line and exit 2, instead of a traceback from triton's import or torch's CUDA calls."""

import sys

import torch

if not torch.cuda.is_available():
    print(f"{sys.argv[0]}: needs a CUDA GPU; torch {torch.__version__} sees none", file=sys.stderr)
    raise SystemExit(2)
