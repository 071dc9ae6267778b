"""Exceptions raised by kiln. Every error a user can provoke is one of these, with a message
that names the thing at fault, what was expected and what was found."""


class KilnError(Exception):
    """Base class of every kiln error."""


class PackageError(KilnError):
    """A package file is missing, truncated, tampered with or of an unknown format version."""


class InputError(KilnError, ValueError):
    """An input given to a compiled model does not match what the export promised."""


class UnsupportedError(KilnError):
    """The program uses an operator or a feature kiln cannot compile."""


class CompileError(KilnError):
    """A compiler stage failed: an IR verifier, the C++ compiler, or a toolchain step."""


class PlanError(KilnError):
    """A memory plan places two simultaneously live buffers on overlapping bytes."""
