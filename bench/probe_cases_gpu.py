"""The hook, window and nested-subscript cases that CPU probes found (emulated in
tests/test_emulate.py), run on a GPU against the fp64 reference: forward, and
gradients where the spec trains. Prints one verdict line per case; exit 1 on a
failure.

    python bench/probe_cases_gpu.py [--emulate]   (--emulate: on the CPU, emulated)
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specgen.check.runner import Case, case_verdict, run_case  # noqa: E402
from specgen.emit.render import render  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec import validate_spec  # noqa: E402

SMALL = {"dtype": "bfloat16", "head_dim": 16, "gqa_ratio": 2, "backward": True,
         "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
TABLE = {"dtype": "float32", "shape": ["heads", 4], "learnable": True}
IDS = {"dtype": "int32", "shape": ["batch", "seq_k"]}
HOOK_CASES = (Case(1, 1, 40, 50, 10), Case(2, 1, 30, 20, -13), Case(2, 2, 300, 517, 217))
SPECS = {
    "hook_sqrt_branch": ({**SMALL, "score_mod": "where(score > 0, sqrt(score), 0.0)"}, HOOK_CASES),
    "hook_wrapping_score": ({**SMALL, "score_mod": "score + ((q_idx * 1103515245 + kv_idx * 12345) % 13) * 0.1"},
                            HOOK_CASES),
    "hook_wrapping_mask": ({**SMALL, "mask_mod": "(q_idx * 1103515245 + kv_idx) % 3 != 0"}, HOOK_CASES),
    "hook_fixed_pattern": ({**SMALL, "score_mod": "score * 0.0 + q_idx * 0.01"}, HOOK_CASES),
    "nested_learnable": ({**SMALL, "score_mod": "score + tab[h, ids[b, kv_idx] % 4]",
                          "tensors": {"tab": TABLE, "ids": IDS}}, HOOK_CASES),
    "nested_mask_map": ({**SMALL, "mask_mod": "ids[b, ids[b, q_idx] % 40] <= kv_idx + 3",
                         "tensors": {"ids": IDS}, "block_sparse": True}, HOOK_CASES),
}
SPECS["decode_window_mtp"] = (
    {"family": "decode", "dtype": "bfloat16", "head_dim": 128, "gqa_ratio": 4, "max_q_len": 4,
     "window": {"left": 100}, "sinks": True, "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
    (Case(7, 1, 4, 0, decode_lens=(167, 231, 165, 166, 168, 104, 40)),
     Case(3, 2, 3, 0, decode_lens=(4196, 1166, 297)), Case(2, 1, 1, 0, decode_lens=(167, 5000))))
EXTREMES = tuple(Case(1, 2, 24, 40, off) for off in (-2**30, -2**29 - 2, -3, 2**29 - 20, 2**30 - 24))
for label, window, causal in (("right", {"right": 2**29}, False), ("both", {"left": 2**29, "right": 2**29}, False),
                              ("causal_left", {"left": 2**29}, True)):
    SPECS[f"wide_{label}"] = ({"dtype": "bfloat16", "head_dim": 64, "causal": causal, "window": window,
                               "backward": True}, EXTREMES)


def main(emulated: bool) -> int:
    from specgen.check import emulate

    failed = 0
    folder = Path(tempfile.mkdtemp())
    device = "cpu" if emulated else "cuda"
    for name, (data, cases) in SPECS.items():
        plan = make_plan(validate_spec({"name": name, **data}))
        path = folder / f"{name}.py"
        path.write_text(render(plan, f"specs/{name}.yaml").text)
        if emulated:
            module = emulate.load_module(path, name=f"_probe_{name}")
        else:
            spec = importlib.util.spec_from_file_location(f"_probe_{name}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        for case in cases:
            if emulated and case.seq_q * case.seq_k > 5000:
                continue  # the emulator's time
            try:
                with emulate.emulating() if emulated else contextlib.nullcontext():
                    row = run_case(torch, module, case, torch.Generator(device=device).manual_seed(3),
                                   device=device)
            except Exception as exc:  # noqa: BLE001 - reported, and the next spec runs
                failed += 1
                print(f"{name}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}", flush=True)
                break
            failed += not row["ok"]
            print(f"{name} {case.label(module.SPEC['gqa_ratio'])}: {case_verdict(row)}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main("--emulate" in sys.argv[1:]))
