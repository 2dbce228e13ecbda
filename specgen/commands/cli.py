"""The `specgen` command line. Exit codes: 0 ok, 1 failure or drift, 2 bad input."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import select
import sys
import warnings
from pathlib import Path

from specgen import __version__
from specgen.errors import SpecgenError, UsageError


class _StoreOnce(argparse._StoreAction):
    """An option's value, given once: a second value (``--gen a --out b``, two names
    of one option) would silently replace the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given_options", {})
        if self.dest in given:
            first, value = given[self.dest]
            parser.error(f"{option_string} {values}: {first} {value} was given already; give the option once")
        given[self.dest] = (option_string, values)
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (``specgen build: error: ...``), exit 2,
    as every other bad input; ``--help`` still shows the usage. An option that takes
    a value takes it once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        # argparse reports missing positionals before unknown options, so
        # `specgen build --bogus` would blame the missing PATH; the option the user
        # mistyped is the better first line.
        if message.startswith("the following arguments are required"):
            unknown = self.unknown_options(getattr(self, "_given", []))
            if unknown:
                message = f"unrecognized arguments: {' '.join(unknown)}"
        # `--fuzz-case -1:2`: argparse reads a value that starts with '-' as an option.
        missing = re.fullmatch(r"argument (?:\S+/)?(--[\w-]+)(?:/\S+)?: expected one argument", message)
        given = getattr(self, "_given", [])
        if missing:
            option = missing.group(1)
            after = [given[i + 1] for i, t in enumerate(given[:-1]) if t == option]
            name = after[-1].split("=", 1)[0] if after else ""
            known = name in self._option_string_actions or (name.startswith("--") and any(
                k.startswith(name) for k in self._option_string_actions))
            if after and after[-1].startswith("-") and not known:
                message += f" (a value that starts with '-' goes as {option}={after[-1]})"
        if message == "the following arguments are required: COMMAND":
            commands = ", ".join(self._subparsers._group_actions[0].choices)
            message = f"a command is required: one of {commands} (specgen --help says more)"
        self.exit(2, f"{self.prog}: error: {message}\n")

    def unknown_options(self, tokens: list[str]) -> list[str]:
        """The tokens that look like options this parser does not take (a unique
        prefix of a long option counts as that option, as argparse reads it)."""
        known = list(self._option_string_actions)
        unknown = []
        for token in tokens:
            if token == "--":
                break
            if not token.startswith("-") or token == "-" or token[1:2].isdigit():
                continue
            name = token.split("=", 1)[0]
            if name in known:
                continue
            if name.startswith("--") and sum(k.startswith(name) for k in known) == 1:
                continue
            unknown.append(token)
        return unknown


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specgen",
        description="Render attention specs (YAML) into cuTile kernel modules and "
        "AOT-compile them per GPU target.",
    )
    parser.add_argument("--version", action="version", version=f"specgen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    build = sub.add_parser(
        "build",
        help="validate specs, render generated/<name>.py, AOT-compile cubins",
        description="Validate specs, render their modules (writing only on change) "
        "and AOT-compile each for its compile_for targets. Exit 0 ok, 1 compile "
        "failure or drift (--check), 2 bad input.",
    )
    build.add_argument("paths", nargs="+", metavar="PATH", help="spec file or folder of specs")
    build.add_argument("--gen", "--out", dest="gen", default="generated", metavar="DIR",
                       help="folder of generated modules (default: generated); --out is the "
                       "same option")
    build.add_argument("--targets", metavar="LIST",
                       help="comma-separated targets overriding each spec's compile_for, "
                       "e.g. sm_90,sm_100")
    build.add_argument("--no-compile", action="store_true", help="render only")
    build.add_argument("--check", action="store_true",
                       help="write nothing; exit 1 if a generated module is missing, "
                       "stale or edited by hand")
    build.add_argument("--force", action="store_true",
                       help="overwrite generated modules even if edited by hand")
    build.add_argument("--jobs", "-j", type=int, metavar="N",
                       help="parallel compiles (default: CPU count, at most 8)")

    test = sub.add_parser(
        "test",
        help="check specs' kernels against the fp64 reference on a CUDA GPU (or --emulate)",
        description="Build stale modules, then run each kernel on a shape matrix "
        "against the fp64 reference with poisoned outputs. Exit 0 all pass, 1 any "
        "failure, 2 bad input or no CUDA GPU.",
    )
    test.add_argument("paths", nargs="+", metavar="SPEC", help="spec file or folder of specs")
    test.add_argument("--quick", action="store_true", help="a smaller shape matrix")
    test.add_argument("--seed", type=int, default=None, help="random seed (default 0)")
    test.add_argument("--fuzz", type=int, default=None, metavar="N",
                      help="N random valid shapes per spec instead of the matrix (batch, "
                      "heads, lengths, q_offset, strided views; decode: ragged lengths and "
                      "shuffled page tables); a failure prints the --fuzz-case that replays it")
    test.add_argument("--fuzz-case", metavar="SEED:I",
                      help="replay one fuzz case (as a failure prints it)")
    test.add_argument("--jobs", "-j", type=int, default=1, metavar="N",
                      help="run the cases on N worker processes sharing the GPU (default 1); "
                      "every case draws its inputs from its own generator, so results do "
                      "not depend on N")
    test.add_argument("--gen", "--out", dest="gen", default="generated", metavar="DIR",
                      help="folder of generated modules (default: generated); --out is the "
                      "same option")
    test.add_argument("--emulate", action="store_true",
                      help="run the kernels on the CPU instead, through torch standing in "
                      "for cuda.tile (no GPU needed): the quick matrix, or fuzz shapes 8x "
                      "smaller; checks numerics and indexing, not the GPU's rounding or speed")

    tune = sub.add_parser(
        "tune",
        help="search a spec's autotune space on the GPU and write the winners into it",
        description="Time every config of the spec's autotune.<target> space with "
        "cuda.tile.tune.exhaustive_search at each length of a suite, check the winners "
        "against the fp64 reference, and write them into targets.<target> (by_seq_k "
        "buckets where shorter lengths win with another config), keeping the file's "
        "comments and order; then re-render the module. Exit 0 ok, 1 nothing correct, "
        "2 bad input.",
    )
    tune.add_argument("path", metavar="SPEC", help="spec file to tune (edited in place)")
    tune.add_argument("--target", required=True, metavar="SM",
                      help="GPU target to tune, e.g. sm_90; must be this machine's GPU")
    tune.add_argument("--suite", default="prefill",
                      help="suite whose shapes are timed: prefill, the only one tune takes "
                      "(default: prefill)")
    tune.add_argument("--seqs", metavar="LIST",
                      help="comma-separated sequence lengths instead of the suite's")
    tune.add_argument("--confirm", default="4", metavar="N",
                      help="re-time the N fastest configs per length (and the long-sequence "
                      "winner) with do_bench medians, as specgen bench does, and choose by "
                      "those; 0 chooses by the search's means (default: 4)")
    tune.add_argument("--dry-run", action="store_true",
                      help="search and report, but leave the spec and module unchanged")
    tune.add_argument("--results", default="bench/results", metavar="DIR",
                      help="results folder: the tuning report goes to "
                      "DIR/<gpu>/tune-<spec>-<target>.json (default: bench/results)")
    tune.add_argument("--gen", default="generated", metavar="DIR",
                      help="folder of generated modules (default: generated)")

    bench = sub.add_parser(
        "bench",
        help="time specs' kernels next to cuDNN, FA2 and FlexAttention",
        description="Time each kernel and the baselines in one process on the same "
        "inputs (triton do_bench medians); write JSON, a markdown table and a plot. "
        "Exit 0 ok (a baseline that fails is reported in the results), 1 a failure, "
        "2 bad input or no CUDA GPU.",
    )
    bench.add_argument("paths", nargs="*", metavar="SPEC", help="spec file or folder of specs")
    bench.add_argument("--variants", metavar="FILE",
                       help="time the variants of one spec listed in FILE (YAML) against "
                       "cuDNN (and any other --baselines) instead; see docs/tuning.md for the format")
    bench.add_argument("--suite", default=None,
                       help="benchmark suite: prefill (B4 Hq32, S 1024..16384), decode (one "
                            "token against a KV cache, B 1..64; CUDA graphs, steady state and one "
                            "call per graph) or backward (the "
                            "backward kernels of backward: true specs, B4 Hq32, S 1024..16384) "
                            "(default: prefill)")
    bench.add_argument("--baselines", default=None, metavar="LIST",
                       help="comma-separated names from cudnn,flash,flex,fa3,tilegym (default: "
                       "cudnn,flash,flex, or cudnn with --variants; fa3 and tilegym where "
                       "installed, else the row says why)")
    bench.add_argument("--seqs", metavar="LIST",
                       help="prefill and backward: time these lengths (Sq = Skv) instead of the "
                       "suite's 1024..16384, e.g. 2048,8192")
    bench.add_argument("--results", default="bench/results", metavar="DIR",
                       help="results folder; files go to DIR/<gpu>/ (default: bench/results)")
    bench.add_argument("--gen", default=None, metavar="DIR",
                       help="folder of generated modules (default: generated)")

    diff = sub.add_parser(
        "diff",
        help="what changes between two specs/modules, or a spec and a --set variant",
        description="Sections: 1 spec, 2 plan, 3 source (unified diff), 4 compiled "
        "resources per target, 5 performance from bench results. Exit 0 identical, "
        "1 different, 2 bad input.",
    )
    diff.add_argument("paths", nargs="*", metavar="PATH",
                      help="A B (spec files or generated modules), or A with --set; "
                      "with --templates, specs to re-render (default: specs)")
    diff.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                      help="diff A against A with this field changed, e.g. fast_math.exp2=false "
                      "(repeatable; values are YAML)")
    diff.add_argument("--templates", action="store_true",
                      help="re-render specs with the installed templates (a checkout's "
                      "working tree) and diff them against the modules in --gen")
    diff.add_argument("--stat", action="store_true", help="source section: counts only")
    diff.add_argument("--json", action="store_true",
                      help="machine-readable output (always with the whole source diff)")
    diff.add_argument("--no-compile", action="store_true", help="skip the compiled section")
    diff.add_argument("--results", default=None, metavar="DIR",
                      help="bench results for the performance section (default: bench/results); "
                      "not with --templates, which has no performance section")
    diff.add_argument("--gen", default=None, metavar="DIR",
                      help="with --templates, the folder of the modules to compare (default: "
                      "generated); read only")

    schema = sub.add_parser(
        "schema",
        help="print the spec's JSON Schema",
        description="Print the JSON Schema of the spec model (what specs/schema.json "
        "holds), or write it to --file. Exit 0 ok, 2 bad input.",
    )
    schema.add_argument("--file", metavar="FILE", help="write it to FILE instead of stdout")

    docs = sub.add_parser(
        "docs",
        help="regenerate the generated pages of a specgen checkout's docs/ (the spec field reference from the "
        "Pydantic model, the performance page from bench/results)",
        description="Regenerate docs/spec-reference.md and docs/performance.md in the "
        "project at --root. Exit 0 in step (or written), 1 with --check when a page drifted, "
        "2 bad input (a --root that is no checkout of specgen).",
    )
    docs.add_argument("--check", action="store_true", help="report drift, write nothing")
    docs.add_argument("--root", default=".", metavar="DIR", help="a checkout of specgen (default: .)")
    return parser


def schema_text() -> str:
    from specgen.spec import json_schema

    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def _folder(text: str, option: str, write: bool | str = True) -> Path:
    """A folder option (--gen, --results): a folder or a path to make one at.
    ``write``: True, the command writes there; "maybe", it writes only what is stale
    (test's modules), so a folder it may not write is fine until then; False, it only
    reads there (diff, build --check)."""
    if not text.strip():
        raise UsageError(f"{option}: expected a folder, got {text!r}")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {text}: exists and is not a folder")
    # A folder to make: its nearest existing parent must be a folder (where the
    # command writes: one it may write in, and no link on the way may dangle, as mkdir
    # refuses one), so that a run does not time everything and fail only when it writes.
    if write:
        for link in (p for p in (path, *path.parents) if not p.exists()):
            if link.is_symlink():
                raise UsageError(f"{option} {text}: {link} is a broken symbolic link "
                                 f"(to {os.readlink(link)})")
    existing = path if path.exists() else next((p for p in path.parents if p.exists()), Path("."))
    if not existing.is_dir():
        raise UsageError(f"{option} {text}: {existing} is not a folder")
    if write is True and not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {text}: {existing} is not writable")
    return path


def _schema_file(text: str) -> Path:
    """schema --file: a regular file to replace, or a new one in an existing folder."""
    path = Path(text)
    if not text.strip():
        raise UsageError("--file: expected a file name, got ''")
    if path.exists() and not path.is_file():
        raise UsageError(f"--file {text}: exists and is not a regular file")
    if not path.parent.is_dir():
        raise UsageError(f"--file {text}: no such folder {path.parent}")
    # A link is written through (its target replaced): a dangling one must point into
    # a folder that exists too, or the write would make the folders on its way.
    target = Path(os.path.realpath(path))
    if path.is_symlink() and not target.parent.is_dir():
        raise UsageError(f"--file {text}: a symbolic link to {os.readlink(path)}, whose folder "
                         f"{target.parent} does not exist")
    return path


def _refuse_together(args, *pairs: tuple[str, str, str]) -> None:
    """Options that contradict each other: (first, second, why)."""
    for first, second, why in pairs:
        if getattr(args, first.lstrip("-").replace("-", "_")) and getattr(
                args, second.lstrip("-").replace("-", "_")):
            raise UsageError(f"specgen {args.command}: {first} and {second} cannot be combined ({why})")


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            # Flushed here, not at the interpreter's exit: a reader that went away
            # (`specgen diff A B | head`, a pager quit early) shows now, also after
            # --help or --version, which argparse ends with SystemExit.
            sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        # Stop quietly, as a tool that SIGPIPE ends does, not with a line that blames
        # the input. What is still buffered has no reader: drop it, so that the
        # interpreter's last flush does not fail on it again.
        _drop_stdout()
        return 128 + 13  # 128 + SIGPIPE, what a shell reports for such a tool


def _main(argv: list[str] | None) -> int:
    # torch warns at import when NumPy is not installed; specgen needs no NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named for the command they were given to, not the top level
        print(f"specgen {args.command}: error: unrecognized arguments: {' '.join(extra)}",
              file=sys.stderr)
        return 2
    try:
        return _run(args)
    except SpecgenError as exc:
        for line in exc.lines():
            if isinstance(exc, UsageError) and line.startswith("--"):
                line = f"specgen {args.command}: {line}"  # an option's error: whose option
            print(line, file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_reader_gone():
            raise  # the output's reader went away: main's to end quietly
        # A path the system refused (a missing folder, a device, no permission): the
        # path and the reason, as for any other bad input.
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"specgen {args.command}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specgen: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # torch.OutOfMemoryError (named, so that main needs no torch import): the sizes
        # asked for do not fit the GPU, which is the input's doing, not a bug.
        if type(exc).__name__ != "OutOfMemoryError":
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
        print(f"specgen {args.command}: out of GPU memory for the sizes asked ({first})",
              file=sys.stderr)
        return 1


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on
    its writing end then), so that a broken pipe elsewhere is still reported."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False


def _drop_stdout() -> None:
    """Point stdout at the null device (its reader is gone)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, io.UnsupportedOperation):  # no file behind it (a test's StringIO)
        pass


def _run(args) -> int:
    """The command ``args`` names; its errors are main's to report."""
    if args.command == "build":
        from specgen.compile.jobs import run_build

        _refuse_together(args, ("--check", "--force", "--check writes nothing"))
        return run_build(
            args.paths,
            _folder(args.gen, "--gen", write=not args.check),  # --check writes nothing
            targets=args.targets,
            no_compile=args.no_compile,
            check=args.check,
            force=args.force,
            workers=args.jobs,
        )
    if args.command == "test":
        from specgen.check.runner import run_test

        from specgen.check.runner import parse_fuzz_case

        if args.fuzz is not None and not 1 <= args.fuzz <= 100000:
            raise UsageError(f"--fuzz: expected a count in [1, 100000], got {args.fuzz}")
        if not 1 <= args.jobs <= 64:
            raise UsageError(f"--jobs: expected a worker count in [1, 64], got {args.jobs}")
        # Parsed first: an empty --fuzz-case= is bad input, not an option left out.
        case = parse_fuzz_case(args.fuzz_case) if args.fuzz_case is not None else None
        _refuse_together(args, ("--fuzz", "--fuzz-case", "--fuzz-case replays one case"),
                         ("--quick", "--fuzz", "--fuzz draws its own shapes"),
                         ("--quick", "--fuzz-case", "--fuzz-case replays its own shape"))
        if args.seed is not None and args.fuzz_case:
            raise UsageError("specgen test: --seed and --fuzz-case cannot be combined (the case "
                             "names its own seed, SEED:INDEX)")
        # Written only where a module is stale (fresh_jobs names a folder it may not write).
        return run_test(args.paths, _folder(args.gen, "--gen", write="maybe"), quick=args.quick,
                        seed=0 if args.seed is None else args.seed,
                        fuzz=args.fuzz or 0, fuzz_case_seed=case, jobs=args.jobs,
                        emulate=args.emulate)
    if args.command == "tune":
        from specgen.bench import parse_suite
        from specgen.compile.jobs import parse_targets
        from specgen.commands.tune import parse_seqs, run_tune

        if not args.path.strip():
            raise UsageError(f"specgen tune: SPEC: expected a spec file, got {args.path!r}")
        if not args.target.strip():
            raise UsageError(f"--target: expected one target such as sm_90, got {args.target!r}")
        target = parse_targets(args.target, "--target")
        if len(target) != 1:
            raise UsageError(f"--target: expected one target such as sm_90, got {args.target!r}")
        if not re.fullmatch(r"[0-9]{1,2}", args.confirm) or int(args.confirm) > 64:
            raise UsageError(f"--confirm: expected a count in [0, 64], got {args.confirm!r}")
        return run_tune(Path(args.path), target[0], parse_suite(args.suite, allowed=("prefill",)),
                        _folder(args.results, "--results"),
                        _folder(args.gen, "--gen", write=not args.dry_run), seqs=parse_seqs(args.seqs),
                        dry_run=args.dry_run,
                        confirm=int(args.confirm))
    if args.command == "bench":
        from specgen.bench import parse_suite, run_suite
        from specgen.bench.baselines import parse_baselines

        if args.variants == "":
            raise UsageError("specgen bench: --variants: expected a variants file, got ''")
        if args.variants:
            from specgen.commands.explore import run_variants

            if args.paths:
                raise UsageError("specgen bench: give either SPEC paths or --variants FILE, not both")
            if args.seqs is not None:
                raise UsageError("specgen bench: --seqs does not apply to --variants (the file's "
                                 "shapes.seqs sets the lengths)")
            if args.suite is not None:
                raise UsageError(f"specgen bench: --suite {args.suite} does not apply to --variants "
                                 "(variants are timed as prefill calls)")
            if args.gen is not None:
                raise UsageError("specgen bench: --gen does not apply to --variants (the variants "
                                 "are rendered to a temporary folder)")
            run_variants(Path(args.variants), _folder(args.results, "--results"),
                         baselines=parse_baselines("cudnn" if args.baselines is None else args.baselines))
            return 0
        if not args.paths:
            raise UsageError("specgen bench: give at least one SPEC path (or --variants FILE)")
        suite = parse_suite("prefill" if args.suite is None else args.suite)
        shapes = None
        if args.seqs is not None:
            from specgen.commands.tune import parse_seqs

            if suite == "decode":
                raise UsageError("specgen bench: --seqs applies to the prefill and backward suites; the "
                                 "decode suite's shapes are (batch, cache length) pairs")
            shapes = [(None, None, seq) for seq in parse_seqs(args.seqs)]
        run_suite(suite, args.paths, results=_folder(args.results, "--results"),
                  gen=_folder("generated" if args.gen is None else args.gen, "--gen"), shapes=shapes,
                  baselines=parse_baselines("cudnn,flash,flex" if args.baselines is None
                                            else args.baselines))
        return 0
    if args.command == "diff":
        from specgen.commands.diff import run_diff

        _refuse_together(args, ("--stat", "--json", "--json carries the whole source diff"),
                         ("--templates", "--results", "--templates has no performance section"))
        # A folder option the mode would not read is refused, not ignored: A and B are
        # the paths given, and only --templates reads modules from --gen.
        if args.gen is not None and not args.templates:
            raise UsageError("specgen diff: --gen applies to --templates only (A and B are read "
                             "from the paths given)")
        return run_diff(args.paths, args.sets, args.templates, args.stat, args.json,
                        not args.no_compile,
                        _folder("bench/results" if args.results is None else args.results,
                                "--results", write=False),
                        _folder("generated" if args.gen is None else args.gen, "--gen", write=False))
    if args.command == "docs":
        from specgen.docs import DocsError, write_docs

        if not args.root.strip():
            raise UsageError("specgen docs: --root: expected a folder, got ''")
        try:
            changed = write_docs(Path(args.root), check=args.check)
        except DocsError as exc:
            raise UsageError("\n".join(f"specgen docs: {line}" for line in str(exc).splitlines())) from None
        for name in changed:
            print(f"{name}: {'out of date; run `specgen docs`' if args.check else 'written'}")
        if not changed:
            print("docs/ in step with the model and bench/results")
        return 1 if args.check and changed else 0
    if args.command == "schema":
        text = schema_text()
        if args.file is not None:
            from specgen.compile.export import atomic_write

            atomic_write(_schema_file(args.file), text.encode())
        else:
            sys.stdout.write(text)
        return 0
    return 2  # unreachable: argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
