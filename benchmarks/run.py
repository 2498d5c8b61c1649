"""The peer sweep: ``python -m benchmarks.run [options]``.

GPU summary (the default when CUDA is available; meant to take minutes, not yet timed): every mask
family at 32K tokens, D = 128, bf16, 16 query and 16 key/value heads, against the peers that are
installed (FlexAttention; SDPA's cuDNN and flash backends on full and causal), each one that is
not importable skipped with a one-line note. Writes benchmarks/results/summary.csv and its
summary_*.png plots, and regenerates the README's results-summary block.

GPU full sweep (--full; tools/gpu_jobs/sweep.sh runs it in phases with deadlines, in about 8
minutes): every family at S = 8K, 32K, 128K (B = max(1, 32K / S)), D = 128 and 64, and the
sliding-window density sweep at 32K: 81 configurations, against FlexAttention and SDPA (and
flexmask's deterministic backward). Writes benchmarks/results/gpu.csv and its plots, and
regenerates the results block of docs/results.md.

CPU mode (--quick, or automatic without CUDA): the kernels run under TRITON_INTERPRET=1 at
tiny sizes against the float64 reference for every family; the CSV goes to a temporary
directory (or --out). Every mode exits nonzero when a check fails.

Examples::

    python -m benchmarks.run                                   # the GPU summary (CPU: the quick mode)
    python -m benchmarks.run --full                            # the full GPU sweep
    python -m benchmarks.run --shapes 32K:128 --families causal,document --providers flexmask,flex
    python -m benchmarks.run --quick                           # any machine, ~1 minute
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from .cuda_guard import CPU_ALTERNATIVE, CPU_MAX_SEQLEN

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GPU_PROVIDERS = "flexmask,flexmask_det,flex,sdpa_cudnn,sdpa_flash,sdpa_mask"  # --full
SUMMARY_PROVIDERS = "flexmask,flex,sdpa_cudnn,sdpa_flash"  # the default: flexmask and its peers
SUMMARY_SHAPES = "32K:128"
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


def parse_size(text: str) -> int:
    """'8K' -> 8192, '128k' -> 131072, '200' -> 200."""
    t = text.strip().lower()
    try:
        value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 8192 or 8K, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return value


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'32K:128,8K:64' -> [(32768, 128), (8192, 64)]; 'none' or '' -> []."""
    if text.strip().lower() in ("", "none"):
        return []
    shapes = []
    for item in _list(text):
        seqlen, sep, head_dim = item.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"shapes are SEQLEN:HEAD_DIM, got {item!r}")
        shapes.append((parse_size(seqlen), parse_size(head_dim)))
    return shapes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CPU mode: kernels under TRITON_INTERPRET=1 at tiny sizes vs the reference "
                        "(automatic without CUDA)")
    p.add_argument("--gpu", action="store_true", help="require the GPU mode (an error without CUDA)")
    p.add_argument("--full", action="store_true",
                   help="the full GPU sweep (8K-128K, D = 128 and 64, the density sweep) instead of the "
                        "32K, D = 128 summary; writes gpu.csv and regenerates docs/results.md's block")
    p.add_argument("--families", default="all",
                   help="comma-separated mask families, or 'all' (default); see benchmarks/families.py")
    p.add_argument("--seqlens", help="comma-separated sequence lengths (--full: 8K,32K,128K; quick: 150)")
    p.add_argument("--head-dims", help="comma-separated head dims (--full: 128,64; quick: 32)")
    p.add_argument("--shapes", help=f"ordered SEQLEN:HEAD_DIM list; replaces --seqlens x --head-dims "
                                    f"(default {SUMMARY_SHAPES})")
    p.add_argument("--sweep-shapes",
                   help="SEQLEN:HEAD_DIM list where the sliding-window density sweep runs, or 'none' "
                        "(--full: 32K:128; default and quick: none)")
    p.add_argument("--providers",
                   help=f"comma-separated providers (default {SUMMARY_PROVIDERS}, --full {GPU_PROVIDERS}, "
                        "the peers among them that are not installed left out; also flex_native, "
                        "FlexAttention with hand-written mask_mods); the CPU mode runs flexmask only")
    p.add_argument("--directions", default="fwd,bwd,fwd_bwd", help="comma-separated, of fwd,bwd,fwd_bwd")
    p.add_argument("--tokens", type=parse_size, default=32768, help="tokens per batch: B = max(1, tokens / S)")
    p.add_argument("--batch", type=int, help="fixed batch size (overrides --tokens; quick default 1)")
    p.add_argument("--heads", type=int, help="query heads (default 16; quick: 2)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype (default bf16)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms (default 100)")
    p.add_argument("--build-reps", type=int, default=10, help="timed repetitions of each mask build")
    p.add_argument("--dense-mask-budget-gb", type=float, default=8.0,
                   help="skip SDPA with a dense mask when mask + bias would exceed this (default 8)")
    p.add_argument("--tol", type=float,
                   help="relative-error threshold of the flexmask vs FlexAttention check (default by dtype)")
    p.add_argument("--time-budget", type=float,
                   help="seconds; configurations not started by then are recorded as skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output directory (default benchmarks/results; quick: a temporary directory)")
    p.add_argument("--name", help="CSV base name (default 'summary'; --full: 'gpu'; quick: 'quick')")
    p.add_argument("--append", action="store_true", help="append to an existing CSV instead of replacing it")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--no-readme", action="store_true",
                   help="do not regenerate the README's (or, --full, docs/results.md's) results block, which "
                        "happens only when the CSV written is benchmarks/results/summary.csv (--full: gpu.csv)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _use_interpreter(argv: list[str]) -> None:
    """TRITON_INTERPRET must be set before triton is imported; re-exec if it is too late."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.run", *argv])


def cpu_mode_problem(args, cuda: bool) -> str | None:
    """Why the CPU mode (kernels under the Triton interpreter) cannot do what was asked, in one
    line naming what does run there; None when it can. Asked-for GPU providers are never dropped
    silently, and GPU-scale lengths would keep the interpreter busy for hours."""
    reasons = []
    if args.full:
        reasons.append("--full is the GPU sweep")
    gpu_only = [p for p in _list(args.providers or "") if p != "flexmask"]
    if gpu_only:
        reasons.append(f"--providers {','.join(gpu_only)} run{'s' if len(gpu_only) == 1 else ''} on a GPU only")
    lengths = [s for s, _ in parse_shapes(args.shapes or "none") + parse_shapes(args.sweep_shapes or "none")]
    lengths += [parse_size(x) for x in _list(args.seqlens or "")]
    if lengths and max(lengths) > CPU_MAX_SEQLEN:
        reasons.append(f"sequence length {max(lengths)} is a GPU-scale shape (the CPU runs the kernels in the "
                       f"Triton interpreter, up to {CPU_MAX_SEQLEN} tokens)")
    if not reasons:
        return None
    return (f"{'no CUDA device' if not cuda else '--quick'}: {'; '.join(reasons)}. On the CPU, `{CPU_ALTERNATIVE}` "
            f"checks flexmask's kernels against the float64 reference for every family at 150 tokens")


def peers_installed(names: list[str]) -> list[str]:
    """`names` less the providers that cannot be imported here, each left out with a one-line note."""
    from .providers import registry

    kept = []
    for name in names:
        missing = registry()[name].missing()
        if missing:
            print(f"note: {name} left out: {missing}", file=sys.stderr)
        else:
            kept.append(name)
    return kept


def make_options(args, quick: bool):
    import torch

    from . import families
    from .gpu import Options

    names = families.FAMILIES if args.families.strip() == "all" else _list(args.families)
    unknown = [n for n in names if n not in families.FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; expected some of {', '.join(families.FAMILIES)} (or 'all')")
    from .providers import registry

    known = list(registry())
    chosen = _list(args.providers or (GPU_PROVIDERS if args.full else SUMMARY_PROVIDERS))
    if not chosen or any(p not in known for p in chosen):
        raise SystemExit(f"--providers must be a list of {', '.join(known)}; got {args.providers!r}")
    if not args.providers and not quick:
        chosen = peers_installed(chosen)
    directions = _list(args.directions)
    if not directions or any(d not in ("fwd", "bwd", "fwd_bwd") for d in directions):
        raise SystemExit(f"--directions must be a list of fwd, bwd, fwd_bwd; got {args.directions!r}")
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    elif quick or args.full or args.seqlens or args.head_dims:
        seqlens = [parse_size(x) for x in _list(args.seqlens or ("150" if quick else "8K,32K,128K" if args.full else "32K"))]
        head_dims = [parse_size(x) for x in _list(args.head_dims or ("32" if quick else "128,64" if args.full else "128"))]
        shapes = [(s, d) for d in head_dims for s in seqlens]
    else:
        shapes = parse_shapes(SUMMARY_SHAPES)
    sweep = parse_shapes(args.sweep_shapes if args.sweep_shapes is not None else ("32K:128" if args.full and not quick else "none"))
    return Options(
        shapes=shapes,
        sweep_shapes=sweep,
        families=list(names),
        providers=["flexmask"] if quick else chosen,
        directions=directions,
        tokens=args.tokens,
        batch=args.batch if args.batch is not None else (1 if quick else None),
        heads=args.heads or (2 if quick else 16),
        kv_heads=args.kv_heads,
        dtype=getattr(torch, DTYPES[args.dtype]),
        warmup=args.warmup,
        rep=args.rep,
        build_reps=min(args.build_reps, 3) if quick else args.build_reps,
        dense_budget_gb=args.dense_mask_budget_gb,
        tol=args.tol,
        time_budget_s=args.time_budget,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    start = time.monotonic()
    if args.quick and args.gpu:
        raise SystemExit("--quick and --gpu exclude each other")
    cuda = _cuda_available()
    if args.gpu and not cuda:
        raise SystemExit("--gpu: no CUDA device is available (the CPU mode is --quick)")
    quick = args.quick or not cuda
    if quick:
        problem = cpu_mode_problem(args, cuda)
        if problem:
            raise SystemExit(problem)
        _use_interpreter(argv)
    elif os.environ.get("TRITON_INTERPRET") == "1":
        print("warning: TRITON_INTERPRET=1 is set; GPU timings would be of the interpreter", file=sys.stderr)

    from . import report

    opts = make_options(args, quick)
    out_dir = args.out or (tempfile.mkdtemp(prefix="flexmask-bench-") if quick else RESULTS_DIR)
    default_name = "quick" if quick else "gpu" if args.full else "summary"
    name = args.name or default_name
    csv_path = os.path.join(out_dir, name + ".csv")
    env = report.environment("quick" if quick else "gpu", argv)
    writer = report.CsvWriter(csv_path, append=args.append)
    try:
        if quick:
            from . import quick as mode

            rows, failures = mode.run(opts, env, writer, progress=not args.no_progress)
        else:
            from . import gpu as mode

            rows, failures = mode.run(opts, env, writer, start, progress=not args.no_progress)
    finally:
        writer.close()

    print()
    print(report.format_table(rows))
    print(f"\nresults: {csv_path}")
    if not quick and not args.no_plots:
        from . import plots

        for path in plots.make_plots(report.read_csv(csv_path), out_dir, prefix="" if name == "gpu" else f"{name}_"):
            print(f"plot: {path}")
    if not quick and not args.no_readme and name == default_name and os.path.abspath(out_dir) == RESULTS_DIR:
        from . import readme_table

        if args.full:
            readme_table.regenerate(full_csv=csv_path, only="full")
        else:
            readme_table.regenerate(summary_csv=csv_path, only="summary")
    if failures:
        print(f"FAILED: {failures} flexmask configuration(s) failed their check or did not run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
