"""Slab bias (column_bias="slab") against the warpgroup bias on one small case, one case per process
(a crash then costs one case), with benchmarks/results/forward_session15_slab_bias.patch applied:
    python3 benchmarks/gpu_jobs/slab_check.py CASE S      CASE: full, ri, ri_forced, causal"""
import copy, os, sys
import torch
from flexmask import compile_mask, masks
from flexmask.kernels.forward import hopper as forward_hopper
from flexmask.kernels.common.masking import mask_broadcast


def rand_intervals(s):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, s + 1, (s,), generator=gen), torch.randint(0, s + 1, (s,), generator=gen)
    return masks.column_intervals(torch.minimum(a, b).cuda(), torch.maximum(a, b).cuda())


case, s = sys.argv[1], int(sys.argv[2])
d, b, h = 64, 1, 2
mask = {"full": masks.full(), "ri": rand_intervals(s), "ri_forced": rand_intervals(s), "causal": masks.causal()}[case]
cm = compile_mask(mask, s, s, device="cuda")
if case == "ri_forced":
    cm = copy.copy(cm)
    cm.fwd_num_full = cm.fwd_offsets[1:] - cm.fwd_offsets[:-1]
gen = torch.Generator(device="cuda").manual_seed(1)
q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
mm = mask_broadcast(cm, b, h, h)
ref, ref_lse = forward_hopper.attention_forward_hopper(q, k, v, cm, d ** -0.5, mm, column_bias=True)
out, lse = forward_hopper.attention_forward_hopper(q, k, v, cm, d ** -0.5, mm, column_bias="slab",
                                                   stages=int(os.environ.get("STAGES", "2")), pingpong=False)
torch.cuda.synchronize()
err = (out.float() - ref.float()).abs()
per_slab = err.amax(-1).view(b * h, s // 16, 16).amax(-1)  # [bh, slab]
bad = (per_slab > 0.02).nonzero().tolist()
lerr = (lse - ref_lse).abs().nan_to_num(0, 100, 100)
print(f"case={case} S={s}: max|dO|={err.max().item():.3e} "
      f"max|dLSE|={lerr.max().item():.3e} nan={out.isnan().sum().item()} bad slabs {len(bad)}/{per_slab.numel()} "
      f"first {bad[:12]}", flush=True)
