"""kiln's bundled model zoo (see :mod:`kiln.models.zoo`)."""

from kiln.models.zoo import ALL_MODELS, ModelSpec, get

__all__ = ["ALL_MODELS", "ModelSpec", "get"]
