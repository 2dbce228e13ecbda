"""Check: run a generated module's kernels on the CPU, with torch standing in for
cuda.tile.

A generated kernel is a Python function over tiles. Here each CTA of a launch runs
that function in Python, one after the other, with every ``ct.*`` operation done
by torch on CPU tensors: loads and stores slice the arrays (tile indices, ``order``
and padding as cuTile defines them), ``ct.mma`` multiplies in float32 the operands
the kernel rounded, reductions and exponentials run in the tile's own type
(flushed to zero where the kernel asks). The
module's launcher runs unchanged (its argument checks, configs, grids and
constants), with ``torch.cuda`` answering as an ``sm_XY`` device.

What it is for: the numerics and the index arithmetic of a kernel (masks, loop
bounds, tile edges, GQA, offsets) checked against the fp64 reference on a machine
without a GPU. What it is not: a model of the hardware's rounding (MUFU's
exponentials and approximate division run exactly), its speed, or its memory model. It is
stricter than a GPU where cuTile leaves behaviour undefined: a load's undetermined
padding is NaN, so a kernel that lets padding reach its output fails, and a tile
wholly outside its array raises.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import itertools
import math
import re
import sys
import threading
import types
from pathlib import Path

import torch

import cuda.tile as _ct

# cuTile's dtype names and the torch types that stand for them.
_DTYPES = {
    "bool_": torch.bool, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32,
    "uint64": torch.uint64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64, "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


class EmulationError(RuntimeError):
    """A kernel did something whose result cuTile leaves undefined, or something
    the emulator does not model."""


def torch_dtype(dtype) -> torch.dtype:
    """The torch type for a cuTile or torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = getattr(dtype, "name", None) or str(dtype)
    name = name.rsplit(".", 1)[-1]
    if name == "bool":
        name = "bool_"
    if name not in _DTYPES:
        raise EmulationError(f"dtype {dtype!r} is not modelled")
    return _DTYPES[name]


def _tensor(x, like: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if like is not None:
        return torch.tensor(x, dtype=like.dtype if not isinstance(x, float) or like.is_floating_point()
                            else torch.float32)
    # cuTile's default scalar types: int32 and float32.
    if isinstance(x, bool):
        return torch.tensor(x)
    return torch.tensor(x, dtype=torch.int32 if isinstance(x, int) else torch.float32)


def _pair(x, y):
    """Two operands of an elementwise op as tensors, a Python scalar taking the
    other's type (cuTile's weak scalars)."""
    if isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
        return x, _tensor(y, x)
    if isinstance(y, torch.Tensor) and not isinstance(x, torch.Tensor):
        return _tensor(x, y), y
    return x, y


class _U32(torch.Tensor):
    """A uint32 tile. torch's CPU kernels lack shifts, adds and comparisons on
    uint32, so the values live in int64 and every integer result is wrapped to 32
    bits (multiplication's low 32 bits are exact in two's complement)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.int64:
            with torch._C.DisableTorchFunctionSubclass():
                out = out & 0xFFFFFFFF
            return out.as_subclass(_U32)
        return out


def _uint32(x: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.int64) & 0xFFFFFFFF).as_subclass(_U32)


class _Grid(threading.local):
    """The CTA being run: its block ids and the grid's size, each thread's own (two
    threads emulating launches at once read their own CTA's ids, not the last one
    either of them set)."""

    bid = (0, 0, 0)
    size = (1, 1, 1)


_GRID = _Grid()


def _padding_value(mode, dtype: torch.dtype):
    name = getattr(mode, "name", "UNDETERMINED")
    if not dtype.is_floating_point:
        # Undetermined integer padding: a value no index or id takes.
        return 0 if name in ("ZERO", "NEG_ZERO") else -(2**30) + 7
    return {"ZERO": 0.0, "NEG_ZERO": -0.0, "POS_INF": math.inf, "NEG_INF": -math.inf}.get(name, math.nan)


def _tile_space(array: torch.Tensor, index, shape, order) -> tuple[torch.Tensor, list, list]:
    if order in (None, "C"):
        view = array
    elif order == "F":
        view = array.permute(*reversed(range(array.dim())))
    else:
        view = array.permute(*order)
    if len(index) != view.dim() or len(shape) != view.dim():
        raise EmulationError(f"a tile index {tuple(index)} / shape {tuple(shape)} for a {view.dim()}-D array")
    src, dst = [], []
    for i, s, n in zip(index, shape, view.shape):
        start = int(i) * s
        stop = builtins.min(start + s, n)
        if start < 0 or start >= n:
            return view, None, None
        src.append(slice(start, stop))
        dst.append(slice(0, stop - start))
    return view, src, dst


def load(array, index, shape, *, order="C", padding_mode=None, check_bounds=True, latency=None,
         allow_tma=None, **_):
    if tuple(shape) == () and len(index) == array.dim():  # one element, as a 0-d tile
        if not all(0 <= int(i) < n for i, n in zip(index, array.shape)):
            raise EmulationError(f"ct.load of element {tuple(index)} outside {tuple(array.shape)}")
        return array[tuple(int(i) for i in index)].clone()
    view, src, dst = _tile_space(array, index, shape, order)
    if src is None:
        raise EmulationError(
            f"ct.load of tile {tuple(int(i) for i in index)} (shape {tuple(shape)}) lies wholly "
            f"outside an array of shape {tuple(view.shape)}: undefined in cuTile")
    tile = torch.full(tuple(shape), _padding_value(padding_mode, array.dtype), dtype=array.dtype)
    part = view[tuple(src)]
    if not check_bounds and tuple(part.shape) != tuple(shape):
        raise EmulationError(f"ct.load with check_bounds=False reaches past an array of shape "
                             f"{tuple(view.shape)}: undefined in cuTile")
    tile[tuple(dst)] = part
    return tile


def store(array, index, tile, *, order="C", check_bounds=True, latency=None, allow_tma=None, **_):
    if not isinstance(tile, torch.Tensor):
        raise EmulationError("ct.store of a scalar is not modelled")
    view, src, dst = _tile_space(array, index, tuple(tile.shape), order)
    if src is None:
        raise EmulationError(f"ct.store of tile {tuple(int(i) for i in index)} lies wholly outside "
                             f"an array of shape {tuple(view.shape)}: undefined in cuTile")
    if tile.dtype != array.dtype:
        raise EmulationError(f"ct.store of a {tile.dtype} tile into a {array.dtype} array")
    view[tuple(src)] = tile[tuple(dst)]


def _indices(array: torch.Tensor, indices):
    idx = indices if isinstance(indices, tuple) else (indices,)
    if len(idx) != array.dim():
        raise EmulationError(f"{len(idx)} index tiles for a {array.dim()}-D array")
    idx = torch.broadcast_tensors(*(_tensor(i).to(torch.int64) for i in idx))
    inside = torch.ones(idx[0].shape, dtype=torch.bool)
    for i, n in zip(idx, array.shape):
        inside &= (i >= 0) & (i < n)
    safe = tuple(torch.where(inside, i, 0) for i in idx)
    return safe, inside


def gather(array, indices, *, mask=None, padding_value=0, check_bounds=True, latency=None):
    safe, inside = _indices(array, indices)
    if mask is not None:
        inside = inside & torch.broadcast_to(_tensor(mask), inside.shape)
    values = array[safe]
    return torch.where(inside, values, torch.tensor(padding_value, dtype=array.dtype))


def scatter(array, indices, value, *, mask=None, check_bounds=True, latency=None):
    safe, inside = _indices(array, indices)
    if mask is not None:
        inside = inside & torch.broadcast_to(_tensor(mask), inside.shape)
    value = torch.broadcast_to(_tensor(value, array), inside.shape).to(array.dtype)
    array[tuple(i[inside] for i in safe)] = value[inside]


def atomic_add(array, indices, update, *, check_bounds=True, **_):
    safe, inside = _indices(array, indices)
    update = torch.broadcast_to(_tensor(update, array), inside.shape).to(array.dtype)
    old = array[safe].clone()
    array.index_put_(tuple(i[inside] for i in safe), update[inside], accumulate=True)
    return old


def mma(x, y, acc, *, use_fast_acc=False):
    """acc + x @ y, the operands as the kernel rounded them, products summed in float32."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[0]:
        raise EmulationError(f"ct.mma of {tuple(x.shape)} and {tuple(y.shape)}")
    product = x.to(torch.float32) @ y.to(torch.float32)
    return (acc.to(torch.float32) + product).to(acc.dtype)


def full(shape, fill_value, dtype):
    return torch.full(tuple(shape), fill_value, dtype=torch_dtype(dtype))


def zeros(shape, dtype):
    return full(shape, 0, dtype)


def ones(shape, dtype):
    return full(shape, 1, dtype)


def arange(size, *, dtype, start=0, step=1):
    return torch.arange(start, start + size * step, step, dtype=torch_dtype(dtype))


def where(cond, x, y):
    if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
        x = _tensor(x)  # two scalars: cuTile's default type, int32 or float32
    x, y = _pair(x, y)
    return torch.where(_tensor(cond), x, y)


def astype(x, dtype, *, rounding_mode=None):
    target = torch_dtype(dtype)
    if target == torch.uint32:
        x = _tensor(x)
        return _uint32(torch.trunc(x) if x.is_floating_point() else x)
    if isinstance(x, _U32):
        x = x.as_subclass(torch.Tensor)
    if target.is_floating_point or not _tensor(x).is_floating_point():
        return _tensor(x).to(target)
    return torch.trunc(_tensor(x)).to(target)  # float to int rounds toward zero


def bitcast(x, dtype):
    return x.view(torch_dtype(dtype))


def _reduce(fn, x, axis, keepdims):
    x = _tensor(x)
    if axis is None:
        out = fn(x)
        return out.reshape((1,) * x.dim()) if keepdims else out
    return fn(x, dim=axis, keepdim=keepdims)


def _reduce_ignoring_nan(fn, x, axis, keepdims, propagate_nan, fill):
    """A min or max reduction as cuTile's: NaN elements ignored unless propagate_nan
    (NaN only where every element is NaN)."""
    x = _tensor(x)
    if propagate_nan or not x.is_floating_point():
        return _reduce(fn, x, axis, keepdims)
    nan = torch.isnan(x)
    out = _reduce(fn, torch.where(nan, torch.tensor(fill, dtype=x.dtype), x), axis, keepdims)
    every = _reduce(torch.amin, nan.to(torch.int8), axis, keepdims) > 0
    return torch.where(every, torch.tensor(math.nan, dtype=x.dtype), out)


def max(x, axis=None, *, keepdims=False, flush_to_zero=False, propagate_nan=False):  # noqa: A001
    return _reduce_ignoring_nan(torch.amax, x, axis, keepdims, propagate_nan, -math.inf)


def min(x, axis=None, *, keepdims=False, flush_to_zero=False, propagate_nan=False):  # noqa: A001
    return _reduce_ignoring_nan(torch.amin, x, axis, keepdims, propagate_nan, math.inf)


def sum(x, axis=None, *, keepdims=False, rounding_mode=None, flush_to_zero=False):  # noqa: A001
    x = _tensor(x)
    if axis is None:
        out = torch.sum(x).to(x.dtype)
        return out.reshape((1,) * x.dim()) if keepdims else out
    return torch.sum(x, dim=axis, keepdim=keepdims).to(x.dtype)


def cumsum(x, axis=0, *, reverse=False, rounding_mode=None, flush_to_zero=False):
    x = _tensor(x)
    if reverse:
        return torch.flip(torch.cumsum(torch.flip(x, (axis,)), dim=axis), (axis,)).to(x.dtype)
    return torch.cumsum(x, dim=axis).to(x.dtype)


def cdiv(x, y):
    return -((-x) // y)


def _flush(x: torch.Tensor, flush_to_zero: bool) -> torch.Tensor:
    """flush_to_zero: float32 results below the smallest normal (2**-126) read 0."""
    if not flush_to_zero or x.dtype != torch.float32:
        return x
    return torch.where(x.abs() < 2.0 ** -126, torch.zeros_like(x), x)


def exp2(x, *, flush_to_zero=False):
    return _flush(torch.exp2(_tensor(x)), flush_to_zero)


def exp(x, *, rounding_mode=None):
    return torch.exp(_tensor(x))


def log(x):
    return torch.log(_tensor(x))


def log2(x):
    return torch.log2(_tensor(x))


def tanh(x, *, rounding_mode=None):
    return torch.tanh(_tensor(x))


def sqrt(x, *, rounding_mode=None, flush_to_zero=False):
    return torch.sqrt(_tensor(x))


def floor(x):
    return torch.floor(_tensor(x))


def abs(x):  # noqa: A001
    return torch.abs(_tensor(x))


def truediv(x, y, *, rounding_mode=None, flush_to_zero=False):
    x, y = _pair(x, y)
    return _flush(x / y, flush_to_zero)


def _scalar_pair(x, y):
    """_pair, two scalars made tiles of cuTile's default types first."""
    if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
        x = _tensor(x)
    return _pair(x, y)


def minimum(x, y, *, flush_to_zero=False, propagate_nan=False):
    """Elementwise minimum; a NaN operand is ignored unless propagate_nan (cuTile's
    default: min(NaN, 1.0) is 1.0)."""
    x, y = _scalar_pair(x, y)
    return torch.minimum(x, y) if propagate_nan else torch.fmin(x, y)


def maximum(x, y, *, flush_to_zero=False, propagate_nan=False):
    x, y = _scalar_pair(x, y)
    return torch.maximum(x, y) if propagate_nan else torch.fmax(x, y)


def bitwise_and(x, y):
    x, y = _pair(x, y)
    return x & y


def bitwise_lshift(x, y):
    """x << y in x's integer width: bits shifted past it are dropped, as on the GPU
    (an int32 result wraps into the sign bit)."""
    x, y = _pair(x, y)
    if isinstance(x, _U32):
        return _uint32(x.as_subclass(torch.Tensor) << y)
    if x.dtype == torch.int32:
        wide = (x.to(torch.int64) << y.to(torch.int64)) & 0xFFFFFFFF
        return torch.where(wide >= 2**31, wide - 2**32, wide).to(torch.int32)
    return x << y


def permute(x, axes):
    return x.permute(*axes).contiguous()


def reshape(x, shape):
    return x.reshape(tuple(shape))


def broadcast_to(x, shape):
    return torch.broadcast_to(_tensor(x), tuple(shape)).clone()


class _I32(int):
    """An int32 scalar (a block index and what the kernel computes from it: batch,
    head, a tile's number). On the GPU these are int32 scalar tiles, whose
    arithmetic wraps at 32 bits (a hook's ``h * 1103515245``); a Python int would not.
    Operations with another int give an _I32 (wrapped); with a float a float; with a
    tensor the tensor's own operation."""

    __slots__ = ()

    def __new__(cls, value):
        value = (int(value) + 2**31) % 2**32 - 2**31
        return super().__new__(cls, value)

    def __repr__(self):
        return f"_I32({int(self)})"


def _i32_binary(name):
    base = getattr(int, name)

    def op(self, other):
        if isinstance(other, bool) or not isinstance(other, int):
            return NotImplemented if isinstance(other, torch.Tensor) else base(int(self), other)
        out = base(int(self), int(other))
        return _I32(out) if type(out) is int else out
    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__lshift__",
              "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__"):
    setattr(_I32, _name, _i32_binary(_name))
_I32.__neg__ = lambda self: _I32(-int(self))
_I32.__pos__ = lambda self: self
_I32.__abs__ = lambda self: _I32(abs(int(self)))
_I32.__invert__ = lambda self: _I32(~int(self))


def bid(axis):
    return _I32(_GRID.bid[axis])


def num_blocks(axis):
    return _I32(_GRID.size[axis])


def grid_dependency_control_wait():
    return None


def grid_dependency_control_launch_dependents():
    return None


def launch(stream, grid, kernel, args, **options):
    """Run every CTA of the grid, x fastest, each to its end before the next starts
    (a schedule every launch option, programmatic dependent launch included, allows)."""
    fn = getattr(kernel, "_pyfunc", kernel)
    # A GPU kernel is invisible to autograd and to autocast: so is its emulation
    # (under CPU autocast, its torch operations would run in the autocast's dtype).
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        try:
            _run_grid(fn, grid, args)
        except AttributeError as exc:
            # A kernel that takes a tile's .astype or an array's .slice outside
            # emulating() failed with "'Tensor' object has no attribute 'astype'"
            # (kernels that use neither, such as a block map's, run anywhere).
            if _PATCH_DEPTH == 0 and exc.name in _METHODS:
                raise RuntimeError(
                    "an emulated kernel runs only inside specgen.check.emulate.emulating(): "
                    "`with emulate.emulating(): out = m.attention(q, k, v)`") from None
            raise


def _run_grid(fn, grid, args):
    grid = tuple(grid) + (1,) * (3 - len(grid))
    _GRID.size = grid
    for z, y, x in itertools.product(range(grid[2]), range(grid[1]), range(grid[0])):
        _GRID.bid = (x, y, z)
        fn(*args)


def _builtin_max(*args, **kwargs):
    """The kernels' ``max(a, b)``: elementwise on tiles, Python's on numbers."""
    if len(args) == 2 and any(isinstance(a, torch.Tensor) for a in args):
        return maximum(*args)
    return builtins.max(*args, **kwargs)


def _builtin_min(*args, **kwargs):
    if len(args) == 2 and any(isinstance(a, torch.Tensor) for a in args):
        return minimum(*args)
    return builtins.min(*args, **kwargs)


def _tile_astype(self, dtype, *, rounding_mode=None):
    return astype(self, dtype)


def _array_slice(self, axis, start, stop):
    """cuTile's Array.slice: a view of [start, stop) along ``axis``."""
    start, stop = int(start), int(stop)
    n = self.shape[axis]
    if not (0 <= start < n and start <= stop <= n):
        raise EmulationError(f"Array.slice(axis={axis}, start={start}, stop={stop}) of an axis of "
                             f"{n}: cuTile needs 0 <= start < N and start <= stop <= N")
    return self.narrow(axis, start, stop - start)


# Everything else (kernel, Constant, ByTarget, PaddingMode, RoundingMode, ...) is
# cuTile's own: the module's decorators and annotations need no device.
_OVERRIDES = {name: value for name, value in globals().items()
              if callable(value) and not name.startswith("_") and value.__module__ == __name__
              and name not in ("torch_dtype", "EmulationError", "load_module", "emulating")}
_OVERRIDES.update({name: dtype for name, dtype in _DTYPES.items()})
_OVERRIDES["bool_"] = torch.bool


class _TileShim(types.ModuleType):
    def __getattr__(self, name):
        return getattr(_ct, name)


class _FakeCuda(types.ModuleType):
    """torch.cuda as the launcher sees it: one device of compute capability ``sm``."""

    def __init__(self, sm: tuple[int, int]):
        super().__init__("torch.cuda")
        self._sm = sm

    def get_device_capability(self, device=None):
        return self._sm

    def current_device(self):
        return 0

    def get_device_properties(self, device=None):
        # An H100 SXM's count of SMs, for launchers that size grids by it.
        return types.SimpleNamespace(name="cuTile emulator", major=self._sm[0], minor=self._sm[1],
                                     multi_processor_count=132, total_memory=80 << 30)

    def current_stream(self, device=None):
        return types.SimpleNamespace(cuda_stream=0)  # the one emulated stream

    def is_available(self):
        return True

    def is_current_stream_capturing(self):
        return False

    def __getattr__(self, name):
        raise EmulationError(f"torch.cuda.{name} is not modelled by the emulator")


def _device(*args, **kwargs) -> torch.device:
    """torch.device, with the index the launchers give "cuda" dropped on the CPU."""
    made = torch.device(*args, **kwargs)
    return torch.device("cpu") if made.type == "cpu" else made


class _FakeC(types.ModuleType):
    """torch._C, with the raw current stream and the index of the one emulated device."""

    def __init__(self):
        super().__init__("torch._C")

    @staticmethod
    def _cuda_getCurrentRawStream(index):
        return 0

    @staticmethod
    def _cuda_getDevice():
        return 0

    def __getattr__(self, name):
        return getattr(torch._C, name)


class _TorchShim(types.ModuleType):
    def __init__(self, sm):
        super().__init__("torch")
        self.cuda = _FakeCuda(sm)
        self._C = _FakeC()
        self.device = _device

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_for_cuda(node: ast.AST) -> ast.AST:
    """``node`` with each "cuda" string constant in it made "cpu"."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and sub.value == "cuda":
            sub.value = "cpu"
    return node


def _invert(x):
    """~x as a kernel computes it: a bool (a condition on scalar tiles) is negated."""
    return (not x) if isinstance(x, bool) else ~x


class _NoDevice(ast.NodeTransformer):
    """The emulated device is the CPU: ``x.is_cuda`` reads True and the device
    name "cuda" reads "cpu" (the launchers' device checks and defaults); custom
    ops register under specgen_emulated::, their names followed by ``op_suffix``
    (load_module's: the module's name, its compute capability and the load's number)."""

    def __init__(self, op_suffix: str = ""):
        super().__init__()
        self.op_suffix = op_suffix

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if node.attr == "is_cuda" and isinstance(node.ctx, ast.Load):
            return ast.copy_location(ast.Constant(True), node)
        return node

    def visit_Call(self, node):
        # torch.device("cuda", ...), torch.device("cuda" if device is None else device)
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "device" and node.args:
            node.args[0] = _cpu_for_cuda(node.args[0])
        return node

    def visit_UnaryOp(self, node):
        # In a kernel, the block index and what is computed from it are scalar
        # tiles, and ~ of a boolean tile is its negation. Emulated, they are Python
        # ints, whose ~True is -2: ~ goes through _invert, which negates a bool.
        self.generic_visit(node)
        if isinstance(node.op, ast.Invert):
            call = ast.Call(ast.Name("_specgen_invert", ast.Load()), [node.operand], [])
            return ast.copy_location(call, node)
        return node

    def visit_Compare(self, node):
        # device.type != "cuda"
        self.generic_visit(node)
        operands = [node.left, *node.comparators]
        if any(isinstance(o, ast.Attribute) and o.attr == "type" for o in operands):
            node.left = _cpu_for_cuda(node.left)
            node.comparators = [_cpu_for_cuda(c) for c in node.comparators]
        return node

    def visit_Constant(self, node):
        # Only device names are rewritten (above): the string "cuda" elsewhere may be
        # a hook tensor's name, which the launcher looks up by that name.
        if isinstance(node.value, str) and node.value.startswith("specgen::"):
            # Its custom ops in a namespace of their own: the module's real ops,
            # if loaded in this process, keep theirs.
            # The suffix keeps each load's ops its own: a module loaded again (another
            # sm, another name, or other text) registered nothing and traced, compiled
            # or opchecked the first load's functions (its launch configs, its patches).
            renamed = "specgen_emulated::" + node.value[len("specgen::"):] + self.op_suffix
            return ast.copy_location(ast.Constant(renamed), node)
        return node


_METHODS = {"astype": _tile_astype, "slice": _array_slice}
# emulating()'s contexts open in any thread: the methods go on with the first and
# come off with the last (one thread's exit took them from another's launch, and
# two overlapping contexts put back each other's patch for good).
_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0
_PATCH_PREVIOUS = {}


@contextlib.contextmanager
def emulating():
    """Tiles and arrays (torch tensors) get cuTile's ``.astype`` and ``.slice``
    for the duration (of the outermost of the contexts open in any thread)."""
    global _PATCH_DEPTH
    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            _PATCH_PREVIOUS.update({name: torch.Tensor.__dict__.get(name) for name in _METHODS})
            for name, method in _METHODS.items():
                setattr(torch.Tensor, name, method)
        _PATCH_DEPTH += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                for name, method in _PATCH_PREVIOUS.items():
                    if method is None:
                        delattr(torch.Tensor, name)
                    else:
                        setattr(torch.Tensor, name, method)
                _PATCH_PREVIOUS.clear()


_LOADS = itertools.count()  # load_module's calls, numbered for their ops' names


def load_module(path, sm: tuple[int, int] = (9, 0), name: str | None = None,
                source: str | None = None) -> types.ModuleType:
    """Import a generated module with its kernels emulated (call them inside
    ``emulating()``). ``sm``: the compute capability its launcher sees, which picks
    its launch configs; ``source``: the module's text, where not the file's."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if source is None else source
    module_name = name or f"emulated_{path.stem}"
    # The op names take the module's name in ASCII (torch's schema parser reads no
    # other text: "modé" failed with a UnicodeDecodeError) and the load's number, so
    # two loads never share an op: not names that differ only in punctuation ("x-y",
    # "x_y"), nor one name loaded again with other text (a mutated kernel).
    op_suffix = "_" + re.sub(r"[^0-9A-Za-z_]", "_", module_name) + f"_sm{sm[0]}{sm[1]}_{next(_LOADS)}"
    tree = _NoDevice(op_suffix).visit(ast.parse(text, str(path)))
    ast.fix_missing_locations(tree)
    shim = _TileShim("cuda.tile")
    shim.__dict__.update(_OVERRIDES)
    torch_shim = _TorchShim(sm)
    cuda_pkg = types.ModuleType("cuda")
    cuda_pkg.tile = shim
    real_import = builtins.__import__

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "cuda.tile" and not fromlist:
            return cuda_pkg
        if name == "cuda.tile" and fromlist:
            return shim
        if name == "torch" and not fromlist:
            return torch_shim
        return real_import(name, globals, locals, fromlist, level)

    module = types.ModuleType(module_name)
    module.__file__ = str(path.with_name(f"{path.stem}.emulated.py"))  # no AOT folder beside it
    module.__dict__["__builtins__"] = {**builtins.__dict__, "__import__": _import}
    module.__dict__["max"] = _builtin_max
    module.__dict__["min"] = _builtin_min
    module.__dict__["_specgen_invert"] = _invert
    sys.modules.setdefault(module.__name__, module)
    exec(compile(tree, str(path), "exec"), module.__dict__)
    return module
