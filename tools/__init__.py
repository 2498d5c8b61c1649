"""What a maintainer runs: offline compiles and SASS, profiles, tuning sweeps, probes.

Each module runs as ``python -m tools.<name> --help`` from the repository root; none does work
at import. They reuse the benchmark suite's support modules (``benchmarks.report``,
``benchmarks.speed_check``, ...). What a user runs to compare flexmask with its peers lives in
``benchmarks/``; what these tools found is told in docs/performance.md. GPU job scripts are in
tools/gpu_jobs/.

Offline (no GPU: Triton's bundled ptxas for sm_90)
  offline_compile           compile a kernel for sm_90: registers, spills, shared memory
  offline_launches          every kernel one attention call launches, compiled and timed
  compile_variants_offline  the mask compiler's kernels as build_tables_device launches them
  decode_offline_compile    the split-KV decode kernels
  forward_sass              the Hopper forward's SASS: what PARTIAL-tile masking adds
  work_balance              how evenly the Hopper backward's work items spread, and (--orders) the
                            walk footprint of each work order (host only)
  host_overhead             host time per call of the Python layers, kernels stubbed out

Tables from committed CSVs
  forward_table             docs/hopper.md's forward table, from forward_variants.csv
  speed_table               markdown table of speed_check CSVs
  targets                   which speed targets a sweep CSV meets

GPU: variants and tuning
  forward_variants          Hopper / portable forward / SDPA cuDNN side by side
  decode_variants           launch variants of the split-KV decode (docs/decoding.md's table)
  decode_splits             programs per SM of the split-KV decode
  tune_configs, tune_variants, tune_fused_bwd, tune_decode   launch configurations
  tile_size_sweep           smaller tiles for sparse masks?
  backward_order            the Hopper backward's work order
  backward_gqa              the Hopper backward under GQA: split groups, orders, one call for ncu
  backward_q_rows           the Hopper backward at D = 64 with 64 and 128 query rows a step
  rounding_parity           bf16 rounding on the CPU interpreter against a GPU

GPU: profiles and probes
  profile_forward, profile_backward, decode_profile_target   one call for ncu
  compile_breakdown, compile_profile, compile_fresh_probe    where a mask compile's time goes
  decode_host_probe, host_bound_probe                        host time of short calls
  launch_cost               host time of each kernel launch of a training step
  backward_thread_cost      a step's host time with autograd's device thread and without
  mask_mod_compile_time     from_mask_mod's tables, timed (CPU or GPU)
  race_probe                repeats the Hopper kernels under load: bitwise equal?
  document_cost_probe, eviction_probe                        single-question probes
"""
