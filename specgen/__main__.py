import sys

from specgen.commands.cli import main

# The guard keeps worker processes (spawned by `specgen test -j`) from running the CLI.
if __name__ == "__main__":
    sys.exit(main())
