"""Errors that the CLI turns into one line and an exit code, never a traceback."""


def printable(text: str) -> str:
    """``text`` with its control characters (line breaks among them) escaped, so that
    a name taken from input cannot split or forge a line of a message."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def shortened(text: str, limit: int = 80) -> str:
    """``text``, cut to ``limit`` characters ending in "..." where it is longer: a key
    or name taken from input stays a readable part of a one-line message."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


class SpecgenError(Exception):
    """Base class for expected failures (bad input, failed compile, drift)."""

    exit_code = 1

    def lines(self) -> list[str]:
        """The message as the CLI prints it: one line per problem."""
        return str(self).splitlines() or [type(self).__name__]


class SpecError(SpecgenError):
    """A spec file could not be read or validated. One message line per problem."""

    exit_code = 2

    def __init__(self, path, problems):
        self.path = str(path)
        self.problems = list(problems)  # [(field_path, message)]
        super().__init__("\n".join(self.lines()))

    def lines(self):
        out = []
        for field, message in self.problems:
            where = f"{self.path}: {field}: " if field else f"{self.path}: "
            out.append(printable(where + message))
        return out


class InvalidSpecs(SpecgenError):
    """Problems found across several spec files, reported together."""

    exit_code = 2


class UsageError(SpecgenError):
    """A bad command-line argument."""

    exit_code = 2


class RenderError(SpecgenError):
    """A template failed to render: a bug in a template, reported with its line."""

    exit_code = 1


class CompileError(SpecgenError):
    """cuda-tile failed to compile a generated kernel for a target."""

    exit_code = 1
