"""The int64-indexed twin of a prefill kernel against the kernel itself, in SASS.

Compiles fmha_gqa8_bf16's long-sequence sm_90 config both ways (offline, no GPU)
and prints the instruction counts that differ, the memory instructions first.
Needs cuobjdump (pip: nvidia-cuda-cuobjdump).
"""

import dataclasses, io, subprocess, sys, tempfile, collections, re
import cuda.tile as ct
from cuda.tile.compilation import ArrayConstraint, KernelSignature, export_kernel
from specgen.compile.export import kernel_builds, signatures, target_configs
from specgen.compile import sass
import importlib, yaml
from tests.helpers import render_spec_data, ROOT
from specgen.compile.export import load_module_from_source

plan, src = render_spec_data(
    yaml.safe_load((ROOT / "specs" / "fmha_gqa8_bf16.yaml").read_text()),
    "specs/fmha_gqa8_bf16.yaml",
)
mod = load_module_from_source(
    plan.module_name, src, f"{ROOT}/generated/_sass_{plan.module_name}.py"
)
configs = target_configs(plan, "sm_90")
config = configs[-1]  # the long-sequence config (128x128)
print("config", config.tile_m, config.tile_n, config.extra_hints)
kernel = getattr(mod, plan.kernel_name)
if config.extra_hints:
    kernel = kernel.replace_hints(**config.extra_hints)
sigs = [s for s in signatures(plan, "sm_90", config)][:1]  # EVEN_N True
wide = lambda p: (
    dataclasses.replace(p, index_dtype=ct.int64)
    if isinstance(p, ArrayConstraint)
    else p
)
out = {}
for name, k, ss in (
    ("int32", kernel, sigs),
    (
        "int64",
        kernel.indexed_with_int64(),
        [
            KernelSignature([wide(p) for p in s.parameters], s.calling_convention)
            for s in sigs
        ],
    ),
):
    buf = io.BytesIO()
    export_kernel(k, ss, buf, gpu_code="sm_90", output_format="cubin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(buf.getvalue())
        path = f.name
    text = subprocess.run(
        [sass.cuobjdump_path(), "-sass", path], capture_output=True, text=True
    ).stdout
    ops = [
        m.group(1)
        for m in re.finditer(
            r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text
        )
    ]
    out[name] = collections.Counter(o.split(".")[0] for o in ops)
    print(name, "cubin bytes", len(buf.getvalue()), "instructions", len(ops))
keys = sorted(
    set(out["int32"]) | set(out["int64"]),
    key=lambda k: -(out["int64"][k] - out["int32"][k]),
)
memory = [
    k
    for k in keys
    if k.startswith(("UTMA", "LDG", "STG", "HGMMA", "SYNCS", "WARPGROUP"))
]
for k in memory + [k for k in keys[:12] if k not in memory]:
    print(
        f"{k:12s} {out['int32'][k]:6d} {out['int64'][k]:6d} {out['int64'][k]-out['int32'][k]:+6d}"
    )
