"""Host microseconds of a training step split by where autograd runs the backward (GPU only).

Autograd hands a CUDA node's backward to a device thread of its own; flexmask's backward is
Python, SDPA's is C++. Printed, B = 1, S = 512, causal, D = 128, bf16 (the per_call benchmark's
host-bound shape): flexmask's forward with grad, its backward called directly (no autograd), the
whole step through autograd, the step with `torch.autograd.set_multithreading_enabled(False)`
(the backward on the calling thread), and SDPA's step both ways. The step less the forward and
the direct backward is what the hand-off costs.

    PYTHONPATH=$PWD python -m tools.backward_thread_cost
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import flexmask
from benchmarks.cuda_guard import require_cuda
from benchmarks.per_call import issue_time_us
from flexmask import masks
from flexmask.kernels import dispatch

CALLS = 300


def main(argv=None) -> int:
    require_cuda("tools.backward_thread_cost", "times training steps on a GPU")
    q = torch.randn(1, 16, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn_like(q, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    cm = flexmask.compile_mask(masks.causal(), 512, 512, device="cuda")
    with torch.no_grad():
        o, lse = flexmask.attention(q, k, v, mask=cm, return_lse=True)
    detached = (q.detach(), k.detach(), v.detach())

    cases = {
        "flexmask forward with grad": lambda: flexmask.attention(q, k, v, mask=cm),
        "flexmask backward, called directly": lambda: dispatch.attention_backward(
            do, None, *detached, o, lse, cm, q.shape[-1] ** -0.5, deterministic=False),
        "flexmask step through autograd": lambda: flexmask.attention(q, k, v, mask=cm).backward(do),
        "sdpa step through autograd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do),
    }
    on_calling_thread = ("flexmask step through autograd", "sdpa step through autograd")
    print(torch.cuda.get_device_name())
    for name, fn in cases.items():
        for _ in range(20):  # compiles and caches first
            fn()
        print(f"{name:44s} {issue_time_us(fn, CALLS):8.1f} us")
    with torch.autograd.set_multithreading_enabled(False):
        for name in on_calling_thread:
            print(f"{name + ', one thread':44s} {issue_time_us(cases[name], CALLS):8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
