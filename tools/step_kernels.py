"""GPU time of each kernel of a short training step (fwd+bwd, causal, bf16, D = 128, B x S = 16K),
flexmask with a compiled mask against SDPA's cuDNN backend (GPU only): torch.profiler's device
time per kernel over 20 steps after a warm-up, beside the step's wall clock (per_call.wall_ms).
Where per_call's fwd_bwd rows are over cuDNN, this says whether the kernels or the host are.

    PYTHONPATH=$PWD python -m tools.step_kernels [--shapes 512:16/16,512:32/8,1024:16/16]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.cuda_guard import require_cuda
from benchmarks.per_call import TOKENS, _step, training_inputs, training_providers, wall_ms


def kernel_times(fn, steps: int = 20) -> dict[str, tuple[float, float]]:
    """kernel name -> (device us a step, calls a step) of fn(), profiled over `steps` calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0)
        if us > 0:
            times[event.key] = (us / steps, event.count / steps)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="512:16/16,512:32/8,1024:16/16,1024:32/8,2048:16/16",
                        help="comma-separated S:Hq/Hkv")
    args = parser.parse_args(argv)
    require_cuda("tools.step_kernels")
    d = 128
    for shape in args.shapes.split(","):
        seq, heads = shape.split(":")
        seq, (hq, hkv) = int(seq), map(int, heads.split("/"))
        batch = max(1, TOKENS // seq)
        q, k, v, do = training_inputs(batch, hq, hkv, seq, d)
        providers = training_providers(seq, batch, hq, hkv, d, False)
        for name in ("flexmask", "sdpa_cudnn"):
            step = _step(providers[name], q, k, v, do, True)
            wall = wall_ms(step, 50) * 1e3
            times = kernel_times(step)
            print(f"S={seq} B={batch} {hq}/{hkv} {name}: wall {wall:.1f} us, GPU {sum(t for t, _ in times.values()):.1f} "
                  "us a step", flush=True)
            for kernel, (us, calls) in sorted(times.items(), key=lambda item: -item[1][0])[:8]:
                print(f"    {us:8.1f} us  x{calls:.0f}  {kernel[:110]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
