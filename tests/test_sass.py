"""specgen.compile.sass: the loop schedules read from SASS text (no tools needed)."""

import pytest

from specgen.compile import sass

# A cut-down sm_90 listing: a prologue MMA chain, then a loop that issues the next
# S chain among the exponentials, waits, and accumulates P V.
LISTING = [
    (0x000, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT"),
    (0x010, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0"),
    (0x020, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
    (0x030, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT"),
    (0x040, "MUFU.EX2 R10, R10"),
    (0x050, "MUFU.EX2 R11, R11"),
    (0x060, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0"),
    (0x070, "MUFU.EX2 R12, R12"),
    (0x080, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
    (0x090, "HGMMA.64x128x16.F32.BF16 R88, R40, gdesc[UR12].tnspB, R88, gsb0"),
    (0x0a0, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
    (0x0b0, "@P0 BRA 0x30"),
    (0x0c0, "EXIT"),
    # a barrier's slow path, returning into the loop unconditionally: not a loop
    (0x0d0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3"),
    (0x0e0, "BRA 0x40"),
]


def test_innermost_loop_schedule_in_program_order():
    assert sass.loop_schedules(LISTING) == ["Q1 E2 Q1 E1 W P1 W"]


def test_only_innermost_loops_with_mmas_count():
    outer = LISTING[:-3] + [(0x0c0, "@P1 BRA 0x0"), (0x0d0, "@P2 BRA 0xd0"), (0x0e0, "EXIT")]
    assert sass.loop_schedules(outer) == ["Q1 E2 Q1 E1 W P1 W"]  # not the outer, not the spin
    assert sass.loop_schedules([(0x0, "MUFU.EX2 R1, R1"), (0x10, "BRA 0x0")]) == []
    # A wait-and-retry loop inside the key loop leaves the key loop the innermost one
    # with MMAs.
    spin = LISTING[:4] + [(0x034, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3"),
                          (0x038, "@!P0 BRA 0x34")] + LISTING[4:]
    assert sass.loop_schedules(spin) == ["Q1 E2 Q1 E1 W P1 W"]


def test_a_predicated_float8_mma_is_read():
    started: set = set()
    assert sass._event("@P1 QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ, !UPT", started) == "Q"
    assert sass._event("QGMMA.64x128x32.F32.E4M3.E4M3 R90, R12, gdesc[UR4], R90", started) == "P"
    assert sass._event("FADD R1, R2, R3", started) is None


def test_loop_mix_counts_one_step_of_each_inner_loop():
    body = LISTING[:4] + [
        (0x032, "IMAD R2, R3, 0x85ebca6b, RZ"),
        (0x034, "@P1 LOP3.LUT R2, R2, 0xffff, RZ, 0xc0, !PT"),
        (0x036, "FFMA R4, R4, R5, -R6"),
        (0x038, "STL [R1+0x10], R4"),
        (0x03c, "LDL R7, [R1+0x10]"),
    ] + LISTING[4:]
    (mix,) = sass.loop_mix(body)
    # The loop runs from 0x30 to its branch back at 0xb0: 14 instructions.
    assert mix == {"instructions": 14, "integer": 2, "float": 1, "exp": 3, "mma": 3, "spill": 2}
    assert sass.describe_mix(mix) == "14 instructions: 2 integer, 1 float, 3 exp, 3 MMA, 2 spill"
    assert sass.loop_mix(LISTING[:3]) == []  # no loop, no mix
    assert len(sass.loop_mix(body)) == len(sass.loop_schedules(body))


def test_cli_refuses_a_missing_cubin(tmp_path, capsys):
    assert sass.main([str(tmp_path / "none.cubin")]) == 2
    assert "none.cubin: no such cubin" in capsys.readouterr().err


def test_cli_without_arguments_prints_its_usage_and_exits_2(capsys):
    """It printed nothing and exited 0, as if it had read every cubin."""
    assert sass.main([]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "specgen.compile.sass: usage: python -m specgen.compile.sass CUBIN_OR_FOLDER... "
        "(e.g. generated/<name>.aot)"]


def test_cli_refuses_a_file_that_is_no_cubin_in_one_line(tmp_path, capsys, monkeypatch):
    """cuobjdump's failure on a file that is no cubin was a CalledProcessError traceback."""
    import subprocess

    def refuse(cubin):
        raise subprocess.CalledProcessError(255, ["cuobjdump", "-sass", str(cubin)])

    monkeypatch.setattr(sass, "cubin_loops", refuse)
    (tmp_path / "notes.txt").write_text("not a cubin")
    assert sass.main([str(tmp_path / "notes.txt")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"specgen.compile.sass: {tmp_path / 'notes.txt'}: not a cubin cuobjdump can read"]


def test_cli_reads_the_cubins_of_a_folder(tmp_path, capsys, monkeypatch):
    """A module's .aot folder stands for its cubins, in name order; an empty one is refused."""
    read = []
    monkeypatch.setattr(sass, "cubin_loops", lambda cubin: read.append(cubin.name) or {})
    for name in ("sm_90-b.cubin", "sm_100-a.cubin", "manifest.json"):
        (tmp_path / name).write_bytes(b"")
    assert sass.main([str(tmp_path)]) == 0
    assert read == ["sm_100-a.cubin", "sm_90-b.cubin"]
    (tmp_path / "empty").mkdir()
    assert sass.main([str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"specgen.compile.sass: {tmp_path / 'empty'}: a folder with no *.cubin in it"]


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_cli_help_prints_its_usage_and_exits_0(flag, capsys):
    """--help was read as a cubin's path: "--help: no such cubin", exit 2."""
    assert sass.main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m specgen.compile.sass CUBIN_OR_FOLDER...") and "sm_90" in out


def test_an_accumulator_in_registers_a_finished_chain_used_is_a_continuation():
    """The dQ kernel's dq += dS K accumulates into the registers its prologue's S
    chain used (R24 here): those registers stayed marked as a chain begun from zero,
    so the accumulation read as Q (a new chain), "W Q8 W E32 Q4 W"; a chain ends
    with its committed group (gsb0)."""
    listing = [
        (0x000, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT"),  # the prologue's S
        (0x010, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0"),
        (0x020, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
        (0x030, "HGMMA.64x64x16.F32.BF16 R88, gdesc[UR4], RZ, !UPT"),  # the loop's S
        (0x040, "HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], R88, gsb0"),
        (0x050, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
        (0x060, "MUFU.EX2 R10, R10"),
        (0x070, "HGMMA.64x128x16.F32.BF16 R24, R184, gdesc[UR16].tnspB, R24, UP0"),  # dq +=
        (0x080, "HGMMA.64x128x16.F32.BF16 R24, R188, gdesc[UR12].tnspB, R24, gsb0"),
        (0x090, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
        (0x0a0, "@P0 BRA 0x30"),
        (0x0b0, "EXIT"),
    ]
    assert sass.loop_schedules(listing) == ["Q2 W E1 P2 W"]
