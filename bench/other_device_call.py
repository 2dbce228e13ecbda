"""One case of a generated module with its tensors on cuda:1 while cuda:0 is the
current device (a pipeline-parallel layer), against the fp64 reference; mode
"guard" makes cuda:1 current around the call. Needs two GPUs.

Usage: python bench/other_device_call.py MODULE_NAME plain|guard  (run with
CUDA_LAUNCH_BLOCKING=1 to name the failing launch)
"""

import sys, traceback, importlib, torch
from specgen.check.runner import case_matrix, run_case

name, mode = sys.argv[1], sys.argv[2]
mod = importlib.import_module(f"generated.{name}")
case = case_matrix(False, mod.SPEC)[0]
torch.cuda.set_device(0)
torch.zeros(1, device="cuda:0")
try:
    gen = torch.Generator(device="cuda:1").manual_seed(0)
    if mode == "guard":
        with torch.cuda.device(1):
            row = run_case(torch, mod, case, gen, device="cuda:1")
    else:
        row = run_case(torch, mod, case, gen, device="cuda:1")
    torch.cuda.synchronize(1)
    print(name, mode, "OK" if row["ok"] else "WRONG", row.get("max_abs_err"), case)
except Exception as e:
    tb = traceback.extract_tb(e.__traceback__)
    print(
        name,
        mode,
        "ERROR",
        type(e).__name__,
        str(e).splitlines()[0],
        [f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in tb[-4:]],
    )
