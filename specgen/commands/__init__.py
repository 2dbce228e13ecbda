"""The commands: the CLI and the work of tune, diff and explore."""
