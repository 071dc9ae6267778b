"""The kiln version, recorded in every package manifest."""

__version__ = "0.1.0"
