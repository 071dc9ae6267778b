"""kiln packages: the single-file artifact (``model.kiln``) of a compiled model.

``write_package(path, manifest, files, weights)`` writes one; ``read_package(path)`` opens and
verifies one and returns a ``Package``. See ``kiln.package.format`` for the file format.
"""
from kiln.package.format import ALIGNMENT, FORMAT, write_package
from kiln.package.reader import Package, read_package

__all__ = ["ALIGNMENT", "FORMAT", "Package", "read_package", "write_package"]
