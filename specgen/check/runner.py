"""`specgen test`: a spec's kernel against the fp64 reference on a shape matrix.

Each check draws fresh random inputs and poisons the output (NaN) first, so an
element the kernel never wrote fails. Tolerances come from specgen.check.TOLERANCES.
"""

from __future__ import annotations

import math
import os
import random
import re
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from specgen.check.cases import (
    TOLERANCES,
    call_kernel,
    compare,
    compare_lse,
    decode_reference,
    feature_inputs,
    output_dtype,
    p_rounding,
    packed_reference,
    poisoned_out,
    random_decode,
    random_packed,
    random_qkv,
    reference_for,
    shape_dims,
)
from specgen.errors import InvalidSpecs, UsageError
from specgen.check.gpu import fresh_jobs, fresh_modules, require_cuda
from specgen.compile.jobs import ignore_signals, terminate_as_interrupt


@dataclass(frozen=True)
class Case:
    batch: int
    kv_heads: int
    seq_q: int
    seq_k: int
    q_offset: int = 0
    layout: str = "contiguous"  # or "transposed": a [B, S, H, D] tensor seen as [B, H, S, D]
    # varlen: (seq_q, seq_k) per sequence of a packed batch (batch, seq_q, seq_k unused)
    lengths: tuple = ()
    # decode: each sequence's cached length (new tokens included); seq_q is q_len
    decode_lens: tuple = ()

    def label(self, ratio: int) -> str:
        if self.decode_lens:
            return (f"decode q_len {self.seq_q} Hq{self.kv_heads * ratio} Hkv{self.kv_heads} "
                    f"lens {','.join(map(str, self.decode_lens))}")
        if self.lengths:
            lens = ",".join(f"{q}/{k}" if q != k else str(q) for q, k in self.lengths)
            return f"packed Hq{self.kv_heads * ratio} Hkv{self.kv_heads} lens {lens}"
        text = f"B{self.batch} Hq{self.kv_heads * ratio} Hkv{self.kv_heads} Sq{self.seq_q} Skv{self.seq_k}"
        if self.q_offset:
            text += f" off{self.q_offset}"
        if self.layout != "contiguous":
            text += f" {self.layout}"
        return text


FULL_SEQS = (1, 17, 64, 1000, 4096)
QUICK_SEQS = (1, 17, 1000)


# Packed varlen batches: ragged lengths, lengths of 1, chunked prefill (seq_q <
# seq_k), a sequence with more queries than keys (its first rows see no key when
# causal) and one long sequence.
VARLEN_LENGTHS = (
    ((1, 1),),
    ((17, 17), (64, 64), (1, 1), (1000, 1000)),
    ((5, 300), (128, 1000), (1, 1), (333, 333), (77, 64)),
    ((4096, 4096), (100, 200)),
)


# Decode batches: ragged lengths, a length of 1, lengths off the page and tile
# sizes, one long sequence (many splits) and a large batch (one split).
DECODE_LENS = (
    (1,),
    (17, 1, 300, 64),
    (1000, 4097, 5, 129),
    (32768,),
    tuple(range(1, 2 * 64 * 33, 64 * 33 // 16))[:32],
)


def case_matrix(quick: bool = False, spec: dict | None = None) -> list[Case]:
    """B in {1, 3} x Hkv in {1, 2} x Sq=Skv in FULL_SEQS; chunked prefill with
    Sq < Skv and q_offset = Skv - Sq; and a transposed (non-contiguous) layout.
    A spec with a left window adds queries placed past its keys: some rows see
    part of the window, some see no key at all (zeros, LSE -inf). ``quick``: the
    smaller matrix (lengths up to 1000, the one emulated runs take)."""
    if (spec or {}).get("family") == "decode":
        lens_sets = DECODE_LENS[:3] if quick else DECODE_LENS
        q_lens = sorted({1, spec.get("max_q_len", 1)})
        return [Case(len(lens), h, q_len, 0, decode_lens=tuple(max(n, q_len) for n in lens))
                for q_len in q_lens for h in (1, 2) for lens in lens_sets]
    if (spec or {}).get("varlen"):
        lengths = VARLEN_LENGTHS[:3] if quick else VARLEN_LENGTHS
        return [Case(len(lens), h, 0, 0, lengths=lens) for h in (1, 2) for lens in lengths]
    batches, kv_heads = ((1,), (1, 2)) if quick else ((1, 3), (1, 2))
    seqs = QUICK_SEQS if quick else FULL_SEQS
    cases = [Case(b, h, s, s) for b in batches for h in kv_heads for s in seqs]
    chunks = ((128, 1000),) if quick else ((128, 1000), (17, 4096), (1, 333))
    cases += [Case(b, h, sq, sk, sk - sq) for b in batches for h in kv_heads for sq, sk in chunks]
    cases += [Case(2, 2, 300, 300, layout="transposed"), Case(1, 2, 100, 700, 600, "transposed")]
    window = (spec or {}).get("window") or {}
    if window.get("left") is not None:
        # Positions seq_k + left - 50 ... : the first 50 rows still see a key.
        cases += [Case(1, 2, 200, 1000, 1000 + window["left"] - 50),
                  Case(2, 1, 64, 333, 333 + window["left"] + 7)]
    return cases


def _synchronize(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def run_packed_case(torch, module, case: Case, generator, device: str = "cuda") -> dict:
    """A varlen case: one packed batch against the per-sequence fp64 reference."""
    spec = module.SPEC
    batch = random_packed(spec, list(case.lengths), case.kv_heads, generator, device=device)
    extra = feature_inputs(spec, {"batch": len(case.lengths), "heads": batch.q.shape[1],
                                  "kv_heads": case.kv_heads}, generator, device=device)
    out = torch.full((*batch.q.shape[:2], batch.v.shape[2]), float("nan"),
                     dtype=getattr(torch, output_dtype(spec)), device=device)
    _, lse = call_kernel(module, batch.q, batch.k, batch.v, extra, out=out, **batch.kwargs())
    _synchronize(torch, device)
    ref, ref_lse = packed_reference(spec, batch, extra)
    model = _p_model(spec, lambda **kw: packed_reference(spec, batch, extra, **kw))
    row = _row(case.label(spec["gqa_ratio"]), spec, out, ref, lse, ref_lse, model)
    if spec.get("backward"):
        row["out_ok"] = row["ok"]
        row.update(check_packed_gradients(torch, module, batch, extra, generator))
        row["ok"] = row["ok"] and row["grad_ok"]
    return row


def check_packed_gradients(torch, module, batch, extra: dict, generator) -> dict:
    """check_gradients for a varlen batch: the gradients of the packed q, k, v (and
    sinks) against fp64 autograd of the per-sequence reference."""
    import dataclasses

    spec = module.SPEC

    def call(q, k, v, extra):
        out, lse = call_kernel(module, q, k, v, extra, **batch.kwargs())
        return (out, lse) if spec.get("return_lse") else out

    def reference(q, k, v, extra, compute_dtype):
        packed = dataclasses.replace(batch, q=q, k=k, v=v)
        out, lse = packed_reference(spec, packed, extra, compute_dtype=compute_dtype)
        return (out, lse) if spec.get("return_lse") else out

    learned = ["sinks"] if "sinks" in extra else []
    return _gradient_check(torch, (batch.q, batch.k, batch.v), extra, learned, call, reference,
                           generator)


def _gradient_check(torch, inputs, extra: dict, learned: list, call, reference, generator) -> dict:
    """The gradients of ``call(q, k, v, extra) -> out`` in q, k, v and the ``learned``
    entries of ``extra``, for a random upstream gradient, against those of
    ``reference(q, k, v, extra, compute_dtype) -> out`` in fp64 and in the inputs'
    dtype, by FlashAttention's rule (_fa_rule). The learned entries stay fp64 in
    both references (the kernels keep them in float32). Where both return
    ``(out, lse)`` (a spec with return_lse), the loss weighs lse by a random
    gradient too (zero on rows that see no key, whose lse is -inf)."""
    dtype = inputs[0].dtype
    leaves = [t.detach().requires_grad_() for t in inputs]
    extra = dict(extra)
    for name in learned:
        extra[name] = extra[name].detach().requires_grad_()
        leaves.append(extra[name])
    outs = call(*leaves[:3], extra)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    # out's shape, not q's: v_head_dim may differ from head_dim
    upstream = [torch.randn(outs[0].shape, generator=generator, device=outs[0].device).to(dtype)]
    if len(outs) == 2:
        seen = torch.isfinite(outs[1].detach())
        upstream.append(torch.where(seen, torch.randn(outs[1].shape, generator=generator,
                                                      device=seen.device), 0.0))
    got = torch.autograd.grad(outs, leaves, upstream)

    def reference_grads(compute_dtype):
        refs = [t.detach().to(compute_dtype if i < 3 else torch.float64).requires_grad_()
                for i, t in enumerate(leaves)]
        ref = reference(*refs[:3], dict(extra, **dict(zip(learned, refs[3:]))), compute_dtype)
        ref = list(ref) if isinstance(ref, tuple) else [ref]
        # an output that no input reaches (the lse of a score_mod that reads score only in
        # a condition) has no grad_fn: it adds nothing to the gradients
        pairs = [(r, u.to(r.dtype)) for u, r in zip(upstream, ref) if r.requires_grad]
        if not pairs:
            return [None] * len(refs)
        return torch.autograd.grad([r for r, _ in pairs], refs, [u for _, u in pairs],
                                   allow_unused=True)

    return _fa_rule(torch, got, reference_grads(torch.float64), reference_grads(dtype))


def _fa_rule(torch, got, exact, rough) -> dict:
    """FlashAttention's rule over gradients: each one's largest error against the
    fp64 ``exact`` is at most twice that of ``rough`` (the same math in the input
    dtype) plus 1e-5. grad_ratio: the worst error over its allowance."""
    worst, finite = 0.0, True
    for g, e, r in zip(got, exact, rough):
        e = torch.zeros_like(g, dtype=torch.float64) if e is None else e
        r = torch.zeros_like(g, dtype=torch.float64) if r is None else r
        finite = finite and bool(torch.isfinite(g).all())
        err = (g.double() - e).abs().max().item() if g.numel() else 0.0
        # The input-dtype reference only gauges the rounding allowed: where its math
        # breaks down and the fp64 one does not (log(score + 1) is 0 for a score below
        # fp16's half ulp of 1, and sqrt(abs(.)) then has the slope inf * 0), that
        # element gives no allowance, rather than a NaN one that fails every kernel.
        rough_err = (r.double() - e).abs()
        rough_err = rough_err[torch.isfinite(r) | ~torch.isfinite(e)]
        allowed = 2 * (rough_err.max().item() if rough_err.numel() else 0.0) + 1e-5
        ratio = err / allowed
        if math.isnan(ratio):  # a NaN error: max() would drop it
            worst = ratio
            break
        worst = max(worst, ratio)
    return {"grad_ratio": worst, "grad_ok": finite and worst <= 1.0,
            "grad_finite": finite}


def _p_model(spec: dict, reference):
    """``reference(p_dtype=...)``'s output with P rounded as the spec's kernel rounds
    it (check.p_rounding), or None where that rounding is not coarser than the output."""
    p_dtype = p_rounding(spec)
    return None if p_dtype is None else reference(p_dtype=p_dtype)[0]


def _row(label: str, spec: dict, out, ref, lse, ref_lse, model=None) -> dict:
    """One case's report row. ``model``: the reference with only P rounded like the
    kernel's (check.p_rounding); its error against ``ref`` is reported as p_model_err."""
    result = compare(out, ref, spec["dtype"])
    row = {"shape": label, "max_abs_err": result.max_abs_err, "rel_err": result.rel_err,
           "nonfinite": result.nonfinite, "ok": result.ok}
    if model is not None:
        row["p_model_err"] = compare(model, ref, spec["dtype"]).rel_err
    if lse is not None:
        lse_result = compare_lse(lse, ref_lse)
        row["lse_err"] = lse_result.max_abs_err
        row["lse_mismatch"] = lse_result.nonfinite
        row["ok"] = row["ok"] and lse_result.ok
    return row


def run_decode_case(torch, module, case: Case, generator, device: str = "cuda") -> dict:
    """A decode case: NaN-poisoned cache slots past every length, fp64 reference."""
    spec = module.SPEC
    batch = random_decode(spec, list(case.decode_lens), case.kv_heads, case.seq_q, generator,
                          device=device)
    extra = feature_inputs(spec, batch.dims(), generator, device=device)
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype, device=device)
    module.attention(*batch.args(), out=out, **extra)
    _synchronize(torch, device)
    ref = decode_reference(spec, batch, extra)
    return _row(case.label(spec["gqa_ratio"]), spec, out, ref, None, None)


def run_case(torch, module, case: Case, generator, device: str = "cuda") -> dict:
    """One case on ``device``: "cuda", or "cpu" for a module loaded by
    specgen.check.emulate (its kernels emulated; call inside ``emulating()``)."""
    if case.decode_lens:
        return run_decode_case(torch, module, case, generator, device)
    if case.lengths:
        return run_packed_case(torch, module, case, generator, device)
    spec = module.SPEC
    q, k, v = random_qkv(spec, case.batch, case.kv_heads, case.seq_q, case.seq_k,
                         generator=generator, layout=case.layout, device=device)
    extra = feature_inputs(spec, shape_dims(q, k), generator, device=device)
    out = poisoned_out(spec, q, v)
    _, lse = call_kernel(module, q, k, v, extra, q_offset=case.q_offset, out=out)
    _synchronize(torch, device)
    ref, ref_lse = reference_for(spec, q, k, v, extra, q_offset=case.q_offset)
    model = _p_model(spec, lambda **kw: reference_for(spec, q, k, v, extra,
                                                      q_offset=case.q_offset, **kw))
    row = _row(case.label(spec["gqa_ratio"]), spec, out, ref, lse, ref_lse, model)
    if spec.get("backward"):
        row["out_ok"] = row["ok"]
        row.update(check_gradients(torch, module, q, k, v, extra, case.q_offset, generator))
        row["ok"] = row["ok"] and row["grad_ok"]
    return row


def learnable_tensors(spec: dict) -> list[str]:
    """The hook tensors of ``spec`` that take gradients (learnable: true)."""
    return [n for n, t in (spec.get("tensors") or {}).items() if t.get("learnable")]


def check_gradients(torch, module, q, k, v, extra: dict, q_offset: int, generator) -> dict:
    """The gradients of a ``backward: true`` kernel (q, k, v, sinks and learnable
    hook tensors) for a random upstream gradient, by FlashAttention's rule: each
    one's largest error against fp64 autograd of the reference is at most twice that
    of the same reference computed in the input dtype, plus 1e-5. Returns grad_ratio
    (the worst error over its allowance, <= 1 passes) and grad_ok."""
    spec = module.SPEC

    def call(q, k, v, extra):
        return module.attention(q, k, v, q_offset=q_offset, **extra)  # (out, lse) with return_lse

    def reference(q, k, v, extra, compute_dtype):
        out, lse = reference_for(spec, q, k, v, extra, q_offset=q_offset, compute_dtype=compute_dtype)
        return (out, lse) if spec.get("return_lse") else out

    learned = (["sinks"] if "sinks" in extra else []) + learnable_tensors(spec)
    return _gradient_check(torch, (q, k, v), extra, learned, call, reference, generator)


def format_table(name: str, dtype: str, rows: list[dict]) -> str:
    """The report of one spec: a fixed-width table, one row per case."""
    width = max([len("shape")] + [len(r["shape"]) for r in rows])
    # float8: the relative error of a reference that rounds only P, beside the kernel's.
    model = any("p_model_err" in r for r in rows)
    lines = [
        f"{name} ({dtype}, tolerance rel <= {TOLERANCES[dtype]:.0e})",
        f"  {'shape':<{width}}  {'max abs err':>11}  {'rel err':>9}  "
        + (f"{'P-round err':>11}  " if model else "") + "pass",
    ]
    for r in rows:
        note = f"  ({r['nonfinite']} non-finite)" if r.get("nonfinite") else ""
        if "grad_ratio" in r:
            note += f"  grads {r['grad_ratio']:.2f} of FA's allowance"
        if "error" in r:
            note += f"  raised {r['error']}"
        if "lse_err" in r:
            note += f"  lse err {r['lse_err']:.1e}" + (
                f" ({r['lse_mismatch']} -inf/NaN mismatches)" if r["lse_mismatch"] else "")
        lines.append(
            f"  {r['shape']:<{width}}  {r['max_abs_err']:>11.3e}  {r['rel_err']:>9.3e}  "
            + (f"{r.get('p_model_err', math.nan):>11.3e}  " if model else "")
            + f"{'ok' if r['ok'] else 'FAIL'}{note}"
        )
    return "\n".join(lines)


# Shape fuzzing: the largest fp64 score matrix a case may need (B * Hq * Sq * Skv).
FUZZ_MAX_SCORES = 1 << 27


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high], uniform in log scale (short and long both drawn)."""
    return min(high, max(low, int(round(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))))


# An emulated run's fuzz cases are 8 times smaller (the CPU also computes the
# fp64 reference).
EMULATED_SCALE = 8


def fuzz_case(spec: dict, case_seed: str, scale: int = 1) -> Case:
    """A random valid case for ``spec``, a pure function of ``case_seed`` ("SEED:I"):
    batch, heads, lengths, q_offset and layout (strided views); for decode ragged
    lengths (the page table is shuffled by the case's generator); for varlen a
    ragged packed batch. ``scale``: lengths (and the score budget) divided by it."""
    rng = random.Random(case_seed)
    ratio = spec["gqa_ratio"]
    kv_heads = rng.randint(1, max(1, min(4, 32 // ratio)))
    if spec.get("family") == "decode":
        q_len = rng.randint(1, spec.get("max_q_len", 1))
        lens = tuple(_log_uniform(rng, q_len, max(q_len, 16384 // scale))
                     for _ in range(rng.randint(1, 8)))
        return Case(len(lens), kv_heads, q_len, 0, decode_lens=lens)
    if spec.get("varlen"):
        lengths = []
        for _ in range(rng.randint(1, 6)):
            seq_q = _log_uniform(rng, 1, max(16, 1024 // scale))
            lengths.append((seq_q, seq_q + rng.choice([0, 0, rng.randint(0, 512 // scale)])))
        return Case(len(lengths), kv_heads, 0, 0, lengths=tuple(lengths))
    while True:
        batch = rng.randint(1, 4)
        seq_q = _log_uniform(rng, 1, max(16, 2048 // scale))
        seq_k = seq_q if rng.random() < 0.4 else _log_uniform(rng, 1, max(16, 4096 // scale))
        if batch * kv_heads * ratio * seq_q * seq_k <= FUZZ_MAX_SCORES // scale:
            break
    # Bottom-right (chunked prefill; negative where the queries outnumber the keys),
    # top-left, or anywhere from before the first key to past the keys.
    q_offset = rng.choice([seq_k - seq_q, 0, rng.randint(-seq_q, seq_k + 64)])
    layout = rng.choice(["contiguous", "contiguous", "transposed", "sliced"])
    return Case(batch, kv_heads, seq_q, seq_k, q_offset, layout)


def case_verdict(row: dict) -> str:
    """One case's result in a line: 'ok, rel err 3.1e-03, grads 0.28 of FA's allowance'."""
    text = f"{'ok' if row['ok'] else 'FAIL'}, rel err {row['rel_err']:.1e}"
    if row.get("nonfinite"):
        text += f", {row['nonfinite']} non-finite"
    if "grad_ratio" in row:
        text += f", grads {row['grad_ratio']:.2f} of FA's allowance"
        if not row.get("grad_finite", True):
            text += " (non-finite gradients)"
    if "error" in row:
        text += f", raised {row['error']}"
    return text


def parse_fuzz_case(text: str) -> str:
    """--fuzz-case SEED:I, as a failing fuzz case prints it."""
    seed, sep, index = text.partition(":")
    # ASCII digits only: str.isdigit() takes '²', which int() refuses.
    if not (sep and re.fullmatch(r"-?[0-9]+", seed) and re.fullmatch(r"[0-9]+", index)):
        raise UsageError(f"--fuzz-case: expected SEED:I as a fuzz failure prints it, got {text!r}")
    return f"{int(seed)}:{int(index)}"


def case_generator_seed(seed: int, index: int, fuzz_seed: str | None) -> int:
    """The seed of case ``index``'s own input generator: every case draws its inputs
    from its own generator, so a case gives the same inputs alone, in order, or in a
    worker process (a fuzz case's depends on its SEED:I only, as --fuzz-case replays it)."""
    return random.Random(fuzz_seed if fuzz_seed else f"{seed}:matrix:{index}").getrandbits(63)


def _emulated_module(module_path: str):
    """A generated module with its kernels emulated (specgen.check.emulate), loaded
    once per process."""
    from specgen.check import emulate

    name = f"_specgen_emulated_{Path(module_path).stem}"
    return sys.modules.get(name) or emulate.load_module(module_path, name=name)


def _emulated_case(module_path: str, case: Case, generator_seed: int) -> dict:
    """One case with the module's kernels emulated on the CPU."""
    import torch

    from specgen.check import emulate

    module = _emulated_module(module_path)
    with emulate.emulating():
        return run_case(torch, module, case, torch.Generator().manual_seed(generator_seed), "cpu")


def _worker_case(module_path: str, case: Case, generator_seed: int) -> dict:
    """One case, in this process or a worker: the module imported from its file (once
    per process; fresh_modules' import in this one), a generator of its own."""
    import torch

    from specgen.check.gpu import import_module_file

    module = import_module_file(Path(module_path))
    return run_case(torch, module, case, torch.Generator(device="cuda").manual_seed(generator_seed))


def error_row(exc: BaseException, module_path: str | None = None) -> dict:
    """The row of a case that raised instead of returning an output: it fails, and
    says what was raised and where: the innermost line of the module at
    ``module_path`` (the kernel's load, the launcher's check), else the innermost
    frame (a check's own)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    # By real path: module_path is as the run names it (generated/x.py), a frame's
    # file as the import made it (absolute).
    module = os.path.realpath(module_path) if module_path else None
    own = [f for f in frames if module and os.path.realpath(f.filename) == module]
    frame = (own or frames or [None])[-1]
    where = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame else ""
    text = str(exc).strip()
    first = f": {text.splitlines()[0]}" if text else ""
    return {"max_abs_err": math.inf, "rel_err": math.inf, "nonfinite": 0, "ok": False,
            "error": f"{type(exc).__name__}{first}{where}"}


def _case_or_error(worker, module_path: str, case: Case, generator_seed: int) -> dict:
    """``worker``'s row for one case, or error_row where the case raised (a load
    wholly outside its array, a launcher refusing a valid shape, a CUDA error): the
    run goes on to the other cases, and the failure gets its row and its replay
    line, where a traceback ended the run without naming the case."""
    try:
        return worker(module_path, case, generator_seed)
    except Exception as exc:  # noqa: BLE001 - any exception of a case is its failure
        return error_row(exc, module_path)


def run_cases(cases: list, generator_seeds: list[int], module_path: str, jobs: int, report,
              executor=None, worker=_worker_case) -> list[dict]:
    """Run ``cases`` (case i with generator_seeds[i]), in this process or on ``jobs``
    worker processes sharing the GPU where jobs > 1, and return their rows in case
    order; a case that raises gets error_row. ``report(i, row)`` is called as each
    case finishes (in finishing order). ``executor`` and ``worker`` replace the
    process pool and the case function (tests)."""
    if jobs <= 1:
        rows = []
        for i, (case, gen_seed) in enumerate(zip(cases, generator_seeds)):
            rows.append(_case_or_error(worker, module_path, case, gen_seed))
            report(i, rows[-1])
        return rows
    import concurrent.futures
    import multiprocessing

    pool = executor or concurrent.futures.ProcessPoolExecutor(
        max_workers=min(jobs, len(cases)) or 1, mp_context=multiprocessing.get_context("spawn"),
        initializer=ignore_signals, initargs=(signal.SIGINT,))  # (see ignore_signals)
    rows: list = [None] * len(cases)
    with terminate_as_interrupt(), pool:
        try:
            futures = {pool.submit(_case_or_error, worker, module_path, case, gen_seed): i
                       for i, (case, gen_seed) in enumerate(zip(cases, generator_seeds))}
            for future in concurrent.futures.as_completed(futures):
                i = futures[future]
                try:
                    rows[i] = future.result()
                except Exception as exc:  # noqa: BLE001 - a worker that died (BrokenProcessPool)
                    rows[i] = error_row(exc)
                report(i, rows[i])
        except BaseException:
            # Ctrl-C or SIGTERM: drop the queued cases and stop the running ones. Left
            # to the pool's exit, every queued case ran to its end first, silently.
            pool.shutdown(wait=False, cancel_futures=True)
            for process in multiprocessing.active_children():
                process.terminate()
            raise
    return rows


def run_test(paths: list[str], out_dir: Path, quick: bool, seed: int, fuzz: int = 0,
             fuzz_case_seed: str | None = None, jobs: int = 1, emulate: bool = False) -> int:
    """The shape matrix (or ``fuzz`` random cases per spec, or the one fuzz case
    ``fuzz_case_seed``) for each spec, on ``jobs`` worker processes; exit 1 on any
    failure. ``emulate``: run the kernels on the CPU (specgen.check.emulate), on
    the quick matrix or EMULATED_SCALE times smaller fuzz cases; no GPU needed."""
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if emulate:
        loaded = [(job, _emulated_module(str(job.out_path)).SPEC)
                  for job in fresh_jobs(paths, out_dir, log)]
        worker, scale = _emulated_case, EMULATED_SCALE
        log("kernels emulated on the CPU (specgen.check.emulate): numerics and indexing, "
            "not the GPU's rounding or speed")
    else:
        from specgen.compile.jobs import load_plans, module_refusals

        # Bad specs, and modules this run may not replace, are named before the GPU
        # is asked for: a user learns of them on any machine.
        refusals = module_refusals(load_plans(paths), out_dir,
                                   "replace it with `specgen build --force` first")
        if refusals:
            raise InvalidSpecs("\n".join(refusals))
        require_cuda("test")
        loaded = [(job, module.SPEC) for job, module in fresh_modules(paths, out_dir, log)]
        worker, scale = _worker_case, 1
    # An emulated fuzz case is drawn at other lengths: its replay is emulated too. A
    # replay without the run's --gen would write the module into ./generated (or be
    # refused there, where another spec's module of that name lies).
    replay_flag = (" --emulate" if emulate else "") + (
        "" if out_dir == Path("generated") else f" --gen {shlex.quote(str(out_dir))}")
    failed = 0
    for job, spec in loaded:
        if fuzz_case_seed:
            seeds = [fuzz_case_seed]
        elif fuzz:
            seeds = [f"{seed}:{i}" for i in range(fuzz)]
        else:
            seeds = []
        cases = ([fuzz_case(spec, s, scale) for s in seeds] if seeds
                 else case_matrix(quick or emulate, spec))
        generator_seeds = [case_generator_seed(seed, i, seeds[i] if seeds else None)
                           for i in range(len(cases))]
        name, total = job.plan.module_name, len(cases)
        if jobs > 1:
            log(f"[{name}] {total} cases on {min(jobs, total)} worker processes")

        def report(i, row, name=name, total=total, cases=cases, seeds=seeds):
            # The verdict as it comes, so a run cut short still says what it found.
            log(f"[{name} {i + 1}/{total}] {cases[i].label(spec['gqa_ratio'])}: {case_verdict(row)}"
                + (f"; replay: --fuzz-case={seeds[i]}{replay_flag}" if seeds and not row["ok"] else ""))

        rows = run_cases(cases, generator_seeds, str(job.out_path), jobs, report, worker=worker)
        failures = []
        for i, row in enumerate(rows):
            row.setdefault("shape", cases[i].label(spec["gqa_ratio"]))  # error_row has none
            if seeds:
                row["shape"] = f"[{seeds[i]}] {row['shape']}"
                if not row["ok"]:
                    failures.append(seeds[i])
        print(format_table(job.plan.module_name, spec["dtype"], rows))
        bad = sum(not r["ok"] for r in rows)
        worst = max(r["rel_err"] for r in rows)
        kind = f"fuzz cases ({len(cases)} drawn)" if seeds else "cases"
        models = [r["p_model_err"] for r in rows if "p_model_err" in r]
        floor = f" (P rounding alone: worst {max(models):.3e})" if models else ""
        drawn = f"case {fuzz_case_seed}" if fuzz_case_seed else f"seed {seed}"
        print(f"  {len(rows) - bad}/{len(rows)} {kind} passed, worst rel err {worst:.3e}{floor}, "
              f"{drawn}")
        for case_seed in failures:
            # (--fuzz-case=S:I: a negative seed after a space would read as an option)
            print(f"  replay: specgen test {shlex.quote(str(job.spec_path))} --fuzz-case={case_seed}"
                  f"{replay_flag}")
        print()
        failed += bad
    return 1 if failed else 0
