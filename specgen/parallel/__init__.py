"""Context parallelism: one attention over a sequence sharded across GPUs.

Built on torch.distributed (NCCL on GPUs, gloo on CPU) and a generated module's
kernels; it imports nothing else from specgen, so it ships beside generated
modules as they are. See docs/context-parallel.md.

- :class:`ContextParallelAttention` the entry point (ring or all-to-all mode);
- :mod:`.layout` the contiguous and zigzag shard layouts (``shard``, ``gather``);
- :mod:`.ring` ring attention, forward and backward, with its transfers overlapped;
- :mod:`.ulysses` the all-to-all mode;
- :mod:`.blocks` the kernel calls of one ring step (causal blocks skipped);
- :mod:`.merge` the float32 LSE merge of partial results;
- :mod:`.kernels` the generated module (or a float64 reference) behind one interface.
"""

from specgen.parallel.attention import ContextParallelAttention, context_parallel_attention
from specgen.parallel.kernels import ReferenceKernel, SpecKernel
from specgen.parallel.layout import LAYOUTS, gather, shard, unshard

__all__ = [
    "ContextParallelAttention",
    "context_parallel_attention",
    "ReferenceKernel",
    "SpecKernel",
    "LAYOUTS",
    "gather",
    "shard",
    "unshard",
]
