"""Graph IR -> Graph IR passes, one per module, each a pure function."""
