"""One rank of a tensor-parallel test run (tests/runtime/test_tp.py, tests/targets/cuda/
test_tp_cuda.py, bench/tp_gpu.py): loads its package with kiln.load(rank=, world_size=,
comm_id=), runs it and saves what it got for the parent to compare.

    tp_worker.py collectives PKG INPUTS.pt OUT{rank}.pt [--device D] [--rank R --world N --id HEX]
    tp_worker.py llama PKG_DIR OUT.pt|OUT{rank}.pt [--steps K] [--update] [...]

Rank and world size come from mpirun's environment (OMPI_COMM_WORLD_RANK / _SIZE) unless
given; `--id` is the NCCL unique id in hex (CUDA packages)."""

from __future__ import annotations

import argparse
import os

import torch

import kiln


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("collectives", "llama"))
    p.add_argument("paths", nargs="+")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--world", type=int, default=None)
    p.add_argument("--id", default="")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--update", action="store_true", help="update_weights, then run again")
    p.add_argument("--repeat", type=int, default=1, help="collectives: run K times, all equal")
    return p.parse_args()


def main() -> None:
    a = _args()
    rank = a.rank if a.rank is not None else int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = a.world if a.world is not None else int(os.environ["OMPI_COMM_WORLD_SIZE"])
    device = a.device
    if device.startswith("cuda"):
        torch.cuda.set_device(int(device.split(":")[1]) if ":" in device else 0)
    comm_id = bytes.fromhex(a.id) if a.id else None
    if a.mode == "collectives":
        pkg, inputs, out = a.paths
        r = kiln.load(pkg, device, rank=rank, world_size=world, comm_id=comm_id)
        xs = [x.to(device) for x in torch.load(inputs)[rank]]
        def run() -> list:  # a one-output program returns its tensor, not a tuple
            ys = r(*xs)
            return [y.cpu() for y in ((ys,) if isinstance(ys, torch.Tensor) else ys)]

        got = run()
        for k in range(1, a.repeat):  # CUDA: run 2 captures the graph, later runs replay it
            again = run()
            for i, (g, y) in enumerate(zip(got, again)):
                if not torch.equal(g, y):
                    raise SystemExit(f"rank {rank}: run {k + 1}, output {i} differs from run 1 "
                                     f"(max |diff| {(g.double() - y.double()).abs().max():.3g})")
        torch.save(got, out.format(rank=rank))
        return
    pkg_dir, out = a.paths
    r = kiln.load(os.path.join(pkg_dir, f"rank{rank}.kiln"), device, rank=rank,
                  world_size=world, comm_id=comm_id)
    tokens = torch.load(os.path.join(pkg_dir, "prompt.pt")).to(device)
    logits = r(tokens)
    again = logits
    if a.update:  # new weights (the same values): the fresh instance keeps the communicator
        r.update_weights(os.path.join(pkg_dir, f"rank{rank}.safetensors"))
        again = r(tokens)
        if not torch.equal(again, logits):
            d = (again.double() - logits.double()).abs().max().item()
            raise SystemExit(f"rank {rank}: the run after update_weights differs (max |diff| "
                             f"{d:.3g})")
    for _ in range(a.steps):  # greedy decoding, the whole sequence each step
        nxt = r(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    # OUT with "{rank}": every rank saves its own (the parent compares ranks); else rank 0
    if rank == 0 or "{rank}" in out:
        torch.save({"logits": logits.cpu(), "again": again.cpu(), "tokens": tokens.cpu()},
                   out.format(rank=rank))

if __name__ == "__main__":
    main()
