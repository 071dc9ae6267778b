"""Packages with several entry points (e.g. a decoder's `prefill` and `decode`): one package,
one weights blob, one model library per entry, state buffers shared per loaded instance.

Layout: the first entry is the package's default one and sits where a single-entry package
has everything (the top-level `inputs`, `outputs`, `in_spec`, ..., `lib/model.so`,
`src/...`), so a reader that knows no entries runs it; entry k >= 1 has its files under
`entries/<name>/`. The manifest's `entries` lists every entry (first one included): its
`name`, `library` (and `requires`: the CPU levels of its libraries), its inputs, outputs and
specs, and `weights`: {the entry library's weight name: the key in weights.safetensors}.

Weights: an entry's weight is stored once when an earlier entry already stored the same FQN
with the same dtype, shape, layout (freezing, prepacking) and values; its key is then that
earlier one. State buffers (weights the programs update: a KV cache) with the same FQN are one
key, hence one buffer per loaded instance that every entry reads and writes (libkiln:
kiln_model_abi's share_state); their dtype and shape must agree.

Views (issue 17): a weight whose bytes are a row range of another stored weight is not stored
itself: the entry's `weights` record maps its name to {"key": the stored tensor's key,
"offset": bytes into it, "dtype", "shape"} instead of a key. That is how an entry point that
reads q, k and v (or gate and up) as separate GEMM weights shares the bytes of another entry
point's merged q/k/v weight (passes/merge_gemms.py merges only GEMMs of few rows: decode, not
prefill; the quantised weights of targets/cuda/quant.py alike): libkiln binds the view to its
bytes in the stored tensor, and on a device to the one upload of that tensor (share_weight at
the offset), so the package and the GPU hold each weight once. A view's offset is a multiple of
VIEW_ALIGNMENT (what a weight of its own gets); other contained tensors stay stored apart."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kiln.errors import KilnError

ENTRY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: what the Python runner and `kiln inspect` call the one entry of a package without entries
DEFAULT_ENTRY = "forward"
#: the keys of an entry's own manifest copied into its record
ENTRY_KEYS = ("inputs", "outputs", "in_spec", "out_spec", "symbols", "constant_inputs",
              "requires", "kernels", "input_mutations")
#: a view's byte offset into its stored tensor is a multiple of this: CUDA uploads each weight
#: 256-byte aligned (kernels assume 16), safetensors' data and the CPU's weights are 8-aligned
VIEW_ALIGNMENT = 256
#: the words of an FQN: a folded or quantised weight's FQN names those of its parts
_WORDS = re.compile(r"[^\s,<>:()]+")


def check_entry_names(names: Sequence[Any]) -> None:
    if not names:
        raise KilnError("kiln.compile: the dict of entry points is empty (give at least one "
                        "name -> (model, example_args[, dynamic_shapes]))")
    for n in names:
        if not isinstance(n, str) or not ENTRY_NAME.match(n):
            raise KilnError(f"kiln.compile: entry point name {n!r} is not an identifier "
                            "(letters, digits and _, not starting with a digit)")


def _layout(rec: Mapping[str, Any]) -> tuple:
    return (rec["dtype"], tuple(rec["shape"]), tuple(rec.get("permuted") or ()),
            repr(sorted((rec.get("packed") or {}).items())))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def merge(parts: Sequence[tuple[str, Mapping[str, Any], Mapping[str, bytes],
                                Mapping[str, torch.Tensor]]]
          ) -> tuple[dict[str, Any], dict[str, bytes], dict[str, torch.Tensor]]:
    """(name, manifest, files, weights) per entry, in order -> the package's manifest, files
    and weights blob."""
    check_entry_names([p[0] for p in parts])
    blob: dict[str, torch.Tensor] = {}
    records: dict[str, dict[str, Any]] = {}  # blob key -> its manifest "weights" record
    by_fqn: dict[str, list[str]] = {}  # fqn -> keys stored for it
    files: dict[str, bytes] = {}
    entries = []
    for k, (name, man, own_files, weights) in enumerate(parts):
        prefix = "" if k == 0 else f"entries/{name}/"
        keys: dict[str, str] = {}
        for rec in man.get("weights", []):
            w, fqn, state = rec["name"], rec["fqn"], bool(rec.get("state"))
            t = weights[w]
            key = None
            for cand in by_fqn.get(fqn, []):
                other = records[cand]
                if state or other.get("state"):
                    if bool(other.get("state")) != state or _layout(other) != _layout(rec):
                        raise KilnError(
                            f"kiln.compile: entry points disagree on state buffer {fqn!r}: "
                            f"entry {name!r} has it as {'state' if state else 'a weight'} "
                            f"{rec['dtype']}{list(rec['shape'])}, an earlier entry as "
                            f"{'state' if other.get('state') else 'a weight'} "
                            f"{other['dtype']}{list(other['shape'])}; the entries of one "
                            "package share their state buffers by FQN")
                    key = cand
                    break
                if _layout(other) == _layout(rec) and _same_values(blob[cand], t):
                    key = cand
                    break
            if key is None:
                key = w if w not in blob else f"{name}.{w}"
                while key in blob:
                    key = "_" + key
                blob[key] = t
                records[key] = {**rec, "name": key}
                by_fqn.setdefault(fqn, []).append(key)
            keys[w] = key
        for arc, data in own_files.items():
            files[prefix + arc] = data
        req = dict(man.get("requires", {}))
        if prefix and "cpu_levels" in req:
            req["cpu_levels"] = [{**lv, "library": prefix + lv["library"]}
                                 for lv in req["cpu_levels"]]
        entries.append({"name": name, "library": prefix + "lib/model.so",
                        **{key: man[key] for key in ENTRY_KEYS if key in man},
                        "requires": req, "weights": keys})
    _share_contained(blob, records, entries)
    first = parts[0][1]
    manifest = dict(first)
    manifest["weights"] = list(records.values())
    manifest["entries"] = entries
    manifest["build"] = {**first.get("build", {}), "compile_seconds": sum(
        float(p[1].get("build", {}).get("compile_seconds", 0.0)) for p in parts)}
    return manifest, files, blob


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s elements as integers of their size (a byte-exact comparison: -0.0 is not 0.0, a
    NaN equals itself), or None for a dtype without one."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype.is_complex or t.element_size() not in ints:
        return None
    try:
        return t.detach().contiguous().view(ints[t.element_size()])
    except RuntimeError:
        return None


def _row_offset(big: torch.Tensor, small: torch.Tensor) -> int | None:
    """The byte offset of `small` in `big` where `small` is rows r .. r + n of `big` (dims
    after the first equal, same dtype), at a multiple of VIEW_ALIGNMENT; else None."""
    if big.dtype != small.dtype or small.dim() != big.dim() or small.dim() == 0 or \
            small.shape[1:] != big.shape[1:] or not 0 < small.shape[0] < big.shape[0]:
        return None
    b, s = _bits(big), _bits(small)
    if b is None or s is None:
        return None
    n = s.shape[0]
    row_bytes = s[0].numel() * s.element_size()
    b2, s2 = b.reshape(b.shape[0], -1), s.reshape(n, -1)
    # rows whose first element matches (a column: cheap), then the row, then the range
    starts = (b2[:b.shape[0] - n + 1, 0] == s2[0, 0]).nonzero().flatten().tolist()
    for r in starts:
        if (r * row_bytes) % VIEW_ALIGNMENT == 0 and torch.equal(b2[r], s2[0]) and \
                torch.equal(b2[r:r + n], s2):
            return r * row_bytes
    return None


def _share_contained(blob: dict[str, torch.Tensor], records: dict[str, dict[str, Any]],
                     entries: list[dict[str, Any]]) -> None:
    """Stored weights that are a row range of another stored weight become views into it
    (the module's docstring), in place: dropped from `blob` and `records`, and each entry's
    `weights` record maps them to {"key", "offset", "dtype", "shape"}. Candidates: the same
    dtype, more rows, and an FQN naming every word of the contained one's (a merged weight's
    `<folded a, b, c: ...>` names a, b and c; so do their quantised forms)."""
    plain = [k for k, r in records.items() if not r.get("state") and blob[k].numel() > 0]
    order = sorted(plain, key=lambda k: blob[k].numel(), reverse=True)
    words = {k: set(_WORDS.findall(records[k].get("fqn") or k)) for k in plain}
    view: dict[str, tuple[str, int]] = {}  # contained key -> (stored key, byte offset)
    for i, k in enumerate(order):
        t = blob[k]
        for big in order[:i]:
            if blob[big].dtype != t.dtype or not words[k] <= words[big] or \
                    blob[big].numel() <= t.numel():
                continue
            off = _row_offset(blob[big], t)
            if off is not None:
                base, off0 = view.get(big, (big, 0))
                view[k] = (base, off0 + off)
                break
    if not view:
        return
    for e in entries:
        e["weights"] = {w: ({"key": view[key][0], "offset": view[key][1],
                             "dtype": records[key]["dtype"], "shape": list(records[key]["shape"])}
                            if isinstance(key, str) and key in view else key)
                        for w, key in e["weights"].items()}
    for k in view:
        del blob[k], records[k]


def entry_names(manifest: Mapping[str, Any]) -> list[str]:
    """The entry points of a package's manifest ([DEFAULT_ENTRY] without `entries`)."""
    return [e["name"] for e in manifest.get("entries", [])] or [DEFAULT_ENTRY]


def entry_manifest(manifest: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The manifest as one entry sees it (its inputs, outputs, specs, ...); a name the
    package lacks raises KilnError naming the entries it has."""
    entries = manifest.get("entries")
    if not entries:
        if name == DEFAULT_ENTRY:
            return dict(manifest)
    else:
        for e in entries:
            if e["name"] == name:
                out = {**manifest, **e}
                if "input_mutations" not in e:  # (the first entry's, in the top level)
                    out.pop("input_mutations", None)
                return out
    raise KilnError(f"no entry point {name!r} in this package (its entry points: "
                    f"{', '.join(entry_names(manifest))})")
