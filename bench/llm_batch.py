"""Batched decode with per-sequence positions (issue 17 item 5): decode tokens/s of a
Llama-shaped decoder at batch B = 1, 2, 4, 8 through kiln's batched package
(kiln/models/batched_decoder.py: prefill + decode entry points, static caches
[B, kv_heads, max_len, head_dim]) against eager PyTorch on the same module, on the CPU
(`--threads`, default 2) and on CUDA when a GPU is present.

The model is built from a config with random weights (kiln.models.hf_decoder.build; no
downloads). Each B has its own package (the batch is static). A round: reset the caches,
prefill B prompts of different lengths (drawn in [--min-prompt, --max-prompt], seeded),
then `--steps` greedy decode steps, every sequence at its own position (the decode inputs
built before timing: the loop times the decode calls only, eager and kiln alike, and
synchronises the GPU at the end). The figure is the median over `--rounds` rounds of
B * steps / seconds (in brackets: the best round's, less exposed to a shared machine);
kiln and eager alternate within each round. Before timing, the first
decode's logits of kiln and eager are compared (max |difference| in the table).

    python bench/llm_batch.py [--layers 4 --hidden 512 --vocab 8192] [--batches 1,2,4,8]
        [--threads 2] [--steps 16] [--rounds 5] [--no-cuda] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kiln  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from bench.markdown import splice  # noqa: E402
from kiln.models import batched_decoder as bd  # noqa: E402
from kiln.models import hf_decoder  # noqa: E402


HEADING = "## Session of 2026-11-27 (fourteenth): batched decode (s14bat)"


def load_avg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def tree() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "?"


def prompts_for(batch: int, lo: int, hi: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed + batch)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(batch)]


class System:
    """prefill / decode / reset of one system (kiln or eager) at one batch, on one device."""

    def __init__(self, prefill, decode, reset, dev: torch.device) -> None:
        self.prefill, self.decode, self.reset, self.dev = prefill, decode, reset, dev

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    @torch.no_grad()
    def round(self, prompts: list[list[int]], steps: int) -> tuple[float, torch.Tensor]:
        """Seconds of `steps` decode steps after a prefill, and the first decode's logits."""
        b = len(prompts)
        width = max(map(len, prompts))
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.dev)
        lens = torch.tensor([len(p) for p in prompts], device=self.dev)
        self.reset()
        nxt = self.prefill(ids, lens).argmax(-1).reshape(b, 1)
        # the inputs of every step, made before timing (the greedy tokens of the first step
        # are fed again: each step does the same work as greedy decoding would)
        inputs = [(nxt, lens + i) for i in range(steps)]
        self.sync()
        first = self.decode(*inputs[0]).float().cpu()
        self.reset()
        self.prefill(ids, lens)
        self.sync()
        t = time.perf_counter()
        for x, pos in inputs:
            self.decode(x, pos)
        self.sync()
        return time.perf_counter() - t, first


def systems_for(model, batch: int, args, dev: torch.device, work: Path) -> dict[str, System]:
    t = time.perf_counter()
    progs = bd.export_batched(model, batch, args.max_len, max_prompt=args.max_prompt)
    opts = kiln.Options(num_threads=args.threads) if dev.type == "cpu" else None
    c = kiln.compile(progs, device=dev.type, options=opts)
    pkg = c.save(work / f"batch{batch}_{dev.type}.kiln")
    runner = kiln.load(pkg, device=str(dev), num_threads=args.threads
                       if dev.type == "cpu" else None)
    print(f"  B={batch} {dev.type}: exported + compiled in {time.perf_counter() - t:.1f} s",
          flush=True)
    prefill, decode = bd.entries(model, batch, args.max_len)
    return {"kiln": System(runner.entry("prefill"), runner.entry("decode"),
                           runner.reset_state, dev),
            "eager": System(prefill, decode, prefill.m.reset, dev)}


def run_device(dev: torch.device, args, work: Path) -> list[dict]:
    model = hf_decoder.build("llama", seed=0, init="fan_in", device=dev, hidden=args.hidden,
                             layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                             intermediate=args.inter, vocab=args.vocab,
                             max_pos=max(512, args.max_len))
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    rows = []
    for batch in args.batches:
        systems = systems_for(model, batch, args, dev, work)
        prompts = prompts_for(batch, args.min_prompt, args.max_prompt, args.seed, args.vocab)
        times: dict[str, list[float]] = {k: [] for k in systems}
        firsts = {}
        for r in range(args.rounds + 1):  # round 0 warms up (CUDA graphs, caches)
            order = list(systems) if r % 2 else list(systems)[::-1]
            for name in order:
                s, first = systems[name].round(prompts, args.steps)
                firsts[name] = first
                if r:
                    times[name].append(s)
        diff = float((firsts["kiln"] - firsts["eager"]).abs().max())
        row = {"device": dev.type, "batch": batch, "prompt_lengths": [len(p) for p in prompts],
               "max_abs_diff": diff, "load": load_avg()}
        for name, ts in times.items():
            sec = statistics.median(ts)
            row[f"{name}_tok_s"] = batch * args.steps / sec
            row[f"{name}_ms_step"] = sec / args.steps * 1e3
            row[f"{name}_best_tok_s"] = batch * args.steps / min(ts)
        rows.append(row)
        print(f"  B={batch}: kiln {row['kiln_tok_s']:.0f} tok/s, eager "
              f"{row['eager_tok_s']:.0f} tok/s, max |diff| {diff:.2e}", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| device | B | prompt lengths | kiln ms/step | kiln tokens/s (best round) | "
           "eager ms/step | eager tokens/s (best round) | kiln / eager | kiln tokens/s vs B=1 "
           "| max abs diff (logits) | load |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    base = {}
    for r in rows:
        base.setdefault(r["device"], r["kiln_tok_s"])
        out.append(f"| {r['device']} | {r['batch']} | {','.join(map(str, r['prompt_lengths']))}"
                   f" | {r['kiln_ms_step']:.2f} | {r['kiln_tok_s']:.0f} "
                   f"({r['kiln_best_tok_s']:.0f}) | {r['eager_ms_step']:.2f} | "
                   f"{r['eager_tok_s']:.0f} ({r['eager_best_tok_s']:.0f}) | "
                   f"{r['kiln_tok_s'] / r['eager_tok_s']:.2f}x | "
                   f"{r['kiln_tok_s'] / base[r['device']]:.2f}x | {r['max_abs_diff']:.1e} | "
                   f"{r['load']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--max-len", type=int, default=256, help="cache positions per sequence")
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (kiln and eager)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-cuda", action="store_true", help="skip CUDA even with a GPU")
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--work", default="/tmp/kiln-llm-batch")
    ap.add_argument("--markdown", help="write the table into this Markdown file")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.min_prompt < 1 or args.max_prompt < args.min_prompt or \
            args.max_prompt + args.steps > args.max_len:
        sys.exit(f"llm_batch: need 1 <= --min-prompt <= --max-prompt and --max-prompt + "
                 f"--steps <= --max-len ({args.max_len})")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    devs = [] if args.no_cpu else [torch.device("cpu")]
    if torch.cuda.is_available() and not args.no_cuda:
        devs.append(torch.device("cuda"))
    rows = []
    for dev in devs:
        print(f"{dev}:", flush=True)
        rows += run_device(dev, args, work)
    gpu = f", GPU {torch.cuda.get_device_name()}" if any(d.type == "cuda" for d in devs) else ""
    head = (f"Llama-shaped decoder, {args.layers} layers x {args.hidden} (heads {args.heads}, "
            f"kv heads {args.kv_heads}, intermediate {args.inter}, vocab {args.vocab}), fp32, "
            f"cache {args.max_len} positions per sequence, {args.steps} decode steps a round, "
            f"median of {args.rounds} rounds; CPU {cpu_name()}, {args.threads} threads{gpu}; "
            f"tree {tree()}; load average at the end {load_avg()}")
    text = "\n".join([head, "", table(rows)])
    print(text)
    if args.markdown:
        command = "python bench/llm_batch.py " + " ".join(sys.argv[1:])
        tag = f"llm-batch-t{args.threads}"
        splice(args.markdown, f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->",
               f"Command: `{command}`\n\n{text}",
               heading="" if HEADING in Path(args.markdown).read_text() else HEADING)


if __name__ == "__main__":
    main()
