"""scratch: resnet18 bf16 b1 implicit vs im2col packages for `kiln profile`."""
import sys, os, torch, kiln
from kiln.models import ALL_MODELS
out = os.environ.get("OUT", "/tmp/out")
spec = ALL_MODELS["resnet18"]()
m = spec.module.eval().to("cuda", torch.bfloat16)
x = torch.randn(1, 3, 224, 224, device="cuda").to(torch.bfloat16)
ep = torch.export.export(m, (x,))
for conv in ("implicit", "im2col"):
    cm = kiln.compile(ep, device="cuda", options=kiln.Options(cuda_conv=conv))
    cm.save(f"/tmp/r18_{conv}.kiln")
    if conv == "implicit":
        open(f"{out}/kernels_triton.py", "w").write(cm.sources["kernels_triton.py"])
print("saved")
