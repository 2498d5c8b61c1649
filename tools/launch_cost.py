"""Host microseconds of each kernel launch of a training step, layer by layer (GPU only): the
whole `FastLaunch` call; below it the direct launch (`launcher._DirectLaunch`: kept TMA
descriptors) or `CompiledKernel.run`; and Triton's C launcher alone, with its arguments built
once. B = 1, S = 512, causal, D = 128, bf16: the per_call benchmark's host-bound shape.

    PYTHONPATH=$PWD python -m tools.launch_cost
"""

from __future__ import annotations

import torch

import flexmask
from benchmarks.per_call import issue_time_us
from flexmask import masks
from flexmask.kernels.common import launcher


LAUNCHES = 2000  # launches per timed loop of one kernel


def _params(fast: launcher.FastLaunch, args: tuple, kwargs: dict) -> tuple:
    """Every kernel parameter in order, as FastLaunch binds them."""
    kwargs = dict(kwargs)
    num_warps = kwargs.pop("num_warps", 4)
    if len(args) < len(fast._names):
        named = {**kwargs, "num_warps": num_warps}
        return args + tuple(named[name] for name in fast._names[len(args):])
    return args


def main() -> int:
    q = torch.randn(1, 16, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn_like(q, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    cm = flexmask.compile_mask(masks.causal(), 512, 512, device="cuda")

    def step():
        flexmask.attention(q, k, v, mask=cm).backward(do)

    for _ in range(5):
        step()
    last, call = {}, launcher.FastLaunch.__call__

    def record(self, grid, *args, **kwargs):
        last[self] = (grid, args, kwargs)
        return call(self, grid, *args, **kwargs)

    launcher.FastLaunch.__call__ = record
    try:
        step()
    finally:
        launcher.FastLaunch.__call__ = call
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}: fwd+bwd step {issue_time_us(step, 300):.1f} us of host time")
    for fast, (grid, args, kwargs) in last.items():
        params = _params(fast, args, kwargs)
        kernel = fast(grid, *args, **kwargs)
        direct = next(d for kept, d in fast._kernels.values() if kept is kernel)
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        stream = torch.cuda.current_stream().cuda_stream
        line = f"{fast.fn.__name__:28s} FastLaunch {issue_time_us(lambda: fast(grid, *args, **kwargs), LAUNCHES):6.1f} us"
        if direct is not None:
            captured, raw = [], direct.raw
            direct.raw = lambda *a: captured.append(a)
            direct(g0, g1, g2, stream, params)
            direct.raw = raw
            line += f"  direct {issue_time_us(lambda: direct(g0, g1, g2, stream, params), LAUNCHES):6.1f}"
            line += f"  C launcher {issue_time_us(lambda: raw(*captured[0]), LAUNCHES):6.1f}"
        else:
            run = kernel.run
            base = (g0, g1, g2, stream, kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                    kernel.packed_metadata, None, None, None)
            line += (f"  run {issue_time_us(lambda: run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *params), LAUNCHES):6.1f}"
                     f"  C launcher {issue_time_us(lambda: run.launch(*base, *params), LAUNCHES):6.1f}")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
