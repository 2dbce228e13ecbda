"""The int64-indexed twin of a prefill kernel against the kernel itself, in SASS.

Compiles fmha_gqa8_bf16's long-sequence sm_90 config both ways (offline, no GPU)
and prints the instruction counts that differ, the memory instructions first.
Needs cuobjdump (pip: nvidia-cuda-cuobjdump).

    python bench/twin_sass.py
"""

import collections
import io
import re
import subprocess
import tempfile

import yaml
from cuda.tile.compilation import export_kernel

from specgen.compile import sass
from specgen.compile.export import int64_signatures, load_module_from_source, signatures, target_configs
from tests.helpers import ROOT, render_spec_data

# An instruction's opcode in cuobjdump's listing (after its address and any predicate).
OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")
MEMORY = ("UTMA", "LDG", "STG", "HGMMA", "SYNCS", "WARPGROUP")


def opcodes(kernel, sigs):
    """The opcodes (without modifiers) of ``kernel`` compiled for ``sigs`` on sm_90,
    and the cubin's size."""
    buffer = io.BytesIO()
    export_kernel(kernel, sigs, buffer, gpu_code="sm_90", output_format="cubin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(buffer.getvalue())
        f.flush()
        text = subprocess.run([sass.cuobjdump_path(), "-sass", f.name], capture_output=True, text=True).stdout
    ops = [m.group(1).split(".")[0] for m in OPCODE.finditer(text)]
    return collections.Counter(ops), len(buffer.getvalue())


def main():
    spec = "specs/fmha_gqa8_bf16.yaml"
    plan, source = render_spec_data(yaml.safe_load((ROOT / spec).read_text()), spec)
    mod = load_module_from_source(plan.module_name, source, f"{ROOT}/generated/_sass_{plan.module_name}.py")
    config = target_configs(plan, "sm_90")[-1]  # the long-sequence config
    print("config", config.tile_m, config.tile_n, config.extra_hints)
    kernel = getattr(mod, plan.kernel_name)
    if config.extra_hints:
        kernel = kernel.replace_hints(**config.extra_hints)
    sigs = signatures(plan, "sm_90", config)[:1]  # EVEN_N True
    counts = {}
    for name, k, ss in (("int32", kernel, sigs), ("int64", kernel.indexed_with_int64(), int64_signatures(sigs))):
        counts[name], size = opcodes(k, ss)
        print(name, "cubin bytes", size, "instructions", sum(counts[name].values()))
    a, b = counts["int32"], counts["int64"]
    keys = sorted(set(a) | set(b), key=lambda k: a[k] - b[k])
    memory = [k for k in keys if k.startswith(MEMORY)]
    for k in memory + [k for k in keys[:12] if k not in memory]:
        print(f"{k:12s} {a[k]:6d} {b[k]:6d} {b[k] - a[k]:+6d}")


if __name__ == "__main__":
    main()
