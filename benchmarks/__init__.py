"""flexmask's benchmarks: what a user runs to compare flexmask with its peers.

Each one runs from the repository root as ``python -m benchmarks.<name> --help``; the CSVs and
PNGs land in benchmarks/results/ and the README's tables are generated from them.

  run               the peer sweep: every mask family at 32K tokens, D = 128, against FlexAttention
                    and SDPA (--full: the 81-configuration sweep,
                    8K-128K, D = 128 and 64); without a GPU, the kernels under the Triton
                    interpreter at tiny sizes against the float64 reference
  speed_check       forward and backward TFLOP/s beside FlexAttention, first-call times included
  decode            one decode step against a KV cache: GB/s of K and V, against FlexAttention and SDPA
  compile           the cost of building the mask tables: compile_mask against create_block_mask
  context_parallel  one sequence on W GPUs (flexmask.distributed) against one GPU and against
                    PyTorch's ring attention (context_parallel_ring, context_parallel_report)
  per_call          wall clock per call at short lengths and eager decode steps, host time included,
                    against SDPA and FlexAttention; masks written in the call against compiled ones
  peers             the masks FlashAttention-4 expresses against FA4, FlexAttention's FLASH backend,
                    the Triton FlexAttention and SDPA cuDNN; every family against FlexAttention
  first_call        the first compile_mask, forward and backward in a new process with empty
                    compile caches, against FA4 and compiled FlexAttention

Training parity lives with the training examples (docs/training.md): ``python -m
examples.train_packed_lm parity`` (loss curves against SDPA: train_parity.csv; ``scale``:
train_scale.csv) and ``python -m examples.train_hf_packed`` (a transformers model:
hf_parity.csv), both writing into benchmarks/results/ through examples/train_report.py.

Support modules of the sweep, one job each:

  families      the mask families, parameterised by the sequence length
  providers     the attention implementations under test (flexmask, FlexAttention, SDPA)
  flex_masks    hand-written FlexAttention mask_mods per family (the optional flex_native provider)
  timing        do_bench wrappers (forward, backward, forward+backward), build timers, peak memory
  flops         FLOPs on unmasked elements and TFLOP/s
  checks        relative errors and tolerances of the correctness cross-checks
  gpu           the GPU mode of run
  quick         the CPU mode of run: kernels under TRITON_INTERPRET=1 against the dense reference
  report        CSV rows, environment stamp, the console table
  plots         PNG plots from a results CSV
  readme_table  the results blocks of README.md (summary) and docs/results.md (full), from the CSVs
  cuda_guard    one-line stops for GPU-only scripts on a machine without CUDA

The GPU job scripts (tests, sweep, peers, first call, decode, compile, context parallel) are in tools/gpu_jobs/;
maintainer tools (offline compiles, profiles, tuning, probes) in tools/.
"""
