"""Compile: the schedule of a kernel's inner loops, read from its sm_90 SASS.

Each innermost loop with warpgroup MMAs becomes a string of events in program
order, so what a flag does to the schedule can be read without a GPU:

    Q  a warpgroup MMA (HGMMA, float8 QGMMA) of a chain that starts from zero
       (S = Q K^T, dS, ...)
    P  a warpgroup MMA that continues an accumulator (acc += P V)
    E  an exponential on the MUFU unit (MUFU.EX2)
    W  a wait for the warpgroup MMAs in flight (WARPGROUP.DEPBAR)

``Q8 W E66 P8 W`` waits for S before its first exponential: nothing hides the
softmax. ``Q2 E2 Q1 E13 ... W P8 W`` issues the MMAs between the exponentials and
waits after them: the tensor cores run while the softmax does. A count follows
each letter (consecutive events of one kind).

Each loop's instruction mix (``loop_mix``) says what else a step issues: its
instructions, how many are integer (address, mask and hash arithmetic), floating
point, exponentials and MMAs, and the stack traffic of spilled registers. A
dropout hash per element, for example, showed as two thirds of a step's
instructions being integer.

    python -m specgen.compile.sass CUBIN...

Needs cuobjdump and nvdisasm (pip: nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+0x([0-9a-f]+)")


def cuobjdump_path() -> Optional[str]:
    """cuobjdump from PATH, or from the nvidia-cuda-cuobjdump pip package."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia

        for root in nvidia.__path__:
            for candidate in Path(root).glob("cu*/bin/cuobjdump"):
                return str(candidate)
    except ImportError:
        pass
    return None


def _disassembler_env(tool: str) -> Optional[dict]:
    """cuobjdump -sass runs nvdisasm: from PATH, or beside cuobjdump (pip). None
    where there is none."""
    beside = Path(tool).parent / "nvdisasm"
    if shutil.which("nvdisasm"):
        return dict(os.environ)
    if beside.is_file():
        return {**os.environ, "PATH": f"{beside.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return None


def sass_functions(cubin: Path) -> Optional[dict[str, list[tuple[int, str]]]]:
    """Each function's SASS as (address, instruction); None without the tools."""
    tool = cuobjdump_path()
    env = _disassembler_env(tool) if tool else None
    if env is None:
        return None
    text = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True,
                          check=True, env=env).stdout
    result: dict[str, list[tuple[int, str]]] = {}
    name = None
    for line in text.splitlines():
        if line.strip().startswith("Function : "):
            name = line.split("Function : ", 1)[1].strip()
            result[name] = []
        elif name is not None and (match := _INSTR.search(line)):
            result[name].append((int(match.group(1), 16), match.group(2)))
    return result


def _event(instr: str, started: set) -> Optional[str]:
    """One instruction's event letter; ``started`` collects the destination
    registers of MMA chains begun from zero."""
    if instr.startswith("@"):  # predicated: drop the predicate
        instr = instr.split(None, 1)[1]
    op, _, operands = instr.partition(" ")
    if op.startswith(("HGMMA", "QGMMA")):
        fields = [f.strip() for f in operands.split(",")]
        if "RZ" in fields:  # accumulator operand zero: a new chain
            started.add(fields[0])
        event = "Q" if fields[0] in started else "P"
        if "gsb0" in fields:
            # The chain's last MMA (its group is committed): a later MMA into these
            # registers that reads them continues an accumulator (the dQ kernel's
            # dq += dS K into the registers its prologue's S chain used), not this chain.
            started.discard(fields[0])
        return event
    if op.startswith("MUFU.EX2"):
        return "E"
    if op.startswith("WARPGROUP.DEPBAR"):
        return "W"
    return None


def _compress(events: list[str]) -> str:
    runs: list[list] = []
    for e in events:
        if runs and runs[-1][0] == e:
            runs[-1][1] += 1
        else:
            runs.append([e, 1])
    return " ".join(f"{e}{n}" if n > 1 or e != "W" else e for e, n in runs)


def _inner_loops(body: list[tuple[int, str]], events_at: dict) -> list[tuple[int, int]]:
    """The (first, last) addresses of the innermost loops that hold a warpgroup MMA
    (no other such loop inside their span; wait-and-retry loops without MMAs do not
    count), in address order."""
    loops = []
    for addr, instr in body:
        match = _BRANCH.search(instr)
        # A loop closes with a predicated branch back; an unconditional one back is
        # a slow path (a barrier's retry) returning into the loop.
        if match and instr.startswith("@") and int(match.group(1), 16) < addr:
            span = (int(match.group(1), 16), addr)
            if any(events_at[a] in ("Q", "P") for a, _ in body if span[0] <= a <= span[1]):
                loops.append(span)
    return sorted(s for s in loops if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in loops))


def _events(body: list[tuple[int, str]]) -> dict:
    started: set = set()
    # In order, so that a chain begun before a loop is known in it.
    return {addr: _event(instr, started) for addr, instr in body}


def _schedule(body: list[tuple[int, str]], events_at: dict, span: tuple[int, int]) -> str:
    first, last = span
    return _compress([events_at[a] for a, _ in body if first <= a <= last and events_at[a]])


def loop_schedules(body: list[tuple[int, str]]) -> list[str]:
    """The event strings of the innermost loops with a warpgroup MMA, in address order."""
    events_at = _events(body)
    return [_schedule(body, events_at, span) for span in _inner_loops(body, events_at)]


# Opcode classes of a loop's mix (the opcode before its first '.').
_INTEGER = {"IMAD", "IADD3", "LOP3", "SHF", "ISETP", "SEL", "LEA", "PRMT", "IABS", "IMNMX",
            "VIADD", "VIMNMX", "I2F", "F2I", "FLO", "POPC", "BMSK", "SGXT"}
_FLOAT = {"FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "F2FP", "FCHK", "HADD2", "HMUL2",
          "HFMA2"}


def _mix(body: list[tuple[int, str]], span: tuple[int, int]) -> dict:
    first, last = span
    mix = {"instructions": 0, "integer": 0, "float": 0, "exp": 0, "mma": 0, "spill": 0}
    for addr, instr in body:
        if not first <= addr <= last:
            continue
        op = (instr.split(None, 1)[1] if instr.startswith("@") else instr).split()[0]
        base = op.split(".")[0]
        mix["instructions"] += 1
        if base in _INTEGER:
            mix["integer"] += 1
        elif base in _FLOAT:
            mix["float"] += 1
        elif op.startswith("MUFU.EX2"):
            mix["exp"] += 1
        elif base in ("HGMMA", "QGMMA"):
            mix["mma"] += 1
        elif base in ("STL", "LDL"):
            mix["spill"] += 1
    return mix


def loop_mix(body: list[tuple[int, str]]) -> list[dict]:
    """Per innermost loop with a warpgroup MMA (as loop_schedules): the instructions of
    one step and how many are integer, floating point, exponentials (MUFU.EX2), MMAs
    and stack traffic (STL/LDL: spilled registers)."""
    return [_mix(body, span) for span in _inner_loops(body, _events(body))]


def describe_mix(mix: dict) -> str:
    """'714 instructions: 450 integer, 150 float, 34 exp, 8 MMA, 0 spill'."""
    return (f"{mix['instructions']} instructions: {mix['integer']} integer, {mix['float']} float, "
            f"{mix['exp']} exp, {mix['mma']} MMA, {mix['spill']} spill")


def _loops(body: list[tuple[int, str]]) -> list[dict]:
    """Each inner loop's schedule and mix, its events and spans found once."""
    events_at = _events(body)
    return [{"schedule": _schedule(body, events_at, span), **_mix(body, span)}
            for span in _inner_loops(body, events_at)]


def cubin_loops(cubin: Path) -> Optional[dict[str, list[dict]]]:
    """Per function symbol of a cubin, each inner loop's schedule and mix (the
    loop_mix dict with its "schedule"); None without the tools."""
    functions = sass_functions(cubin)
    if functions is None:
        return None
    return {name: _loops(body) for name, body in functions.items()}


USAGE = "usage: python -m specgen.compile.sass CUBIN_OR_FOLDER... (e.g. generated/<name>.aot)"


def _cubins(argv: list[str]) -> list[Path] | str:
    """The cubins named, a folder (a module's ``<name>.aot/``) standing for the cubins
    in it; or the one line that says why not."""
    if not argv:
        return USAGE
    cubins = []
    for arg in argv:
        path = Path(arg)
        if path.is_dir():
            found = sorted(path.glob("*.cubin"))
            if not found:
                return f"{arg}: a folder with no *.cubin in it"
            cubins += found
        elif path.is_file():
            cubins.append(path)
        else:
            return f"{arg}: no such cubin"
    return cubins


def main(argv: list[str]) -> int:
    """Print each inner loop's schedule and mix; exit 0, or 2 for bad input (in one
    line, as specgen's commands do: no arguments, a path that is no cubin)."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        print("Print each sm_90 cubin's inner loops as a schedule (Q, P: warpgroup MMAs; "
              "E: exponentials; W: waits) with its instruction mix; other targets' cubins "
              "print nothing.")
        return 0
    cubins = _cubins(argv)
    if isinstance(cubins, str):
        print(f"specgen.compile.sass: {cubins}", file=sys.stderr)
        return 2
    for path in cubins:
        try:
            found = cubin_loops(path)
        except subprocess.CalledProcessError:
            print(f"specgen.compile.sass: {path}: not a cubin cuobjdump can read", file=sys.stderr)
            return 2
        if found is None:
            print("cuobjdump/nvdisasm not found: pip install nvidia-cuda-cuobjdump "
                  "nvidia-cuda-nvdisasm", file=sys.stderr)
            return 2
        for name, loops in found.items():
            for i, loop in enumerate(loops):
                print(f"{path.name} {name} loop {i}: {loop['schedule']}  [{describe_mix(loop)}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
