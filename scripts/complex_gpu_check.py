"""Complex scans and long FFTs on a real GPU (issue 16; the CUDA paths of
tests/frontend/test_complex_scan_fft.py run there only in Triton's interpreter):
cumsum / cumprod by doubling along both dims, a 600-point (four-step) and a 521-point
(Bluestein) fft, compiled for the local GPU, run on fresh inputs at two sizes, compared with
eager in complex128. Prints one line per case and "ALL OK" last.

    python scripts/complex_gpu_check.py"""

from __future__ import annotations

import sys

import torch

import kiln


class Fn(torch.nn.Module):
    def forward(self, x):
        return (x.cumsum(1), x.cumsum(0), x.cumprod(1) * 0.5, torch.fft.fft(x, n=600),
                torch.fft.fft(x, n=521), torch.fft.ifft(x, dim=0))


def main() -> int:
    g = torch.Generator().manual_seed(0)
    bad = 0
    for dt, tol in ((torch.complex64, 2e-4), (torch.complex128, 1e-10)):
        x = torch.randn(4, 37, dtype=dt, generator=g) * 0.9
        runner = kiln.load(kiln.compile(torch.export.export(Fn(), (x.cuda(),)),
                                        device="cuda").save(f"/tmp/cplx_{dt}.kiln"),
                           device="cuda:0")
        x = torch.randn(4, 37, dtype=dt, generator=g) * 0.9
        got = runner(x.cuda())
        want = Fn()(x.to(torch.complex128))
        for i, (a, w) in enumerate(zip(got, want, strict=True)):
            err = float((a.cpu().to(torch.complex128) - w).abs().max() /
                        w.abs().max().clamp_min(1e-30))
            ok = err <= tol
            bad += not ok
            print(f"{dt} output {i}: rel err {err:.2e} {'ok' if ok else 'WRONG'}")
    print("ALL OK" if not bad else f"{bad} WRONG")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
