"""How many CTAs of each backward kernel fit on an SM, as the driver computes it,
and the packed dQ kernel's loads edited to use less shared memory, timed beside the
shipped one.

cuTile's `occupancy=2` hint caps a kernel's registers and shared memory for two
CTAs per SM. An sm_90 SM holds 233,472 bytes of shared memory and the driver
reserves 1,024 bytes per CTA. cuobjdump -res-usage gives the packed dQ kernel of
`fmha_train_document` 115,872 bytes; whether two of them fit depends on whether
that figure already holds the reserved KiB. The driver answers it: it reports
114,848 bytes of static shared memory for the same cubin (cuobjdump's figure
includes the reserve), so a CTA takes 115,872 and two fit (H100, 2026-11-26).

For every module and backward kernel this script exports the sm_90 cubin in the
process (cuda.tile.compilation.export_kernel, the signatures `specgen build` uses),
loads it through the driver (ctypes, libcuda) and prints registers, static shared
memory and cuOccupancyMaxActiveBlocksPerMultiprocessor at the kernel's block size
(its .reqntid). Then it times `_backward` of each module on the backward suite's
inputs (B4 Hq32, the spec's own maps, three rounds of do_bench medians, the modules
alternately) and compares the gradients with the shipped module's.

Variants (edits of the shipped module's dQ kernel text):
    kv_no_tma   the dQ kernel's K and V tiles loaded with allow_tma=False (no TMA
                pipeline: 100,664 bytes by cuobjdump; 1.6-2.0x slower)

    python3 bench/block_sparse/dq_occupancy.py OUT_DIR [SPEC.yaml ...] [--seqs 1024,4096]
        [--keep-cubins]
"""

import argparse
import ctypes
import io
import json
import re
import sys
from pathlib import Path

import torch

sys.path[:0] = [".", str(Path(__file__).parent)]
from specgen.compile.export import backward_signatures, load_module_from_source, rename_op  # noqa: E402
from specgen.emit.render import render  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec.load import load_spec  # noqa: E402
from walk_ab import backward_calls, medians  # noqa: E402

SEQS = (1024, 4096, 16384)
SPECS = ("specs/fmha_train_document.yaml", "bench/train/fmha_train_window_document.yaml")

NO_TMA_ROWS = '''
def _rows_no_tma(X, batch, head, i, ROWS, WIDTH):
    tile = ct.load(
        X,
        index=(batch, head, i, 0),
        shape=(1, 1, ROWS, WIDTH),
        padding_mode=ct.PaddingMode.ZERO,
        allow_tma=False,
    )
    return tile.reshape((ROWS, WIDTH))


'''


def kv_no_tma(text: str, dq_name: str) -> str:
    """The dQ kernel's K and V loads without TMA."""
    helper_at = text.index("def _rows(")
    text = text[:helper_at] + NO_TMA_ROWS.lstrip() + text[helper_at:]
    start = text.index(f"def {dq_name}(")
    end = text.index("\ndef _backward(")
    body = text[start:end]
    for array in ("K", "V"):
        body = body.replace(f"= _rows({array}, ", f"= _rows_no_tma({array}, ")
    assert "_rows_no_tma(K" in body and "_rows_no_tma(V" in body
    return text[:start] + body + text[end:]


VARIANTS = {"kv_no_tma": kv_no_tma}


class Driver:
    """Just enough of libcuda to load a cubin and ask for its occupancy."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def device_attributes(self) -> dict:
        """Shared memory per SM and reserved per block, registers per SM (device 0)."""
        found = {}
        for name, code in (("shared_per_sm", 81), ("reserved_shared_per_block", 111),
                           ("registers_per_sm", 82), ("max_threads_per_sm", 39)):
            value = ctypes.c_int()
            self._check(self.lib.cuDeviceGetAttribute(ctypes.byref(value), code, 0), "cuDeviceGetAttribute")
            found[name] = value.value
        return found

    def _check(self, result, what):
        if result != 0:
            raise RuntimeError(f"{what}: CUresult {result}")

    def occupancy(self, cubin: bytes, symbol: str) -> dict:
        lib = self.lib
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)), "cuModuleLoadData")
        self._check(lib.cuModuleGetFunction(ctypes.byref(function), module, symbol.encode()), "cuModuleGetFunction")
        attrs = {}
        for name, code in (("max_threads", 0), ("static_shared", 1), ("registers", 4)):
            value = ctypes.c_int()
            self._check(lib.cuFuncGetAttribute(ctypes.byref(value), code, function), "cuFuncGetAttribute")
            attrs[name] = value.value
        # The block size the kernel is launched with: its .reqntid (the driver's
        # max-threads attribute is the register file's limit, not the launch size).
        found = re.search(rb"\.reqntid (\d+)", cubin)
        attrs["threads"] = int(found.group(1)) if found else attrs["max_threads"]
        blocks = ctypes.c_int()
        self._check(lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), function, attrs["threads"], ctypes.c_size_t(0)), "cuOccupancy")
        attrs["ctas_per_sm"] = blocks.value
        lib.cuModuleUnload(module)
        return attrs


def kernel_occupancy(driver: Driver, plan, module, sm: str, keep: Path | None = None) -> dict:
    from cuda.tile.compilation import export_kernel, mangle_kernel_name

    found = {}
    for name, sigs in backward_signatures(plan).items():
        buffer = io.BytesIO()
        export_kernel(getattr(module, name), sigs, buffer, gpu_code=sm, output_format="cubin")
        symbol = sigs[0].symbol or mangle_kernel_name(name, sigs[0])
        if keep is not None:  # for cuobjdump -res-usage / -elf elsewhere
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{module.__name__}-{name}.cubin").write_bytes(buffer.getvalue())
        found[name.split("_causal")[0]] = driver.occupancy(buffer.getvalue(), symbol)
    return found


def modules(spec_path: str):
    plan = make_plan(load_spec(spec_path))
    text = render(plan, spec_path).text
    mods = {}
    for label, edit in [("shipped", None), *VARIANTS.items()]:
        source = text if edit is None else edit(text, plan.bwd_names[1])
        source = rename_op(source, label, f"<{label}>")
        mods[label] = load_module_from_source(f"{label}_{plan.module_name}", source, f"<{label}>")
    return plan, mods


def run_spec(spec_path: str, seqs, driver: Driver, keep: Path | None = None) -> dict:
    plan, mods = modules(spec_path)
    sm = "sm_{}{}".format(*torch.cuda.get_device_capability())
    occupancy = {label: kernel_occupancy(driver, plan, mod, sm, keep) for label, mod in mods.items()}
    for label, kernels in occupancy.items():
        for kernel, attrs in kernels.items():
            print(f"[{plan.module_name}] {label:10s} {kernel:14s} threads {attrs['threads']}, "
                  f"{attrs['registers']} registers, {attrs['static_shared']} bytes shared: "
                  f"{attrs['ctas_per_sm']} CTA(s) per SM", flush=True)
    rows = []
    for seq in seqs:
        calls, grads, flops = backward_calls(plan, mods, seq)
        largest = max(g.abs().max().item() for g in grads["shipped"][:3])
        diffs = {label: max((a.float() - b.float()).abs().max().item()
                            for a, b in zip(grads["shipped"][:3], g[:3]))
                 for label, g in grads.items() if label != "shipped"}
        ms, times = medians(calls)
        speed = {label: ms["shipped"] / t for label, t in ms.items() if label != "shipped"}
        rows.append(dict(seq=seq, flops=flops, ms=ms, ms_rounds=times, speed_over_shipped=speed,
                         grad_diff=diffs, grad_largest=largest,
                         tflops={label: flops / (t * 1e9) for label, t in ms.items()}))
        print(f"[{plan.module_name}] S={seq}: " + ", ".join(
            f"{label} {t:.3f} ms" + (f" ({speed[label]:.3f}x, grads differ by {diffs[label]:.3g})"
                                     if label in speed else "") for label, t in ms.items())
              + f" (largest gradient {largest:.3g})", flush=True)
    return dict(spec=plan.module_name, occupancy=occupancy, rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("specs", nargs="*", default=list(SPECS))
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)),
                        help="lengths to time; empty: occupancy only")
    parser.add_argument("--keep-cubins", action="store_true", help="write the cubins to OUT_DIR/cubins")
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",") if s]
    driver = Driver()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    print("device:", driver.device_attributes(), flush=True)
    results = [run_spec(spec, seqs, driver, args.out_dir / "cubins" if args.keep_cubins else None) for spec in args.specs]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "dq_occupancy.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
