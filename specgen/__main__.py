import sys

from specgen.commands.cli import main

sys.exit(main())
