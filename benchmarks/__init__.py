"""flexmask benchmark suite: FlashMask mask families against FlexAttention and SDPA.

Run ``python -m benchmarks.run --help``. Modules, one job each:

  families    the mask families, parameterised by the sequence length
  providers   the attention implementations under test (flexmask, FlexAttention, SDPA)
  flex_masks  hand-written FlexAttention mask_mods per family (the optional flex_native provider)
  timing      do_bench wrappers (forward, backward, forward+backward), build timers, peak memory
  flops       FLOPs on unmasked elements and TFLOP/s
  checks      relative errors and tolerances of the correctness cross-checks
  gpu         the GPU sweep
  quick       the CPU mode: kernels under TRITON_INTERPRET=1 against the dense reference
  report      CSV rows, environment stamp, the console table
  plots       PNG plots from a results CSV
  readme_table  the README results table, regenerated from a CSV

gpu_sweep.sh runs the full GPU sweep (about 8 minutes on one H100/H200).
"""
