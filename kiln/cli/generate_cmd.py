"""``kiln generate PKG --prompt-ids 1,2,3 --max-new-tokens N``: prefill the prompt, decode
token by token (kiln.runtime.generate: libkiln's kiln_sample, as examples/c/generate.c),
print the tokens and the speed. `--device cuda` runs a CUDA package, sampling on the device
when the package has a `sample` entry point (kiln/models/device_sampler.py).

A batched package (kiln.models.batched_decoder.export_batched) takes `--prompt-ids` once per
prompt (up to its batch, of different lengths): kiln.runtime.generate_batch decodes them
together, each sequence at its own position, and prints one line of tokens per prompt."""

from __future__ import annotations

import argparse
import json

from kiln.errors import InputError
from kiln.runtime import generate, generate_batch, load
from kiln.runtime.generation import is_batched


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise InputError(f"--prompt-ids: expected comma-separated integers, got {text!r}") \
            from None
    if not ids:
        raise InputError("--prompt-ids: the prompt is empty")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    texts = args.prompt_ids if isinstance(args.prompt_ids, list) else [args.prompt_ids]
    prompts = [parse_ids(t) for t in texts]
    if args.repeat < 1:
        raise InputError(f"--repeat must be >= 1, got {args.repeat}")
    runner = load(args.package, device=args.device, num_threads=args.threads)
    try:
        if is_batched(runner):
            return _batched(args, runner, prompts)
        if len(prompts) > 1:
            raise InputError(f"--prompt-ids given {len(prompts)} times, but this package "
                             "decodes one sequence; compile a batched package "
                             "(kiln.models.batched_decoder.export_batched) for several")
        prompt = prompts[0]
        for _ in range(args.repeat):
            g = generate(runner, prompt, args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                         device_sampling=False if args.host_sampling else None)
    finally:
        runner.close()
    if args.json:
        print(json.dumps({"prompt": prompt, "tokens": g.tokens,
                          "prefill_ms": g.prefill_seconds * 1e3,
                          "decode_ms_per_token": (g.decode_seconds / g.decode_steps * 1e3
                                                  if g.decode_steps else None),
                          "decode_tokens_per_s": g.decode_tokens_per_s,
                          "tokens_per_s": g.tokens_per_s, "device": args.device,
                          "sampling": g.sampling}))
        return 0
    print("tokens:", ",".join(map(str, g.tokens)))
    per = f"{g.decode_seconds / g.decode_steps * 1e3:.2f} ms/token, " if g.decode_steps else ""
    print(f"sampling on the {g.sampling}; prefill: {len(prompt)} tokens in "
          f"{g.prefill_seconds * 1e3:.2f} ms; decode: "
          f"{g.decode_steps} tokens, {per}{g.decode_tokens_per_s:.1f} tokens/s; overall "
          f"{g.tokens_per_s:.1f} tokens/s")
    return 0


def _batched(args: argparse.Namespace, runner, prompts: list[list[int]]) -> int:
    for _ in range(args.repeat):
        g = generate_batch(runner, prompts, args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
    if args.json:
        print(json.dumps({"prompts": prompts, "tokens": g.tokens, "batch": g.batch,
                          "prefill_ms": g.prefill_seconds * 1e3,
                          "decode_ms_per_step": (g.decode_seconds / g.decode_steps * 1e3
                                                 if g.decode_steps else None),
                          "decode_tokens_per_s": g.decode_tokens_per_s,
                          "tokens_per_s": g.tokens_per_s, "device": args.device}))
        return 0
    for t in g.tokens:
        print("tokens:", ",".join(map(str, t)))
    per = f"{g.decode_seconds / g.decode_steps * 1e3:.2f} ms/step, " if g.decode_steps else ""
    print(f"batch {g.batch} ({len(prompts)} prompts of {', '.join(str(len(p)) for p in prompts)}"
          f" tokens); prefill {g.prefill_seconds * 1e3:.2f} ms; decode: {g.decode_steps} steps,"
          f" {per}{g.decode_tokens_per_s:.1f} tokens/s; overall {g.tokens_per_s:.1f} tokens/s")
    return 0
