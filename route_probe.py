"""route_slots alone at several T (ncu target; temp probe)."""
import sys, torch
sys.path.insert(0, ".")
from ts_moe import ops
torch.manual_seed(0)
for e, k in ((128, 8), (256, 8), (8, 2)):
    for t in (1, 16, 64, 128):
        logits = torch.randn(t, e, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            ops.route_slots(logits, k)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"E{e}_T{t}")
        ops.route_slots(logits, k)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
print("done")
