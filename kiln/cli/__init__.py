"""The ``kiln`` command line: compile, run, inspect and demo (see :mod:`kiln.cli.main`)."""
