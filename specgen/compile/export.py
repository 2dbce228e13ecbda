"""Compile: AOT cubins per GPU target with cuda-tile's own ``export_kernel``.

No GPU is needed. Cubins go to a cache outside the repository; the key is the
procedural name, the hash of the generated source, the target and the versions of
cuda-tile and tileiras, so a repeat build costs a lookup.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import re
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from filelock import FileLock

from specgen.errors import CompileError
from specgen.plan.make import ConfigPlan, Plan, _arch_key


@dataclass(frozen=True)
class CompileResult:
    module: str
    target: str
    # One cubin per kernel of each distinct launch config of the target, in the
    # order of target_configs, each config's main kernel first.
    paths: tuple[Path, ...]
    size: int  # bytes, all cubins together
    seconds: float
    cached: bool


def cache_dir() -> Path:
    """SPECGEN_CACHE_DIR, else $XDG_CACHE_HOME/specgen, else ~/.cache/specgen."""
    if os.environ.get("SPECGEN_CACHE_DIR"):
        return Path(os.environ["SPECGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specgen"


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


@lru_cache(maxsize=None)
def toolchain_versions() -> dict:
    """Versions that change the cubin: cuda-tile and the tileiras compiler."""
    versions = {"cuda-tile": package_version("cuda-tile")}
    tileiras = package_version("nvidia-cuda-tileiras")
    if tileiras == "unknown":  # a tileiras from a CUDA toolkit on PATH
        try:
            from cuda.tile._compile import _get_compiler_version_string

            tileiras = (_get_compiler_version_string() or "unknown").strip()
        except Exception:  # noqa: BLE001 - any failure leaves the key conservative
            tileiras = "unknown"
    versions["tileiras"] = tileiras
    return versions


# 2: one cubin file per kernel (1 wrote a family's kernels back to back in one
# file, and cuobjdump, so `specgen diff`, read only the first).
# 3: each cubin has a <cubin>.json beside it naming its signatures, symbols and
# compiler options, from which `specgen build` writes the module's AOT manifest.
CACHE_FORMAT = 4


def cache_key(plan: Plan, source: str, target: str, config: ConfigPlan | None = None,
              kernel: str | None = None) -> str:
    from cuda.tile.compilation import mangle_kernel_name

    config = config or plan.target(target).configs[-1]
    kernel = kernel or plan.kernel_name
    sigs = dict(kernel_builds(plan, config, target))[kernel] or signatures(plan, target, config)
    payload = {
        "format": CACHE_FORMAT,
        # What the cubin assumes of its arguments, so a change of the exported
        # signatures never reuses an older cubin.
        "signatures": [mangle_kernel_name(kernel, s) for s in sigs],
        "kernel": kernel,
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "target": target,
        "tiles": [config.tile_m, config.tile_n],
        "hints": config.extra_hints,
        "tile_order": config.tile_order,
        **({"v_transposed": True} if config.v_transposed else {}),
        **toolchain_versions(),
        # The cubin's debug information names cuda.tile's own files by their path: a
        # copy of the same version elsewhere gives other bytes, so it gets its own
        # cache entries (the module's own file is named without its folder).
        "cuda_tile_dir": _cuda_tile_dir(),
        # cuda.tile's switches that change the code it emits (a debug build is -O0).
        "cuda_tile_switches": _cuda_tile_switches(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _cuda_tile_switches() -> dict:
    """cuda.tile's debug and testing switches, as it reads them from the environment
    at import: each changes the cubins it makes."""
    from cuda.tile import _debug

    return {name: bool(getattr(_debug, name, False)) for name in (
        "EXPERIMENTAL_CUDA_TILE_DEBUG_BUILD", "CUDA_TILE_TESTING_DISABLE_DIV",
        "CUDA_TILE_TESTING_DISABLE_TOKEN_ORDER")}


def _cuda_tile_dir() -> str:
    import cuda.tile

    return str(Path(cuda.tile.__file__).resolve().parent)


def cubin_path(plan: Plan, source: str, target: str, config: ConfigPlan | None = None,
               kernel: str | None = None) -> Path:
    """The cache file of one kernel (default: the spec's main kernel) of one config."""
    key = cache_key(plan, source, target, config, kernel)
    suffix = "" if kernel in (None, plan.kernel_name) else f"-{kernel}"
    return cache_dir() / "cubins" / plan.module_name / f"{target}-{key[:20]}{suffix}.cubin"


def kernel_builds(plan: Plan, config: ConfigPlan, target: str) -> list[tuple[str, list | None]]:
    """Every kernel a config compiles for ``target``, main kernel first: (name, its
    signatures, or None for the spec's own). Decode adds its combine kernel,
    backward: true the backward kernels, v_transposed configs the V transpose
    kernel (with the target's first config only: it has no tiles of the configs)."""
    if plan.spec.family == "decode":
        return list(decode_signatures(plan, config, target).items())
    builds: list[tuple[str, list | None]] = [(plan.kernel_name, None)]
    if plan.v_layout_param and config == target_configs(plan, target)[0]:
        builds += list(v_transpose_signatures(plan).items())  # one build per target
    if plan.block_sparse:
        builds += list(block_map_signatures(plan, config).items())
    if plan.backward:
        builds += list(backward_signatures(plan).items())
    return builds


def target_configs(plan: Plan, target: str) -> list[ConfigPlan]:
    """The distinct kernel builds the launcher can pick on ``target``."""
    seen, configs = set(), []
    for config in plan.target(target).configs:
        key = (config.tile_m, config.tile_n, tuple(config.extra_hints.items()),
               config.tile_order if plan.tile_order_param else None,
               config.v_transposed if plan.v_layout_param else None)
        if key not in seen:
            seen.add(key)
            configs.append(config)
    return configs


@lru_cache(maxsize=None)
def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def atomic_write(path: Path, data: bytes) -> None:
    """Write through a temporary file in the same folder and os.replace it in. A
    symbolic link is written through, as open() would: its target is replaced and
    the link kept. The file keeps its permission bits, as open() keeps them (a spec
    that tune rewrote went from 0640 to 0644); a new file gets the umask's."""
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:  # a new file
        mode = 0o666 & ~_umask()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:  # named for the file asked for, not the temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        # mkstemp makes the file 0600; give it the mode open() would (0644 under
        # the usual umask 022).
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_module_from_source(name: str, source: str, origin: str):
    """Import generated source as a private module (it never touches a GPU)."""
    module_name = f"_specgen_build_{name}"
    spec = importlib.util.spec_from_loader(module_name, loader=None, origin=origin)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = origin
    # cuTile reads the kernel's source through inspect/linecache: register it.
    import linecache

    lines = source.splitlines(keepends=True)
    linecache.cache[origin] = (len(source), None, lines, origin)
    sys.modules[module_name] = module
    try:
        exec(compile(source, origin, "exec"), module.__dict__)  # noqa: S102
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise CompileError(f"{origin}: import failed: {type(exc).__name__}: {exc}") from exc
    return module


def rename_op(source: str, suffix: str, origin: str = "<source>", required: bool = False) -> str:
    """A generated module's source with its custom ops named ``specgen::<op>_<suffix>``
    (and OP_NAME's other ops after it): a module names its ops after its spec, so a
    second module of the same spec in one process (an older build, a variant) would
    otherwise reuse the first one's ops, and with them the first one's kernels under
    a tracer. A source without an OP_NAME line (a module of an older specgen, whose
    forward-only modules had no op) is returned as it is unless ``required``; one
    that registers an op without an OP_NAME line is refused."""
    renamed, count = re.subn(r'^OP_NAME = "specgen::(\w+)"$', rf'OP_NAME = "specgen::\1_{suffix}"',
                             source, count=1, flags=re.M)
    if not count and (required or re.search(r"torch\.library\.(custom_op|Library)\(", source)):
        raise ValueError(f"{origin}: no OP_NAME line to rename; is it a module specgen generated?")
    return renamed


def load_module_renamed(path: Path | str, suffix: str, required: bool = True):
    """A generated module from its file, its custom ops renamed by rename_op
    (``required``: refuse a source without an OP_NAME line)."""
    path = Path(path).resolve()
    source = rename_op(path.read_text(), suffix, str(path), required=required)
    return load_module_from_source(f"{path.stem}_{suffix}", source, str(path))


def pdl_value(plan: Plan, target: str) -> bool:
    """The decode kernels' PDL constant on ``target``, as the generated ``use_pdl``
    picks it: programmatic dependent launch needs sm_90 or later, and ``auto`` uses
    it on sm_90 only."""
    arch = _arch_key(target)[1]
    if plan.pdl is False or arch < 90:
        return False
    return plan.pdl is True or arch // 10 == 9


def decode_signatures(plan: Plan, config: ConfigPlan, target: str) -> dict:
    """The decode family's kernels (split, combine and, block_sparse, the map
    kernel): {kernel name: its signatures}."""
    import cuda.tile as ct
    from cuda.tile.compilation import CallingConvention, KernelSignature, ScalarConstraint

    def array(dtype, ndim: int, elem_bytes: int = 4, inner_aligned: bool = False):
        return _array_constraint(dtype, ndim, elem_bytes, inner_aligned)

    io = getattr(ct, plan.dtype)
    cache = array(getattr(ct, plan.kv_dtype), 4, 1 if plan.kv_fp8 else 2, True)
    split = [array(io, 4, 2, True), cache, cache, array(ct.int32, 1)]
    split += [array(ct.int32, 2)] if plan.page_size else []
    split += [array(ct.float32, 1), array(ct.float32, 1)] if plan.kv_fp8 else []  # k, v descales
    sinks = [array(ct.float32, 1)] if plan.sinks else []
    parts = [array(io, 4, 2, True), array(ct.float32, 5, 4, True), array(ct.float32, 4, 4, True)]
    scalars = [ScalarConstraint(ct.float32), ScalarConstraint(ct.int32), ScalarConstraint(ct.int32)]
    convention = CallingConvention.cutile_python_v1()
    # The combine kernel is specialised on the split count padded to a power of two.
    fixed = plan.spec.splits if plan.spec.splits != "auto" else None
    split_tiles = ([1 << (fixed - 1).bit_length()] if fixed else
                   [1 << i for i in range(1, plan.max_splits.bit_length())])
    pdl = pdl_value(plan, target)
    # The mask_mod's tensors (small, any alignment) and the block map (counts, indices).
    hooks = [array(getattr(ct, dtype), len(dims)) for _, _, dtype, dims in plan.extra_tensors]
    tables = [array(ct.int32, 4)] * 2 if plan.block_sparse else []
    # splits: 1 launches the single-split form alone, and no combine.
    singles = (True,) if fixed == 1 else (True, False)
    builds = {
        plan.kernel_name: [KernelSignature(split + sinks + hooks + tables + parts + scalars
                                           + [config.tile_n, single, pdl], convention)
                           for single in singles],
    }
    combines = [KernelSignature(sinks + parts + [scalars[1], tile, pdl], convention)
                for tile in split_tiles if tile > 1]
    if combines:
        builds[plan.combine_name] = combines
    if plan.block_sparse:  # the map's kernels: states, seq_lens, hooks, q_len, max_len; the lists
        state = array(ct.int32, 4, 4, True)
        builds[plan.map_kernel_name] = [KernelSignature(
            [state, array(ct.int32, 1)] + hooks + [ScalarConstraint(ct.int32), ScalarConstraint(ct.int32), config.tile_n],
            convention)]
        builds[plan.map_list_kernel_name] = [KernelSignature(tables + [state], convention)]
    return builds


def block_map_signatures(plan: Plan, config: ConfigPlan) -> dict:
    """The block-map kernel: {its name: signatures}, by query tile at the config's
    tiles and, with backward: true, at the dQ kernel's tiles and by key tile at the
    dK/dV kernel's (Plan.bwd_map_shapes)."""
    import cuda.tile as ct
    from cuda.tile.compilation import CallingConvention, KernelSignature, ScalarConstraint

    tables = [_array_constraint(ct.int32, 4, 4, False)] * 2  # MapCounts, MapIdx
    hooks = [_array_constraint(getattr(ct, dtype), len(dims), 4, False)
             for _, _, dtype, dims in plan.extra_tensors]
    scalars = [ScalarConstraint(ct.int32)] * 3  # seq_q, seq_k, q_offset
    # The forward map's rows are the tile's positions (tile_m / gqa_ratio with pack_gqa);
    # a map_row_group kernel takes ROW_GROUP too (gqa_ratio by query tile, 1 else).
    group = (plan.group_size,) if plan.map_row_group else ()
    shapes = [(plan.map_rows(config.tile_m), config.tile_n, False, *group)]
    if plan.backward:
        shapes += plan.bwd_map_shapes()
    convention = CallingConvention.cutile_python_v1()
    return {plan.map_kernel_name: [KernelSignature(tables + hooks + scalars + list(shape), convention)
                                   for shape in dict.fromkeys(shapes)]}


def v_transpose_signatures(plan: Plan) -> dict:
    """The V transpose kernel of a module with v_transposed configs: V [B, Hkv, Skv,
    Dv] as the attention kernel takes it, VT [B, Hkv, Dv, Skv] with 16-element rows
    (transposed_v makes it), and its keys per CTA."""
    import cuda.tile as ct
    from cuda.tile.compilation import CallingConvention, KernelSignature

    io = getattr(ct, plan.dtype)
    elem_bytes = 1 if plan.dtype == "float8_e4m3fn" else 2
    v = _array_constraint(io, 4, elem_bytes, True, last_dim=plan.v_head_dim)
    v_t = _array_constraint(io, 4, elem_bytes, True)
    return {plan.v_transpose_kernel_name: [KernelSignature([v, v_t, plan.v_transpose_keys],
                                                           CallingConvention.cutile_python_v1())]}


def backward_signatures(plan: Plan) -> dict:
    """The backward kernels (dK/dV, dQ): {kernel name: its signatures}, at the
    module's tiles (plan.bwd_tile; the dQ kernel's plan.bwd_dq_tile)."""
    import cuda.tile as ct
    from cuda.tile.compilation import CallingConvention, KernelSignature, ScalarConstraint

    io = getattr(ct, plan.dtype)
    tile_m, tile_n = plan.bwd_tile
    if plan.varlen:
        # packed [total, H, D] arrays, Lse and Delta [H, total_q], cu_seqlens q and k
        qkv = _array_constraint(io, 3, 2, True)
        rows = _array_constraint(ct.float32, 2, 4, False)
        cu = [_array_constraint(ct.int32, 1, 4, False)]
        scalars = cu * 2 + [ScalarConstraint(ct.float32), ScalarConstraint(ct.int32)]  # qk_scale, q_shift
    else:
        qkv = _array_constraint(io, 4, 2, True)
        rows = _array_constraint(ct.float32, 3, 4, False)  # Lse, Delta [B, H, S]
        cu = []
        scalars = [ScalarConstraint(ct.float32), ScalarConstraint(ct.int32)]  # qk_scale, q_offset
    # dropout: seed, keep threshold, the inverse of the keep rate
    if plan.dropout:
        scalars += [ScalarConstraint(ct.int32), ScalarConstraint(ct.int32), ScalarConstraint(ct.float32)]
    convention = CallingConvention.cutile_python_v1()
    # The hook tensors the dK/dV and dQ kernels gather from (small, any alignment),
    # and the float32 gradients of the learnable ones, which the dQ kernel adds to
    # (and the dK/dV kernel, where a learnable subscript varies with the key).
    hooks = [_array_constraint(getattr(ct, dtype), len(dims), 4, False)
             for _, _, dtype, dims in plan.extra_tensors]
    if plan.block_sparse:  # the block map at the kernel's tiles: MapCounts, MapIdx
        hooks += [_array_constraint(ct.int32, 4, 4, False)] * 2
    ndim = {name: len(dims) for name, _, _, dims in plan.extra_tensors}
    grads = [_array_constraint(ct.float32, ndim[name], 4, False) for name, _ in plan.learnable]
    # The dQ kernel takes the sink logits (for its own D) and stores its tiles' shares
    # of their gradient [B, H, query tiles]; the dK/dV kernel (not varlen) sums those
    # shares into the gradient [H].
    per_head, shares = _array_constraint(ct.float32, 1, 4, False), _array_constraint(ct.float32, 3, 4, False)
    sinks = [per_head, shares] if plan.sinks and plan.bwd_own_delta else []
    sink_sum = [shares, per_head] if sinks and not plan.varlen else []
    dkdv, dq = plan.bwd_names
    order = [ScalarConstraint(ct.int32)] if plan.bwd_heavy_first else []  # global_order
    # The dQ kernel also reads Out (it forms D), and where it forms Q * pre it takes
    # that factor and the array it stores the product in.
    q_s = [qkv, ScalarConstraint(ct.float32)] if plan.bwd_prescale else []
    # A module that returns the LSE takes its gradient in the dQ kernel (DLse, as Lse).
    lse_grad = plan.spec.return_lse
    return {
        dkdv: [KernelSignature([qkv] * 4 + [rows, rows, qkv, qkv] + hooks
                               + (grads if plan.dkdv_tensor_grads else [])
                               + sink_sum
                               + scalars + order + [tile_m, tile_n],
                               convention)],
        dq: [KernelSignature([qkv] * 5 + [rows] * (3 if lse_grad else 2) + [qkv] + q_s + hooks + grads + sinks + scalars
                             + ([ScalarConstraint(ct.float32)] if lse_grad else [])  # dlse_weight
                             + [ScalarConstraint(ct.int32)]  # exact_delta
                             + order + list(plan.bwd_dq_tile), convention)],
    }


def _array_constraint(dtype, ndim: int, elem_bytes: int, inner_aligned: bool,
                      last_dim: int | None = None):
    """An array with a contiguous last axis; ``inner_aligned``: 16-byte aligned rows
    and base (q, k, v, out as torch makes them). ``last_dim``: the last axis is always
    this head dim (the launcher checks it), so the cubin may assume its divisibility
    as the JIT does for the same tensors (a power of two up to 16)."""
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint

    align = 16 // elem_bytes if inner_aligned else 1
    last = min(16, last_dim & -last_dim) if last_dim else 1
    return ArrayConstraint(
        dtype,
        ndim,
        shape_divisible_by=(1,) * (ndim - 1) + (last,),
        index_dtype=ct.int32,
        stride_lower_bound_incl=0,
        alias_groups=(),
        may_alias_internally=False,
        stride_constant=(None,) * (ndim - 1) + (1,),
        stride_divisible_by=(align,) * (ndim - 1) + (1,),
        base_addr_divisible_by=16 if inner_aligned else elem_bytes,
    )


def signatures(plan: Plan, target: str, config: ConfigPlan | None = None):
    """One KernelSignature per value of the kernel's runtime-specialised constants,
    built from the plan's parameter list (specgen.plan.abi).

    q, k, v and out are arrays with a contiguous last axis and 16-byte aligned rows,
    the layout torch gives; the smaller tensors are made contiguous by the launcher.
    The JIT path specialises again for whatever it is called with.
    """
    import cuda.tile as ct
    from cuda.tile.compilation import CallingConvention, KernelSignature, ScalarConstraint

    cfg = config or plan.target(target).configs[-1]
    constants = {"TILE_M": [cfg.tile_m], "TILE_N": [cfg.tile_n], "EVEN_N": [True, False],
                 "TILES_OUTER": [cfg.tiles_outer], "V_TRANSPOSED": [cfg.v_transposed]}
    fixed = []
    for param in plan.params:
        if param.kind == "array":
            io = param.layout == "io"
            elem_bytes = 1 if param.dtype == "float8_e4m3fn" else 2 if io else 4
            # A transposed V's last axis is the (padded-stride) key axis, of any length.
            last_dim = None if param.name == "V" and cfg.v_transposed else param.last_dim
            fixed.append(_array_constraint(getattr(ct, param.dtype), param.ndim, elem_bytes, io,
                                           last_dim=last_dim))
        elif param.kind == "scalar":
            fixed.append(ScalarConstraint(getattr(ct, param.dtype)))
        else:
            fixed.append(constants[param.name])
    # Every combination of the constants with more than one value (EVEN_N).
    result = [[]]
    for value in fixed:
        options = value if isinstance(value, list) else [value]
        result = [r + [o] for r in result for o in options]
    return [KernelSignature(params, CallingConvention.cutile_python_v1()) for params in result]


def int64_signatures(sigs) -> list:
    """``sigs`` with every array indexed in int64: what a kernel's int64-indexed twin
    (the generated modules' ``AotKernel.indexed_with_int64``) is compiled for."""
    import dataclasses

    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint, KernelSignature

    def wide(p):
        return dataclasses.replace(p, index_dtype=ct.int64) if isinstance(p, ArrayConstraint) else p

    return [KernelSignature([wide(p) for p in s.parameters], s.calling_convention) for s in sigs]


def compile_target(plan: Plan, source: str, origin: str, target: str) -> CompileResult:
    """Compile one generated module for one target, through the cubin cache: one
    cubin per kernel of each distinct launch config (tiles and compiler options)."""
    start = time.perf_counter()
    module = None
    paths, size, all_cached = [], 0, True
    for config in target_configs(plan, target):
        for name, sigs in kernel_builds(plan, config, target):
            path = cubin_path(plan, source, target, config, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            # The lock makes concurrent builds of the same kernel compile it once.
            with FileLock(str(path) + ".lock"):
                if cached_entries(path) is None:  # missing, or not whole: compiled again
                    all_cached = False
                    if module is None:
                        module = load_module_from_source(plan.module_name, source, origin)
                    kernel = getattr(module, name)
                    if name == plan.kernel_name and config.extra_hints:
                        kernel = kernel.replace_hints(**config.extra_hints)
                    sigs = sigs or signatures(plan, target, config)
                    data = _export(plan, kernel, target, config, sigs)
                    entries = aot_entries(module, kernel, name, target, sigs)
                    atomic_write(path, data)
                    record = {"sha256": hashlib.sha256(data).hexdigest(), "entries": entries}
                    atomic_write(aot_entries_path(path), json.dumps(record, indent=1).encode())
            paths.append(path)
            size += path.stat().st_size
    return CompileResult(
        plan.module_name, target, tuple(paths), size, time.perf_counter() - start,
        cached=all_cached,
    )


def aot_entries_path(cubin: Path) -> Path:
    return cubin.with_name(cubin.name + ".json")


# The fields aot_entries gives each entry (the manifest adds "cubin").
ENTRY_FIELDS = ("kernel", "sm", "hints", "signature", "symbol")


def cached_entries(cubin: Path, data: bytes | None = None) -> list[dict] | None:
    """The AOT entries of a cached cubin, or None where the cache does not hold it
    whole: no cubin or record, a record that does not read, entries without their
    fields, or cubin bytes that are not the ones the record's sha256 names (a
    truncated or replaced file). ``data``: the cubin's bytes, where the caller read
    them already."""
    try:
        record = json.loads(aot_entries_path(cubin).read_text(encoding="utf-8"))
        entries = record["entries"]
        if (not isinstance(entries, list) or not entries
                or not all(isinstance(e, dict) and all(k in e for k in ENTRY_FIELDS) for e in entries)):
            return None
        if hashlib.sha256(cubin.read_bytes() if data is None else data).hexdigest() != record["sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return entries


def aot_entries(module, kernel, name: str, target: str, sigs) -> list[dict]:
    """The AOT manifest entries of one exported cubin: one per signature, with the
    symbol export_kernel gives it and the compiler options as the module's own
    ``aot_hints`` resolves them (the module compares the same values at run time)."""
    from cuda.tile.compilation import mangle_kernel_name

    hints = module.aot_hints(kernel, target)
    return [{"kernel": name, "sm": target, "hints": hints,
             "signature": mangle_kernel_name(name, sig.with_symbol(None)),
             "symbol": sig.symbol or mangle_kernel_name(name, sig)} for sig in sigs]


def _export(plan: Plan, kernel, target: str, config: ConfigPlan, sigs=None) -> bytes:
    from cuda.tile.compilation import export_kernel

    buffer = io.BytesIO()
    try:
        export_kernel(
            kernel,
            sigs or signatures(plan, target, config),
            buffer,
            gpu_code=target,
            output_format="cubin",
        )
    except Exception as exc:  # cuTile raises several unrelated types
        lines = str(exc).strip().splitlines() or [""]
        where = lines[1].strip() if len(lines) > 1 and lines[1].strip().startswith('"') else ""
        tiles = f"{config.tile_m}x{config.tile_n}"
        raise CompileError(
            f"{plan.module_name}: {target} ({tiles}): {type(exc).__name__}: {lines[0]}"
            + (f" ({where})" if where else "")
        ) from exc
    return buffer.getvalue()
