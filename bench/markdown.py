"""The benchmarks' one way of writing a table into a Markdown file (BENCHMARKS.md): the text
between a begin and an end marker is replaced; without the markers the block is appended,
under `heading` when given."""

from __future__ import annotations

from pathlib import Path


def splice(path: str | Path, begin: str, end: str, body: str, heading: str = "") -> None:
    """Writes `begin`, `body`, `end` (each on its own line) into the file at `path`."""
    p = Path(path)
    doc = p.read_text() if p.exists() else ""
    block = f"{begin}\n{body.rstrip(chr(10))}\n{end}"
    if begin in doc and end in doc:
        doc = doc[:doc.index(begin)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + ("\n\n" if doc else "") + \
            (f"{heading}\n\n" if heading else "") + block + "\n"
    p.write_text(doc)
