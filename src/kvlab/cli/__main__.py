"""`python -m kvlab.cli`: the same as the `kvlab` command."""

from kvlab.cli import entry_point

entry_point()
