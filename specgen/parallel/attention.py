"""Context-parallel attention over a process group: the entry point.

    import torch.distributed as dist
    from specgen.parallel import ContextParallelAttention, shard
    import generated.fmha_train_gqa_causal as kernels

    attn = ContextParallelAttention(kernels, group=dist.group.WORLD)  # ring, zigzag
    q_shard = shard(q, "zigzag", world_size, rank)        # [B, Hq, S / W, D]
    out_shard = attn(q_shard, k_shard, v_shard)            # differentiable

Every argument is checked on every rank before any K/V moves: a problem found on
one rank (a shard of another length, a wrong dtype) is shared through one small
all_gather of the shapes, so every rank raises the same ValueError instead of
leaving the others waiting in a transfer that never comes.
"""

from __future__ import annotations

import numbers
import operator
import struct
import zlib

import torch
import torch.distributed as dist

from specgen.parallel import layout as layouts
from specgen.parallel import packed
from specgen.parallel import ring as rings
from specgen.parallel import ulysses
from specgen.parallel.kernels import ReferenceKernel, SpecKernel

MODES = ("ring", "ulysses")
# The kernels' positions are int32: a call's q_offset + seq_q at most 2**30. A longer
# whole sequence was refused by a ring step's kernel call after the transfers had
# started, at a step that differs by rank (each step has its own q_offset), so the
# other ranks waited on a transfer that never came.
MAX_POSITIONS = 2**30
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _resolve_group(group):
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None
    return group


def _local_problem(kernel, q, k, v, varlen: bool) -> str | None:
    """What is wrong with this rank's tensors, or None."""
    dims = 3 if varlen else 4
    what = "[total, heads, head_dim] (packed)" if varlen else "[batch, heads, seq, head_dim]"
    for name, t, width in (("q", q, kernel.head_dim), ("k", k, kernel.head_dim), ("v", v, kernel.v_head_dim)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != dims:
            return f"{name} must be {dims}-D {what}, got shape {tuple(t.shape)}"
        if t.dtype != kernel.dtype:
            return f"{name} must have dtype {kernel.dtype}, got {t.dtype}"
        if t.shape[-1] != width:
            return f"{name} must have head_dim {width}, got {t.shape[-1]}"
        if t.device != q.device:
            return f"q, k and v must be on one device, got {name} on {t.device}"
        if t.device.type == "meta":
            return f"{name} is a meta tensor: it holds no data to attend over or to send"
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} must be contiguous in head_dim (stride 1), got strides {t.stride()}"
    seq = 0 if varlen else 2
    heads = 1
    if k.shape[:-1] != v.shape[:-1]:
        return f"k and v must agree in all but head_dim, got {tuple(k.shape)} and {tuple(v.shape)}"
    if q.shape[seq] != k.shape[seq] or (not varlen and q.shape[0] != k.shape[0]):
        return (f"q, k and v shards must hold the same positions, got q {tuple(q.shape)} and "
                f"k {tuple(k.shape)}")
    if k.shape[heads] == 0:
        return "q, k and v need at least one head, got k/v with 0"
    if q.shape[heads] != kernel.group_size * k.shape[heads]:
        return (f"q has {q.shape[heads]} heads and k/v have {k.shape[heads]}; the kernel needs "
                f"q heads == {kernel.group_size} * kv heads")
    if kernel.needs_cuda and not q.is_cuda:
        return f"q, k and v must be CUDA tensors, got {q.device}"
    return None


# What every rank must agree on, in the order the signature lists it, with the
# number of ints each takes.
_SIGNATURE = (("q/k/v shapes", 12), ("the dtype", 1), ("the spec", 1), ("the mode", 1),
              ("the layout", 1), ("scale", 1), ("whether gradients are needed", 1),
              ("cu_seqlens", 1), ("max_seqlen", 1), ("the device type", 1))
_WIDTH = sum(n for _, n in _SIGNATURE)


def _scale_problem(scale) -> str | None:
    """The kernels' own test of the softmax scale: a positive float32 normal number."""
    # Any real number (NumPy's floats too: np.float32 was refused), not a bool.
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        return f"scale must be a positive float or None, got {scale!r}"
    limits = torch.finfo(torch.float32)
    if not limits.tiny <= scale <= limits.max:
        return f"scale must be a positive finite float in float32's normal range, got {scale!r}"
    return None


def _plain_int(value):
    """``value`` as a plain int where operator.index takes it (Python's and NumPy's
    integers: a length read from an array), bools and tensors aside; anything else as
    it is, for the checks to refuse by name. The ranks' signature and the kernels then
    see an int, never a NumPy type."""
    if isinstance(value, (bool, torch.Tensor)):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _lengths(bounds: list[int]) -> list[int]:
    """The sequence lengths of cu_seqlens read to the host."""
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _crc(data: str | bytes) -> int:
    return zlib.crc32(data.encode() if isinstance(data, str) else data)


def _signature(q, k, v, *, spec: str, mode: str, layout: str, scale: float, grads: bool,
               bounds=None, max_seqlen=None) -> list[int]:
    """``bounds``: a varlen call's cu_seqlens, read to the host once by the checks."""
    shapes = [*q.shape, *k.shape, *v.shape]
    shapes += [-1] * (12 - len(shapes))  # packed shards are 3-D
    cu = -1 if bounds is None else _crc(struct.pack(f"<{len(bounds)}q", *bounds))
    return [*shapes, _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1, _crc(spec),
            MODES.index(mode), _crc(layout), struct.unpack("<q", struct.pack("<d", scale))[0],
            int(grads), cu, -1 if max_seqlen is None else max_seqlen, _crc(q.device.type)]


def agree(group, problem: str | None, signature: list[int]) -> None:
    """Raise the same ValueError on every rank of ``group`` if any rank has a
    ``problem`` or the ranks' ``signature``s differ; one all_gather of a few ints."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        if problem:
            raise ValueError(problem)
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.full((_WIDTH + 1,), -1, dtype=torch.int64)
    mine[0] = 1 if problem else 0
    mine[1:1 + min(_WIDTH, len(signature))] = torch.tensor(signature[:_WIDTH], dtype=torch.int64)
    parts = [torch.empty(_WIDTH + 1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(parts, mine.to(device), group=group)
    everyone = torch.stack(parts).cpu()
    rank = dist.get_rank(group)
    if problem:
        raise ValueError(f"rank {rank}: {problem}")
    bad = [r for r in range(world) if everyone[r, 0]]
    if bad:
        raise ValueError(f"rank {bad[0]}'s inputs are invalid (its error names the problem); "
                         "no rank starts the attention")
    for r in range(world):
        if not torch.equal(everyone[r], everyone[0]):
            raise ValueError(_mismatch(everyone[0, 1:].tolist(), everyone[r, 1:].tolist(), r))


def _mismatch(first: list[int], other: list[int], rank: int) -> str:
    """Which agreed item rank ``rank`` holds differently from rank 0."""
    start = 0
    for what, width in _SIGNATURE:
        a, b = first[start:start + width], other[start:start + width]
        start += width
        if a == b:
            continue
        if what == "q/k/v shapes":
            return ("every rank must hold an equal shard of the same shapes: rank 0 has q/k/v "
                    f"shapes {[x for x in a if x >= 0]}, rank {rank} has {[x for x in b if x >= 0]}")
        if what == "scale":
            def show(bits):
                return struct.unpack("<d", struct.pack("<q", bits[0]))[0]
            return f"every rank must use the same scale: rank 0 has {show(a):g}, rank {rank} has {show(b):g}"
        if what == "max_seqlen":
            return (f"every rank must pass the same max_seqlen: rank 0 has {a[0] if a[0] >= 0 else None}, "
                    f"rank {rank} has {b[0] if b[0] >= 0 else None}")
        return f"every rank must agree on {what}: rank {rank} differs from rank 0"
    return f"rank {rank}'s call differs from rank 0's"


class ContextParallelAttention:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        module: a generated prefill module (``import generated.<spec> as module``);
            ring mode needs ``return_lse: true`` or ``backward: true``, training
            needs ``backward: true``. Or a ReferenceKernel (tests, CPU).
        group: the process group (default: the world when torch.distributed is
            initialised, else a single process).
        mode: "ring" (K/V shards passed around the ranks, overlapped with the
            kernels) or "ulysses" (all-to-all: heads scattered, whole sequence per
            rank; the heads must divide by the world size). None: the spec's
            ``context_parallel`` field, else "ring".
        layout: how the shards were cut (specgen.parallel.layout): "zigzag"
            (balanced under a causal mask, the default) or "contiguous".
    """

    def __init__(self, module, group=None, *, mode: str | None = None, layout: str = "zigzag"):
        if mode is None:  # the spec's context_parallel field, else ring
            mode = (getattr(module, "SPEC", None) or {}).get("context_parallel") or "ring"
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        layouts.check_layout(layout)
        self.kernel = module if isinstance(module, ReferenceKernel) else SpecKernel(module, mode)
        if self.kernel.varlen and mode == "ulysses" and layout != "contiguous":
            raise ValueError(
                "all-to-all mode takes a packed (varlen) batch sharded contiguously, sequence by "
                f"sequence: use layout='contiguous' (rank r holds the r-th 1/W of every sequence), got {layout!r}")
        if self.kernel.varlen and mode == "ring" and (self.kernel.mask.left is not None
                                                      or self.kernel.mask.right is not None):
            raise ValueError(f"{self.kernel.name}: ring mode splits packed batches without windows; "
                             "use mode='ulysses'")
        self.group = _resolve_group(group)
        self.mode, self.layout = mode, layout
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.ring = rings.Ring(self.group) if mode == "ring" else None

    def __call__(self, q, k, v, *extra, scale=None, seq_len=None, cu_seqlens=None, max_seqlen=None,
                 **unknown):
        """This rank's output shard ([B, Hq, L, Dv], or [T, Hq, Dv] packed), in q's
        dtype; differentiable in q, k and v when the spec has a backward.

        Args:
            q, k, v: this rank's shards, [B, H, L, D] (L = seq_len / world size) or,
                for a varlen spec, [T, H, D] packed with every sequence's r-th shard.
            scale: softmax scale (default 1/sqrt(head_dim)).
            seq_len: the whole sequence's length, checked against the shards when given.
            cu_seqlens: varlen specs: [B + 1] int32 cumulative lengths of the whole
                sequences (the same on every rank; each length divides by the world size).
            max_seqlen: varlen specs: the longest whole sequence (read from
                cu_seqlens when None).

        Raises:
            ValueError: on every rank, before any transfer, if the inputs do not fit.
        """
        kernel = self.kernel
        # Every problem, an argument's type included, is found before the ranks compare
        # notes: a rank that raised alone would leave the others waiting. So anything
        # the checks themselves raise on this rank is its problem too.
        # A varlen call reads cu_seqlens to the host once (one sync), here: the checks,
        # the ranks' signature and the call itself all use these bounds.
        problem, grads, signature, bounds = None, False, [], None
        try:
            if extra:
                problem = (f"takes q, k and v as its only positional arguments, got {len(extra)} more "
                           "(scale, seq_len, cu_seqlens and max_seqlen are keywords)")
            elif unknown:
                problem = f"unexpected keyword argument(s): {', '.join(sorted(unknown))}"
            seq_len, max_seqlen = _plain_int(seq_len), _plain_int(max_seqlen)
            if problem is None and scale is not None:
                problem = _scale_problem(scale)
            if problem is None:
                problem = _local_problem(kernel, q, k, v, kernel.varlen)
            if problem is None:
                problem, bounds = self._shape_problem(q, k, seq_len, cu_seqlens, max_seqlen)
            if problem is None:
                problem = self._grid_problem(q, k, bounds)
            grads = problem is None and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            if grads and not kernel.has_backward:
                problem = f"{kernel.name} has no backward kernels: gradients need a spec with backward: true"
            if problem is None:
                scale = kernel.default_scale() if scale is None else float(scale)
                signature = _signature(
                    q, k, v, spec=kernel.identity, mode=self.mode, layout=self.layout, scale=scale,
                    grads=grads, bounds=bounds if kernel.varlen else None,
                    max_seqlen=max_seqlen if kernel.varlen else None)
        except Exception as exc:  # noqa: BLE001 - reported on every rank by agree()
            problem = f"the inputs could not be checked ({type(exc).__name__}: {exc})"
        agree(self.group, problem, signature)
        if self.mode == "ulysses":
            return self._ulysses(q, k, v, scale, cu_seqlens, bounds, max_seqlen)
        if kernel.varlen:
            lengths = tuple(n // self.world_size for n in _lengths(bounds))
            plans = packed.packed_plans(kernel.mask, self.layout, self.world_size, self.rank, lengths)
            out, _ = packed.PackedRingAttention.apply(q, k, v, kernel, self.ring, plans, self.layout,
                                                      lengths, scale)
            return out
        plans = rings.step_plans(kernel.mask, self.layout, self.world_size, self.rank, q.shape[2])
        out, _ = rings.RingAttention.apply(q, k, v, kernel, self.ring, plans, scale)
        return out

    def _grid_problem(self, q, k, bounds) -> str | None:
        """The kernels' grid limits for the calls this rank will make (ring: its
        shard's heads and rows; all-to-all: its share of the heads, every row),
        before any transfer. ``bounds``: a varlen call's cu_seqlens, on the host."""
        share = self.world_size if self.mode == "ulysses" else 1
        if self.kernel.varlen:
            batch = len(bounds) - 1
            longest = max(_lengths(bounds), default=0)
            rows = longest if self.mode == "ulysses" else longest // self.world_size
        else:
            batch, rows = q.shape[0], q.shape[2] * share
        return self.kernel.grid_problem(batch, q.shape[1] // share, k.shape[1] // share, rows, rows)

    def _heads_problem(self, q, k) -> str | None:
        if self.mode != "ulysses":
            return None
        for name, heads in (("query", q.shape[1]), ("kv", k.shape[1])):
            if heads % self.world_size:
                return (f"all-to-all mode scatters heads over the ranks: the {name} heads ({heads}) "
                        f"must divide by the world size ({self.world_size}); use mode='ring'")
        return None

    def _shape_problem(self, q, k, seq_len, cu_seqlens, max_seqlen=None):
        """(problem or None, a varlen call's cu_seqlens read to the host, else None)."""
        if not self.kernel.varlen:
            return self._dense_problem(q, k, seq_len, cu_seqlens, max_seqlen), None
        if seq_len is not None:
            return (f"seq_len is for [B, H, S, D] shards; {self.kernel.name} is a varlen spec, "
                    "whose lengths cu_seqlens gives"), None
        if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1
                or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2):
            return ("cu_seqlens must be a 1-D int32 tensor of the whole sequences' cumulative "
                    "lengths, 0 first (at least 2 entries)"), None
        if cu_seqlens.device.type == "meta":
            return "cu_seqlens is a meta tensor: it holds no lengths to read", None
        bounds = cu_seqlens.tolist()  # the call's one host read of them
        return self._packed_problem(q, k, bounds, max_seqlen), bounds

    def _packed_problem(self, q, k, values, max_seqlen) -> str | None:
        """A packed batch's problem with its cu_seqlens ``values`` (on the host)."""
        world = self.world_size
        if values[0] != 0:
            return f"cu_seqlens must start at 0, got {values[0]}"
        lengths = _lengths(values)
        if min(lengths) < 0:
            return "cu_seqlens must not decrease"
        uneven = [n for n in lengths if n % world]
        if uneven:
            return (f"every packed sequence's length must divide by the world size ({world}) "
                    f"so that each rank holds an equal shard of it; got {uneven[0]}")
        if values[-1] != q.shape[0] * world:
            return (f"cu_seqlens ends at {values[-1]}, but {world} shards of {q.shape[0]} "
                    f"rows hold {q.shape[0] * world}")
        if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)
                                       or not max(lengths) <= max_seqlen <= values[-1]):
            return (f"max_seqlen must be None or an int from the longest sequence ({max(lengths)}) "
                    f"to the packed total ({values[-1]}), got {max_seqlen!r}")
        if max(lengths) > MAX_POSITIONS:
            return (f"every packed sequence must be at most {MAX_POSITIONS} rows long (the kernels' "
                    f"int32 positions), got {max(lengths)}")
        return self._heads_problem(q, k)

    def _dense_problem(self, q, k, seq_len, cu_seqlens, max_seqlen) -> str | None:
        """A [B, H, S, D] shard's problem."""
        world = self.world_size
        if cu_seqlens is not None:
            return f"cu_seqlens is for varlen specs; {self.kernel.name} takes [B, H, S, D] shards"
        if max_seqlen is not None:
            return f"max_seqlen is for varlen specs; {self.kernel.name} takes [B, H, S, D] shards"
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)):
            return f"seq_len must be an int or None, got {seq_len!r}"
        if seq_len is not None and seq_len != q.shape[2] * world:
            return (f"seq_len {seq_len} needs shards of {seq_len / world:g} rows on {world} ranks, "
                    f"got {q.shape[2]}")
        if q.shape[2] * world > MAX_POSITIONS:
            return (f"the sequence must be at most {MAX_POSITIONS} rows long (the kernels' int32 positions), "
                    f"got {world} shards of {q.shape[2]}")
        return self._heads_problem(q, k)

    def _ulysses(self, q, k, v, scale, cu_seqlens, bounds, max_seqlen):
        group, world = self.group, self.world_size
        if q.numel() == 0:
            # Every rank holds no rows (the ranks agreed on the shapes): the local call
            # gives the empty output, with nothing to exchange.
            extra = {}
            if self.kernel.varlen:  # every sequence empty: cu_seqlens all 0
                extra = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=0, max_seqlen_k=0)
            out = self.kernel.attention(q, k, v, scale, **extra)
            return out[0] if isinstance(out, tuple) else out
        if self.kernel.varlen:
            if world > 1:
                total = q.shape[0] * world
                index = ulysses.packed_order(cu_seqlens, world, total)
                q, k, v = (ulysses.SeqToHeads.apply(t, group, 0).index_select(0, index) for t in (q, k, v))
            if max_seqlen is None:
                max_seqlen = max(_lengths(bounds))
            out = self.kernel.attention(q, k, v, scale, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                        max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
            out = out[0] if isinstance(out, tuple) else out
            if world > 1:
                out = _unpermute(out, index, 0)
                out = ulysses.HeadsToSeq.apply(out, group, 0)
            return out
        if world > 1:
            natural = torch.argsort(layouts.order(self.layout, world, q.shape[2])).to(q.device)
            q, k, v = (ulysses.SeqToHeads.apply(t, group, 2).index_select(2, natural) for t in (q, k, v))
        out = self.kernel.attention(q, k, v, scale)
        out = out[0] if isinstance(out, tuple) else out
        if world > 1:
            out = _unpermute(out, natural, 2)
            out = ulysses.HeadsToSeq.apply(out, group, 2)
        return out


def _unpermute(x, index, dim):
    """y with y.index_select(dim, index) == x (index a permutation)."""
    return x.index_select(dim, torch.argsort(index))


def context_parallel_attention(module, q, k, v, *, group=None, mode=None, layout="zigzag", **kwargs):
    """One call of ContextParallelAttention(module, group, mode=, layout=)."""
    return ContextParallelAttention(module, group, mode=mode, layout=layout)(q, k, v, **kwargs)
