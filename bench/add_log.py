"""Add logs to bench/results/logs.tar.xz, the archive of the project's test, fuzz and
tuning logs (one solid archive compresses them to about half of gzip each).

    python bench/add_log.py FILE NAME [FILE NAME ...]

stores FILE as NAME, a path below bench/results/ such as
h100_80gb_hbm3/gpu-tests-2026-11-26.log, replacing a member of that name. The
archive is rewritten deterministically (sorted members, fixed owner and time), so
the same logs give the same bytes.
"""

import io
import lzma
import sys
import tarfile
from pathlib import Path

ARCHIVE = Path(__file__).resolve().parent / "results" / "logs.tar.xz"


def add_logs(pairs: list[tuple[Path, str]], archive: Path = ARCHIVE) -> None:
    members: dict[str, bytes] = {}
    if archive.exists():
        with tarfile.open(archive, "r:xz") as tar:
            for info in tar.getmembers():
                if info.isfile():
                    members[info.name.removeprefix("./")] = tar.extractfile(info).read()
    for source, name in pairs:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise SystemExit(f"add_log: {name}: give a path below bench/results/")
        members[name] = source.read_bytes()
    buffer = io.BytesIO()
    # xz's extreme preset: about 3% smaller than 9 alone on these logs, in about a second.
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(members[name]), 1764115200, 0o644
            tar.addfile(info, io.BytesIO(members[name]))
    archive.write_bytes(buffer.getvalue())


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or len(args) % 2:
        raise SystemExit(__doc__)
    add_logs([(Path(args[i]), args[i + 1]) for i in range(0, len(args), 2)])
