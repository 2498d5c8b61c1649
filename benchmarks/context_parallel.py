"""Context parallelism on several GPUs vs one: `flexmask.distributed.attention` over W GPUs
(NCCL) against `flexmask.attention` on one GPU of the same machine, forward + backward; and
PyTorch's own context parallelism (ring attention over SDPA, `benchmarks.context_parallel_ring`)
on the same shards as a baseline (provider `torch_ring`, causal only).

    python -m benchmarks.context_parallel --nproc 4 --out benchmarks/results/context_parallel.csv
    torchrun --nproc_per_node=2 -m benchmarks.context_parallel ...   (the same, launched by torchrun)
    python -m benchmarks.context_parallel --plot-only cp_w2.csv cp_w4.csv --readme README.md

The run order is `--schedule` ("flexmask:1048576,524288;torch_ring:1048576" runs flexmask on
every mask of --masks at 1M then 512K tokens, then the ring at 1M on the masks of --ring-masks),
so that a run cut short by --budget-s keeps the configurations that matter most.

Per (mask, sequence length): rank 0 times one GPU alone (the other ranks wait), then every rank
times its shard; the W-GPU time is the slowest rank's. The W-GPU results (output and gradients)
are gathered and compared with the one-GPU results (relative error). A torch_ring row times PyTorch's ring on the same shards and compares its
results with flexmask's on the same W GPUs (kept from the flexmask row of that configuration);
its 1-GPU columns are flexmask's, so `speedup_*` has one meaning in every row: flexmask on one
GPU / this provider on W GPUs. The CSV also has the
plan: chunk pairs computed out of (2W)^2, K/V chunks moved (vs an all-gather) and the bytes they
take forward (K, V in the input dtype) and backward (dK, dV in float32). Rows are written as
they are measured, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import shlex
import sys
import tempfile
import time
import traceback

import torch

from benchmarks import context_parallel_ring as ring
from benchmarks import context_parallel_report
from benchmarks.report import error_message

COLUMNS = (
    "date", "gpu", "gpus", "torch", "triton", "command", "provider", "variant", "layout",
    "mask", "seq_len", "batch", "heads", "kv_heads", "head_dim", "dtype", "density",
    "chunk_pairs_computed", "chunk_pairs_total", "ideal_speedup", "kv_chunks_moved", "kv_chunks_all_gather",
    "fwd_bytes_moved", "bwd_bytes_moved", "all_gather_fwd_bytes",
    "reps_1gpu", "reps_multi", "comm_plan_ms", "comm_all_gather_ms",
    "t1_fwd_ms", "t1_bwd_ms", "t1_fwd_bwd_ms", "tw_fwd_ms", "tw_bwd_ms", "tw_fwd_bwd_ms",
    "speedup_fwd", "speedup_bwd", "speedup_fwd_bwd", "tflops_1gpu_fwd_bwd", "tflops_multi_fwd_bwd",
    "multi_time_over_flexmask", "err_against",
    "err_out", "err_dq", "err_dk", "err_dv", "peak_gb_1gpu", "peak_gb_multi", "status",
)
PROVIDERS = ("flexmask", "torch_ring")
LAYOUTS = ("default", "balanced")
CHECK_TOL = 2e-2  # relative error of bf16 results between two exact summation orders
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="262144,524288,1048576")
    p.add_argument("--masks", default="causal_document,causal", help="causal_document, causal (comma-separated)")
    p.add_argument("--providers", default="flexmask,torch_ring",
                   help="flexmask, torch_ring (comma-separated); used when --schedule is not given")
    p.add_argument("--schedule", default=None,
                   help="run order, 'provider:S,S;provider:S;...' (default: each provider of --providers "
                        "over --seq-lens)")
    p.add_argument("--ring-masks", default="causal", help="masks of the torch_ring rows (PyTorch's ring: causal only)")
    p.add_argument("--ring-backend", default="flash", choices=ring.BACKENDS, help="SDPA backend of torch_ring")
    p.add_argument("--ring-rotate", default="allgather", choices=ring.ROTATE_METHODS, help="torch_ring's K/V rotation")
    p.add_argument("--ring-gqa", default="native", choices=ring.GQA_MODES,
                   help="torch_ring with Hkv < Hq: enable_gqa (native; on failure the row retries with repeat) "
                        "or K/V repeated to Hq heads")
    p.add_argument("--layout", default="default", choices=LAYOUTS,
                   help="flexmask's chunks per rank: default (chunks r and 2W-1-r) or balanced "
                        "(fmd.balanced_layout: paired by the mask's work per chunk)")
    p.add_argument("--nproc", type=int, default=2, help="GPUs (processes) when not launched by torchrun")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--doc-min", type=int, default=2048)
    p.add_argument("--doc-max", type=int, default=65536)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions at most (after one warm-up)")
    p.add_argument("--target-s", type=float, default=40.0,
                   help="fewer repetitions where one takes long; none after the warm-up past this")
    p.add_argument("--budget-s", type=float, default=None, help="skip the remaining configs after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/context_parallel.csv")
    p.add_argument("--png", default=None, help="default: the CSV path with .png")
    p.add_argument("--plot-only", nargs="+", default=None, metavar="CSV",
                   help="only write the PNG and the markdown table of existing CSVs (e.g. a 2-GPU and a 4-GPU run)")
    p.add_argument("--table", default=None, help="markdown table (default: the first CSV path with .md)")
    p.add_argument("--readme", default=None, metavar="PATH",
                   help="also write the table into PATH between <!-- context-parallel:start --> and "
                        "<!-- context-parallel:end -->")
    p.add_argument("--cpu", action="store_true",
                   help="smoke test of this script: gloo, kernels in the Triton interpreter, tiny shapes")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


# --- masks and inputs -----------------------------------------------------------------------


def document_lengths(seq_len: int, lo: int, hi: int, seed: int) -> list[int]:
    """Random document lengths in [lo, hi] summing to seq_len (the last one takes the rest)."""
    gen = torch.Generator().manual_seed(seed)
    out, left = [], seq_len
    while left > 0:
        n = int(torch.randint(lo, hi + 1, (), generator=gen))
        if left - n < lo:
            n = left
        out.append(n)
        left -= n
    return out


def build_mask(name: str, seq_len: int, args):
    from flexmask import masks

    if name == "causal":
        return masks.causal()
    if name == "causal_document":
        return masks.document(document_lengths(seq_len, args.doc_min, args.doc_max, args.seed + seq_len), causal=True)
    raise ValueError(f"unknown mask {name!r}; expected causal or causal_document")


def global_inputs(seq_len: int, args, device):
    """q, k, v, do of the whole sequence, the same on every rank (a seeded generator)."""
    gen = torch.Generator(device).manual_seed(args.seed)
    dtype = DTYPES[args.dtype]

    def rand(h):
        return torch.randn(args.batch, h, seq_len, args.head_dim, generator=gen, device=device, dtype=dtype)

    return rand(args.heads), rand(args.kv_heads), rand(args.kv_heads), rand(args.heads)


# --- timing ---------------------------------------------------------------------------------


class _Clock:
    """CUDA events on a GPU; the host clock in the CPU smoke mode."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self) -> None:
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def elapsed_ms(self, i: int, j: int) -> float:
        if self.cuda:
            return self.marks[i].elapsed_time(self.marks[j])
        return (self.marks[j] - self.marks[i]) * 1e3


def fwd_bwd_once(attn, q, k, v, do):
    """(fwd ms, bwd ms, out, grads) of one forward + backward."""
    clock = _Clock(q.device)
    clock.mark()
    out = attn(q, k, v)
    clock.mark()
    grads = torch.autograd.grad(out, (q, k, v), do)
    clock.mark()
    if clock.cuda:
        torch.cuda.synchronize()
    return clock.elapsed_ms(0, 1), clock.elapsed_ms(1, 2), out.detach(), grads


def timed(attn, q, k, v, do, args, agree=None):
    """One warm-up, then up to args.reps timed runs (fewer when one run is long). Returns the
    medians (fwd, bwd, total ms), the repetitions and the warm-up's results. `agree` turns a
    local number into the same number on every rank (max), so that every rank runs as often."""
    agree = agree or (lambda x: x)
    fwd, bwd, out, grads = fwd_bwd_once(attn, q, k, v, do)
    warm = agree(fwd + bwd)
    # a run longer than target_s is timed once, by its warm-up (reps = 0): compiling and first
    # allocations cost well under 1% of such a run, and the GPU budget of a job is minutes
    reps = int(max(0, min(args.reps, args.target_s * 1e3 // max(warm, 1e-3))))
    runs = [] if reps else [(agree(fwd), agree(bwd), warm)]
    for _ in range(reps):
        f, b, _, g = fwd_bwd_once(attn, q, k, v, do)
        del g
        runs.append((agree(f), agree(b), agree(f + b)))
    med = [sorted(col)[len(col) // 2] for col in zip(*runs)]
    return med, reps, out, grads


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def empty_cache(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_layout(name: str, mask, seq_len: int, world: int):
    """The fmd layout of --layout: None (the default) or the mask's balanced layout."""
    from flexmask import distributed as fmd

    if name not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {name!r}")
    return fmd.balanced_layout(mask, seq_len, world) if name == "balanced" else None


def ideal_speedup(intervals: torch.Tensor, seq_len: int, world: int, layout=None) -> float:
    """Attending pairs in all / in the busiest rank's rows: the speedup a perfect kernel would
    get from `layout` (None: the default load-balanced layout; W for causal, less where
    documents fall unevenly)."""
    from flexmask.distributed import Layout

    layout = layout or Layout.default(world)
    c = seq_len // (2 * world)
    iv = intervals.to(torch.int64)

    def attending(a: int, b: int) -> float:  # pairs with a query row in [a, b), over all columns
        masked = sum((torch.minimum(iv[..., e], torch.tensor(b)) - torch.maximum(iv[..., s], torch.tensor(a))).clamp_min(0)
                     for s, e in ((0, 1), (2, 3)))
        return float(((b - a) - masked).double().sum())

    per_rank = [sum(attending(ch * c, (ch + 1) * c) for ch in layout.rank_chunks(r)) for r in range(world)]
    return sum(per_rank) / max(max(per_rank), 1.0)


def rel_err_parts(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(||a - b||^2, ||b||^2), one head at a time (a float32 copy of a 1M-token tensor is 8 GB)."""
    num = den = 0.0
    for i in range(a.shape[1]):
        x, y = a[:, i].float(), b[:, i].float()
        num += float((x - y).square().sum())
        den += float(y.square().sum())
    return num, den


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    num, den = rel_err_parts(a, b)
    return (num / max(den, 1e-30)) ** 0.5


# --- one configuration ------------------------------------------------------------------


def schedule(args) -> list[tuple[str, str, int]]:
    """(provider, mask, seq_len) in run order, from --schedule (or every provider over --seq-lens)."""
    spec = args.schedule or ";".join(f"{p}:{args.seq_lens}" for p in args.providers.split(","))
    jobs = []
    for part in spec.split(";"):
        provider, sep, lens = part.partition(":")
        if provider not in PROVIDERS or not sep:
            raise ValueError(f"--schedule parts must be 'provider:S,S' with provider in {PROVIDERS}, got {part!r}")
        masks = (args.masks if provider == "flexmask" else args.ring_masks).split(",")
        jobs += [(provider, m, int(s)) for s in lens.split(",") for m in masks]
    return jobs


def run_config(mask_name: str, seq_len: int, args, env: dict, cpu_group, rank: int, world: int,
               keep: dict | None = None) -> dict:
    from flexmask import distributed as fmd
    from benchmarks import flops

    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if not args.cpu else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    row = dict(env, provider="flexmask", layout=args.layout, mask=mask_name, seq_len=seq_len, batch=args.batch,
               heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, gpus=world,
               err_against="flexmask 1 GPU", multi_time_over_flexmask=1.0)
    mask = build_mask(mask_name, seq_len, args)
    layout = make_layout(args.layout, mask, seq_len, world)
    plan = fmd.context_plan(mask, seq_len, world, device, layout=layout)
    moved = plan.bytes_moved(args.batch, args.kv_heads, args.head_dim, dtype)
    intervals = mask.intervals(seq_len, seq_len, device)
    pairs = flops.attending_pairs(intervals, seq_len, args.batch, args.heads)
    work = flops.attention_flops(pairs, args.head_dim)["fwd_bwd"]
    row.update(density=flops.density(pairs, args.batch, args.heads, seq_len, seq_len),
               chunk_pairs_computed=int(plan.pairs.sum()), chunk_pairs_total=plan.pairs.numel(),
               ideal_speedup=ideal_speedup(intervals.cpu(), seq_len, world, layout),
               kv_chunks_moved=moved["kv_chunks_moved"], kv_chunks_all_gather=moved["kv_chunks_all_gather"],
               fwd_bytes_moved=moved["forward_bytes"], bwd_bytes_moved=moved["backward_bytes"],
               all_gather_fwd_bytes=moved["all_gather_forward_bytes"])

    agree = agreement(cpu_group)

    # one GPU: rank 0 alone, the others wait
    status, reference = [], None
    if rank == 0:
        try:
            reference = one_gpu(row, mask, seq_len, args, work, device)
        except Exception as err:  # an OOM here still lets the multi-GPU part run
            status.append(f"1gpu {error_message(err, 120)}")
            log(traceback.format_exc())
        empty_cache(device)
    dist.barrier(group=cpu_group)

    try:
        multi_gpu(row, mask, seq_len, args, reference, agree, work, device, rank, world, keep, layout)
    except Exception as err:  # e.g. out of memory on every rank: record it, go on with the next config
        status.append(f"{world}gpu {error_message(err, 120)}")
        log(traceback.format_exc())
    del reference
    empty_cache(device)
    if row.get("t1_fwd_bwd_ms") and row.get("tw_fwd_bwd_ms"):
        for d in ("fwd", "bwd", "fwd_bwd"):
            row[f"speedup_{d}"] = row[f"t1_{d}_ms"] / row[f"tw_{d}_ms"]
    errs = [row.get(n) for n in ("err_out", "err_dq", "err_dk", "err_dv") if row.get(n) is not None]
    if errs and max(errs) > CHECK_TOL:
        status.append(f"MISMATCH vs 1 GPU (max rel err {max(errs):.2e} > {CHECK_TOL})")
    row["status"] = "; ".join(status) or "ok"
    if rank == 0:
        log(f"{mask_name} S={seq_len}: {world} GPUs {row.get('tw_fwd_bwd_ms', float('nan')):.1f} ms, speedup "
            f"{row.get('speedup_fwd_bwd', float('nan')):.2f}x ({args.layout} layout's balance allows {row['ideal_speedup']:.2f}x), "
            f"K/V chunks moved {row['kv_chunks_moved']}/{row['kv_chunks_all_gather']}, {row['status']}")
    return row


_COMPILED: set = set()


def compile_kernels(args, device) -> None:
    """Compile the kernels before the first timed run of the process, on a short causal sequence
    (the masks measured here take the same kernels): a run longer than --target-s is timed by its
    warm-up alone, and on a process's first configuration that warm-up included compiling (7 s of
    a 36 s 1M-token run on an H200: context_parallel.csv, 4 GPUs against 2)."""
    import flexmask
    from flexmask import masks

    if device.type != "cuda" or str(device) in _COMPILED:  # the interpreter compiles nothing
        return
    q, k, v, do = global_inputs(4096, args, device)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    flexmask.attention(q, k, v, masks.causal()).backward(do)
    torch.cuda.synchronize()
    _COMPILED.add(str(device))


def one_gpu(row, mask, seq_len, args, work, device):
    """Times flexmask.attention on the whole sequence; returns its (out, dq, dk, dv)."""
    import flexmask
    from benchmarks import flops

    compile_kernels(args, device)
    reset_peak(device)
    q, k, v, do = global_inputs(seq_len, args, device)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    log(f"{row['mask']} S={seq_len}: 1 GPU ...")
    (f1, b1, t1), reps1, out, grads = timed(lambda a, b, c: flexmask.attention(a, b, c, mask), q, k, v, do, args)
    row.update(t1_fwd_ms=f1, t1_bwd_ms=b1, t1_fwd_bwd_ms=t1, reps_1gpu=reps1, tflops_1gpu_fwd_bwd=flops.tflops(work, t1),
               peak_gb_1gpu=peak_gb(device))
    log(f"{row['mask']} S={seq_len}: 1 GPU {t1:.1f} ms (fwd {f1:.1f}, bwd {b1:.1f}, {reps1} timed runs)")
    return (out, *grads)


def agreement(cpu_group, op=None):
    """x -> the same number on every rank: the max over the ranks (or `op`), on the CPU group."""
    import torch.distributed as dist

    def agree(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=op or dist.ReduceOp.MAX, group=cpu_group)
        return float(t)

    return agree


def multi_gpu(row, mask, seq_len, args, reference, agree, work, device, rank, world, keep=None, layout=None) -> None:
    """Times fmd.attention on every rank's shard (cut by `layout`, None: the default) and
    compares the gathered results with the one-GPU ones (rank 0). With `keep` (a dict), this
    rank's results (out, dq, dk, dv) and the layout are kept there on the CPU, for the
    torch_ring row of the same configuration."""
    from flexmask import distributed as fmd
    from benchmarks import flops

    reset_peak(device)
    q, k, v, do = global_inputs(seq_len, args, device)
    ql, kl, vl, dol = (fmd.shard(t, layout=layout).contiguous() for t in (q, k, v, do))
    del q, k, v, do
    empty_cache(device)
    ql, kl, vl = (t.requires_grad_(True) for t in (ql, kl, vl))
    if rank == 0:
        log(f"{row['mask']} S={seq_len}: {world} GPUs ...")
    (fw, bw, tw), repsw, out, grads = timed(lambda a, b, c: fmd.attention(a, b, c, mask, layout=layout), ql, kl, vl,
                                            dol, args, agree)
    row.update(tw_fwd_ms=fw, tw_bwd_ms=bw, tw_fwd_bwd_ms=tw, reps_multi=repsw, tflops_multi_fwd_bwd=flops.tflops(work, tw),
               peak_gb_multi=agree(peak_gb(device)))
    row.update(comm_times(mask, kl, vl, agree, layout=layout))
    del ql, kl, vl, dol
    if keep is not None:
        keep["results"] = [t.cpu() for t in (out, *grads)]
        keep["layout"] = fmd.context_plan(None, seq_len, world, layout=layout).layout
    # the W-GPU results against the one-GPU ones, gathered one tensor at a time
    for i, (name, local) in enumerate(zip(("err_out", "err_dq", "err_dk", "err_dv"), (out, *grads))):
        full = fmd.unshard(local, layout=layout)
        if reference is not None:
            row[name] = rel_err(full, reference[i])
        del full


def run_ring_config(mask_name: str, seq_len: int, args, env: dict, cpu_group, world: int, rank: int,
                    meshes: dict, kept: dict | None) -> dict:
    """A torch_ring row: PyTorch's ring attention over SDPA on the shards of every rank, timed
    like flexmask's, its results compared with flexmask's on the same GPUs (`kept`: that
    configuration's flexmask row and this rank's results, when it ran before)."""
    import torch.distributed as dist
    from benchmarks import flops

    device = torch.device("cuda", torch.cuda.current_device()) if not args.cpu else torch.device("cpu")
    row = dict(env, provider="torch_ring", layout="default", mask=mask_name, seq_len=seq_len, batch=args.batch, heads=args.heads,
               kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, gpus=world,
               variant=ring.variant_name(args.ring_backend, args.ring_rotate, args.ring_gqa, args.heads, args.kv_heads))
    if mask_name != "causal":
        row["status"] = "skipped: PyTorch's ring attention over SDPA takes is_causal=True only, not this mask"
        return row
    mask = build_mask(mask_name, seq_len, args)
    intervals = mask.intervals(seq_len, seq_len, device)
    pairs = flops.attending_pairs(intervals, seq_len, args.batch, args.heads)
    work = flops.attention_flops(pairs, args.head_dim)["fwd_bwd"]
    row.update(density=flops.density(pairs, args.batch, args.heads, seq_len, seq_len),
               ideal_speedup=ideal_speedup(intervals.cpu(), seq_len, world))
    ours = (kept or {}).get("row", {})
    for d in ("fwd", "bwd", "fwd_bwd"):  # flexmask on one GPU: the denominator of every speedup
        row[f"t1_{d}_ms"] = ours.get(f"t1_{d}_ms")
    row["reps_1gpu"] = ours.get("reps_1gpu")

    agree, total = agreement(cpu_group), agreement(cpu_group, op=dist.ReduceOp.SUM)
    modes = [args.ring_gqa] + (["repeat"] if args.ring_gqa == "native" and args.heads != args.kv_heads else [])
    failures = []
    for gqa in modes:
        row["variant"] = ring.variant_name(args.ring_backend, args.ring_rotate, gqa, args.heads, args.kv_heads)
        try:
            if "mesh" not in meshes:
                meshes["mesh"] = ring.device_mesh(device, world)
            ring_multi_gpu(row, seq_len, args, gqa, meshes["mesh"], kept, agree, total, work, device, rank, world)
            break
        except Exception as err:  # recorded in the row (with the variant tried); the next one runs
            failures.append(f"{row['variant']}: {error_message(err)}")
            if rank == 0:
                log(traceback.format_exc())
            for n in ("tw_fwd_ms", "tw_bwd_ms", "tw_fwd_bwd_ms"):
                row.pop(n, None)
            empty_cache(device)
    measured = row.get("tw_fwd_bwd_ms") is not None
    if measured and row.get("t1_fwd_bwd_ms"):
        for d in ("fwd", "bwd", "fwd_bwd"):
            row[f"speedup_{d}"] = row[f"t1_{d}_ms"] / row[f"tw_{d}_ms"]
    if measured and ours.get("tw_fwd_bwd_ms"):
        row["multi_time_over_flexmask"] = row["tw_fwd_bwd_ms"] / ours["tw_fwd_bwd_ms"]
    status = ([] if measured else ["failed"]) + failures
    errs = [row.get(n) for n in ("err_out", "err_dq", "err_dk", "err_dv") if row.get(n) is not None]
    if errs and max(errs) > CHECK_TOL:
        status.append(f"MISMATCH vs flexmask (max rel err {max(errs):.2e} > {CHECK_TOL})")
    elif measured and not errs:
        status.append("not checked (no flexmask result of this configuration)")
    row["status"] = "; ".join(status) or "ok"
    if rank == 0:
        log(f"torch_ring {mask_name} S={seq_len}: {world} GPUs {row.get('tw_fwd_bwd_ms') or float('nan'):.1f} ms, "
            f"{row.get('multi_time_over_flexmask') or float('nan'):.2f}x flexmask's time, {row['status']}")
    return row


def ring_multi_gpu(row, seq_len, args, gqa, mesh, kept, agree, total, work, device, rank, world) -> None:
    """Times the ring on every rank's shard; `total` sums a number over the ranks."""
    from flexmask import distributed as fmd
    from benchmarks import flops

    reset_peak(device)
    q, k, v, do = global_inputs(seq_len, args, device)
    ql, kl, vl, dol = (fmd.shard(t).contiguous() for t in (q, k, v, do))
    del q, k, v, do
    empty_cache(device)
    ql, kl, vl = (t.requires_grad_(True) for t in (ql, kl, vl))
    if rank == 0:
        log(f"torch_ring {row['mask']} S={seq_len}: {world} GPUs, {row['variant']} ...")
    with ring.ring_context(mesh, seq_len, args.ring_backend, args.ring_rotate):
        (fw, bw, tw), reps, out, grads = timed(ring.ring_attention(gqa), ql, kl, vl, dol, args, agree)
    row.update(tw_fwd_ms=fw, tw_bwd_ms=bw, tw_fwd_bwd_ms=tw, reps_multi=reps, tflops_multi_fwd_bwd=flops.tflops(work, tw),
               peak_gb_multi=agree(peak_gb(device)))
    moved = ring.ring_bytes_moved(seq_len, world, args.batch, args.heads, args.kv_heads, args.head_dim,
                                  DTYPES[args.dtype], gqa)
    all_gather = fmd.context_plan(None, seq_len, world).bytes_moved(args.batch, args.kv_heads, args.head_dim,
                                                                    DTYPES[args.dtype])
    row.update(kv_chunks_moved=moved["kv_chunks_moved"], kv_chunks_all_gather=moved["kv_chunks_all_gather"],
               fwd_bytes_moved=moved["forward_bytes"], all_gather_fwd_bytes=all_gather["all_gather_forward_bytes"])
    del ql, kl, vl, dol
    if kept is None or "results" not in kept or kept["layout"] != fmd.Layout.default(world):
        return  # the ring's shards are those of the default layout
    # this rank's shards against flexmask's on the same GPUs; sums over the ranks
    row["err_against"] = f"flexmask on the same {world} GPUs"
    for name, got, want in zip(("err_out", "err_dq", "err_dk", "err_dv"), (out, *grads), kept["results"]):
        num, den = rel_err_parts(got, want.to(got.device))
        row[name] = (total(num) / max(total(den), 1e-30)) ** 0.5


def comm_times(mask, k, v, agree, reps: int = 3, layout=None) -> dict:
    """The forward's K/V traffic alone (no compute to hide behind), slowest rank, median of
    `reps`: the plan's point-to-point exchange, and an all-gather of K and V for comparison."""
    import torch.distributed as dist
    from flexmask.distributed import exchange, plan

    world, rank = dist.get_world_size(), dist.get_rank()
    rp = plan.rank_plan(mask, k.shape[2] * world, world, rank, k.device, None,
                        [0, 0, 0, 0, 0], layout)  # the plan attention() built and cached (no new check)

    def plan_exchange():
        received, works = exchange.post_kv_exchange(k, v, rp, None)
        exchange.wait(works)

    def all_gather():
        for t in (k, v):
            dist.all_gather([torch.empty_like(t) for _ in range(world)], t)

    out = {}
    for name, fn in (("comm_plan_ms", plan_exchange), ("comm_all_gather_ms", all_gather)):
        runs = []
        for _ in range(reps + 1):  # the first one warms the communicators up
            agree(0.0)  # a barrier on the CPU group
            clock = _Clock(k.device)
            clock.mark()
            fn()
            clock.mark()
            if clock.cuda:
                torch.cuda.synchronize()
            runs.append(agree(clock.elapsed_ms(0, 1)))
        out[name] = sorted(runs[1:])[reps // 2]
    return out


# --- processes ------------------------------------------------------------------------------


def environment(world: int, argv) -> dict:
    import triton

    cmd = "python -m benchmarks.context_parallel " + shlex.join(sys.argv[1:] if argv is None else argv)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (TRITON_INTERPRET=1)", "gpus": world, "torch": torch.__version__,
            "triton": triton.__version__, "command": cmd.strip()}


def write_row(path: str, row: dict) -> None:
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            w.writeheader()
        w.writerow({c: (f"{row[c]:.6g}" if isinstance(row.get(c), float) else row.get(c, "")) for c in COLUMNS})


def worker(rank: int, world: int, init: str, args, argv) -> None:
    import torch.distributed as dist

    if not args.cpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(minutes=15)
    dist.init_process_group("gloo" if args.cpu else "nccl", init_method=init, rank=rank, world_size=world, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)  # barriers and timings, off the GPUs
    env = environment(world, argv)
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        log(f"{world} x {env['gpu']}, torch {env['torch']}, triton {env['triton']}; CSV -> {args.out}")
    jobs = schedule(args)
    ring_wanted = {(m, n) for p, m, n in jobs if p == "torch_ring"}
    kept: dict = {}  # (mask, S) -> flexmask's row and this rank's results, for the torch_ring row
    meshes: dict = {}
    start = time.time()
    try:
        for provider, mask_name, seq_len in jobs:
            # rank 0's clock decides for every rank
            over = torch.tensor([float(args.budget_s is not None and time.time() - start > args.budget_s)])
            dist.broadcast(over, src=0, group=cpu_group)
            if over.item():
                row = dict(env, provider=provider, mask=mask_name, seq_len=seq_len, gpus=world,
                           status=f"skipped: time budget {args.budget_s:.0f} s")
            elif provider == "flexmask":
                keep = {} if (mask_name, seq_len) in ring_wanted else None
                row = run_config(mask_name, seq_len, args, env, cpu_group, rank, world, keep)
                if keep is not None:
                    kept[(mask_name, seq_len)] = dict(keep, row=row)
            else:
                row = run_ring_config(mask_name, seq_len, args, env, cpu_group, world, rank, meshes,
                                      kept.pop((mask_name, seq_len), None))
            if rank == 0:
                write_row(args.out, row)
                log(f"row written: {provider} {mask_name} S={seq_len} ({row['status']})")
    finally:
        dist.destroy_process_group()
    if rank == 0:
        log(f"done in {time.time() - start:.0f} s")
        context_parallel_report.report([args.out], args.png, args.table, args.readme, log)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        context_parallel_report.report(args.plot_only, args.png, args.table, args.readme, log)
        return 0
    schedule(args)  # a bad --schedule fails here, before any process starts
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before flexmask (and Triton) are first imported
        args.dtype = "fp32"
    elif not torch.cuda.is_available():
        print("benchmarks.context_parallel: no CUDA device; nothing to measure", flush=True)
        return 1
    if "RANK" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args, argv)
        return 0
    if not args.cpu and torch.cuda.device_count() < args.nproc:
        print(f"benchmarks.context_parallel: needs {args.nproc} CUDA devices, found {torch.cuda.device_count()}", flush=True)
        return 1
    import torch.multiprocessing as mp

    init = f"file://{tempfile.mkdtemp(prefix='cp_bench_')}/init"
    mp.spawn(worker, args=(args.nproc, init, args, argv), nprocs=args.nproc, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
