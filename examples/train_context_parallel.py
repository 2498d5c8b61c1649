"""Train the small GPT of `examples.gpt_model` on packed documents with context parallelism:
every rank holds the whole model and its shard of each long sequence, attention runs through
`flexmask.distributed.attention` (the document mask over the GLOBAL sequence), and the run's
losses are compared with one process training the same model on the same tokens.

    python -m examples.train_context_parallel --nproc 4 --seq-len 262144 --steps 12        # 4 GPUs
    TRITON_INTERPRET=1 python -m examples.train_context_parallel --tiny --nproc 2          # CPU, gloo

- Data: `examples.packed_data` (the standard library's .py files packed whole into sequences of
  --seq-len bytes, batch 1); every rank builds the same batch and keeps its shard
  (`fmd.shard`: chunks r and 2W-1-r of the 2W chunks), tokens and targets alike.
- Model: `ShardedGPT` runs the GPT's layers on the shard. The rotary tables are those of the
  shard's GLOBAL positions (`fmd.shard` of the full tables), so every query-key distance is the
  one-process distance; each layer's attention is `fmd.attention(q, k, v, masks.document(seqlens))`.
- Weights: DDP over its own process group (a communicator apart from the one fmd's point-to-point
  traffic uses, so DDP's bucketed all-reduces never interleave with it). The loss is the mean
  over all real tokens of the sequence: each rank's share is (its sum of token losses) / (the
  sequence's count), and DDP averages gradients over the W ranks, so each rank backpropagates
  W x its share, and the gradient is exactly the one-process gradient.
- Reference: rank 0 first trains the same model from the same seed on the same batches alone
  (`examples.train_packed_lm.train`, flexmask backend), while the other ranks wait.

Output (--out-dir, else $OUT, else benchmarks/results): train_context_parallel{tag}.csv (one row
per step and mode: loss, step time, tokens/s and tokens/s per GPU, peak memory; then a summary
row with the parity verdict) and .png (both loss curves and their difference against the
tolerance). Tolerance: 1e-4 nats in fp32 (the two runs differ only in summation order); in bf16
`PARITY_FLOOR` (0.01 nats) of `examples.train_packed_lm`, as its parity runs use.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .gpt_model import GPT, ModelConfig, build_model, rope_tables
from .packed_data import IGNORE_INDEX, VOCAB_SIZE, packed_batches
from .train_packed_lm import (
    DTYPES,
    PARITY_FLOOR,
    TINY_MODEL,
    RunConfig,
    StepRecord,
    free_memory,
    make_optimizer,
    peak_memory_gib,
    reset_peak_memory,
    synchronize,
    train,
)
from .train_report import plot_parity, results_dir, run_metadata, write_csv

# 4 layers, d_model 512, 4 query heads / 2 KV heads of D = 128: a 256K-token step fits one GPU
CP_MODEL = ModelConfig(d_model=512, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=1408)
FP32_TOLERANCE = 1e-4


def context_parallel_attention(q, k, v, mask, group):
    from flexmask import distributed as fmd

    return fmd.attention(q, k, v, mask, group)


class ShardedGPT(nn.Module):
    """`gpt`'s forward on this rank's shard of the sequence (tokens (B, S/W) in `fmd.shard`'s
    layout): rotary tables of the shard's global positions, attention over the group."""

    def __init__(self, gpt: GPT, group) -> None:
        super().__init__()
        self.gpt, self.group = gpt, group
        for block in gpt.blocks:
            block.attn.attend = functools.partial(context_parallel_attention, group=group)

    def forward(self, tokens: torch.Tensor, mask) -> torch.Tensor:
        from flexmask import distributed as fmd

        gpt = self.gpt
        seq_len = tokens.shape[1] * dist.get_world_size(self.group)
        cos, sin = rope_tables(seq_len, gpt.cfg.head_dim, gpt.cfg.rope_base, tokens.device)
        cos, sin = fmd.shard(cos, self.group, seq_dim=0), fmd.shard(sin, self.group, seq_dim=0)
        x = gpt.embed(tokens)
        for block in gpt.blocks:
            x = block(x, cos, sin, mask)
        return gpt.lm_head(gpt.norm(x))


def train_context_parallel(cfg: RunConfig, group, dp_group) -> list[StepRecord]:
    """`train`'s loop on W ranks: the same init, batches, optimizer and clipping; the loss
    of a step is the mean over the whole sequence (all ranks)."""
    from flexmask import distributed as fmd
    from flexmask import masks

    world = dist.get_world_size(group)
    reset_peak_memory(cfg.device)
    gpt = build_model(cfg.model, "flexmask", cfg.seed, cfg.device)
    device_ids = [cfg.device.index] if cfg.device.type == "cuda" else None
    model = nn.parallel.DistributedDataParallel(ShardedGPT(gpt, group), device_ids=device_ids, process_group=dp_group)
    optimizer, scheduler = make_optimizer(gpt, cfg)
    batches = packed_batches(cfg.seq_len, cfg.batch_size, cfg.seed)
    amp = DTYPES[cfg.dtype] != torch.float32
    records = []
    for step in range(1, cfg.steps + 1):
        batch = next(batches)
        synchronize(cfg.device)
        start = time.perf_counter()
        inputs, targets = (fmd.shard(t.to(cfg.device), group, seq_dim=1) for t in (batch.inputs, batch.targets))
        mask = masks.document(batch.seqlens)
        lr = scheduler.get_last_lr()[0]
        with torch.autocast(cfg.device.type, dtype=DTYPES[cfg.dtype], enabled=amp):
            logits = model(inputs, mask)
        token_losses = F.cross_entropy(logits.view(-1, VOCAB_SIZE).float(), targets.reshape(-1),
                                       ignore_index=IGNORE_INDEX, reduction="sum")
        share = token_losses / batch.num_real_tokens
        (share * world).backward()  # DDP averages over the W ranks: their sum is the full gradient
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss = share.detach().clone()
        dist.all_reduce(loss, group=group)
        loss = loss.item()
        synchronize(cfg.device)
        records.append(StepRecord(step, loss, lr, time.perf_counter() - start, batch.inputs.numel(),
                                  batch.num_real_tokens, sum(len(r) for r in batch.seqlens),
                                  peak_memory_gib(cfg.device)))
        if dist.get_rank(group) == 0:
            print(step_line(f"{world} ranks", records[-1], world), flush=True)
    return records


def step_line(mode: str, r: StepRecord, gpus: int) -> str:
    return (f"[{mode}] step {r.step:3d}  loss {r.loss:.5f}  {r.seconds:.3f} s  {r.tokens_per_s / gpus:,.0f} tokens/s "
            f"per {'GPU' if gpus and torch.cuda.is_available() else 'rank'}  peak mem {r.peak_mem_gib:.2f} GiB")


def step_rows(mode: str, gpus: int, records: list[StepRecord], meta: dict) -> list[dict]:
    return [{"mode": mode, "gpus": gpus, "step": r.step, "loss": r.loss, "lr": r.lr, "step_time_s": r.seconds,
             "tokens": r.tokens, "real_tokens": r.real_tokens, "docs": r.docs, "tokens_per_s": r.tokens_per_s,
             "tokens_per_s_per_gpu": r.tokens_per_s / gpus, "peak_mem_gib": r.peak_mem_gib, **meta}
            for r in records]


def steady(records: list[StepRecord], gpus: int) -> float:
    """Median tokens/s per GPU after the first step (kernel compilation)."""
    timed = records[1:] or records
    return statistics.median(r.tokens_per_s / gpus for r in timed)


def parity(single: list[StepRecord], multi: list[StepRecord], dtype: str) -> dict:
    diff = max(abs(a.loss - b.loss) for a, b in zip(single, multi))
    tolerance = FP32_TOLERANCE if dtype == "fp32" else PARITY_FLOOR
    return {"max_abs_diff": diff, "tolerance": tolerance, "verdict": "PASS" if diff <= tolerance else "FAIL"}


# -- processes ----------------------------------------------------------------------------------------
def worker(rank: int, world: int, init: str, cfg: RunConfig, args, argv: list[str]) -> None:
    if cfg.device.type == "cpu":
        # a forked child must not enter the parent's OpenMP pool (it can hang); tiny shapes need none
        torch.set_num_threads(1)
    if cfg.device.type == "cuda":
        torch.cuda.set_device(rank)
        cfg = dataclasses.replace(cfg, device=torch.device("cuda", rank))
    backend = "nccl" if cfg.device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=15)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=timeout)
    try:
        dp_group = dist.new_group(backend=backend, timeout=timeout)  # DDP's own communicator
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)  # waits off the GPUs
        meta = {**config(cfg), **run_metadata(argv, cfg.device),
                "command": "python -m examples.train_context_parallel " + " ".join(argv)}
        out = results_dir(args.out_dir)
        csv_path, png_path = out / f"train_context_parallel{args.tag}.csv", out / f"train_context_parallel{args.tag}.png"
        single = []
        if rank == 0:
            single = train(cfg, "flexmask", desc="1 process", leave=False)
            for r in single:
                print(step_line("1 process", r, 1), flush=True)
            write_csv(csv_path, step_rows("single", 1, single, meta))  # kept if the W-rank run fails
            free_memory(cfg.device)
        dist.barrier(group=cpu_group)
        multi = train_context_parallel(cfg, None, dp_group)
        if rank == 0:
            verdict = parity(single, multi, cfg.dtype)
            summary = {"mode": "summary", "gpus": world, **verdict,
                       "tokens_per_s_per_gpu_single": steady(single, 1),
                       "tokens_per_s_per_gpu_multi": steady(multi, world), **meta}
            write_csv(csv_path, step_rows("single", 1, single, meta) + step_rows("context_parallel", world, multi, meta)
                      + [summary])
            title = (f"{meta['device']} x {world} | torch {meta['torch']} triton {meta['triton']} | {cfg.dtype} | "
                     f"S={cfg.seq_len} | per GPU: {summary['tokens_per_s_per_gpu_single']:,.0f} tokens/s alone, "
                     f"{summary['tokens_per_s_per_gpu_multi']:,.0f} on {world}\n{meta['command']} | {meta['date']}")
            plot_parity(png_path, {"1 process": [r.loss for r in single], f"{world} ranks (fmd)": [r.loss for r in multi]},
                        "1 process", verdict["tolerance"], title)
            print(f"parity: max |Δloss| {verdict['max_abs_diff']:.3g} (tolerance {verdict['tolerance']:.3g}) -> "
                  f"{verdict['verdict']}; tokens/s per GPU: {summary['tokens_per_s_per_gpu_single']:,.0f} alone, "
                  f"{summary['tokens_per_s_per_gpu_multi']:,.0f} on {world}; wrote {csv_path}, {png_path}", flush=True)
        dist.barrier(group=cpu_group)
    finally:
        dist.destroy_process_group()


TABLE_START, TABLE_END = "<!-- cp-training:start -->", "<!-- cp-training:end -->"


def markdown_table(csv_paths: list[str]) -> str:
    """One line per run (the summary row of each CSV): tokens, GPUs, loss parity, tokens/s per GPU
    alone and on W ranks, the W-rank speedup in tokens/s and the peak memory of each mode."""
    lines = ["| GPUs | tokens | steps | max abs loss diff (tolerance) | parity | tokens/s per GPU: 1 GPU / W GPUs "
             "| W GPUs / 1 GPU (tokens/s) | peak GiB: 1 GPU / per rank |",
             "|---:|---:|---:|---:|---|---:|---:|---:|"]
    notes = []
    for path in csv_paths:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        summary = next((r for r in rows if r["mode"] == "summary"), None)
        if summary is None:
            raise ValueError(f"{path}: no summary row (the W-rank run did not finish)")
        w = int(summary["gpus"])
        alone, multi = float(summary["tokens_per_s_per_gpu_single"]), float(summary["tokens_per_s_per_gpu_multi"])
        peak = {mode: max(float(r["peak_mem_gib"]) for r in rows if r["mode"] == mode) for mode in ("single", "context_parallel")}
        tokens = int(summary["seq_len"])
        size = f"{tokens >> 20}M" if tokens % (1 << 20) == 0 else f"{tokens >> 10}K"
        lines.append(f"| {w} | {size} | {summary['steps']} | {float(summary['max_abs_diff']):.2g} "
                     f"({float(summary['tolerance']):.2g}) | {summary['verdict']} | {alone:,.0f} / {multi:,.0f} "
                     f"| {w * multi / alone:.2f}x | {peak['single']:.1f} / {peak['context_parallel']:.1f} |")
        notes.append(f"{w} x {summary['device']}, torch {summary['torch']}, triton {summary['triton']}, {summary['date']}, "
                     f"{summary['dtype']}, model {summary['n_layers']} layers x {summary['d_model']} "
                     f"({summary['n_heads']}/{summary['n_kv_heads']} heads, D={summary['head_dim']}); `{summary['command']}`")
    return "\n".join(lines + [""] + notes) + "\n"


def config(cfg: RunConfig) -> dict:
    m = cfg.model
    return {"seq_len": cfg.seq_len, "batch": cfg.batch_size, "steps": cfg.steps, "dtype": cfg.dtype, "seed": cfg.seed,
            "n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
            "head_dim": m.head_dim}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (GPUs; gloo processes with --tiny)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke size (gloo, kernels in the Triton interpreter, fp32): the tiny model of "
                        "train_packed_lm, 128-byte sequences, 2 steps")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 262144; tiny 128)")
    p.add_argument("--steps", type=int, default=None, help="default 12; tiny 2")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on GPUs, fp32 with --tiny")
    p.add_argument("--out-dir", default=None, help="default $OUT, else benchmarks/results")
    p.add_argument("--tag", default="", help="suffix of the output names (e.g. _w4)")
    p.add_argument("--table", nargs="+", metavar="CSV", default=None,
                   help="print the table of these runs' CSVs (no training); with --readme, write it there too")
    p.add_argument("--readme", default=None, help="with --table: the file whose cp-training markers take the table")
    args = p.parse_args(argv)
    if args.nproc < 2:
        p.error(f"--nproc must be at least 2, got {args.nproc}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.table:
        table = markdown_table(args.table)
        print(table, end="")
        if args.readme:
            from benchmarks.report import write_marked_block  # the README writer of every generated table

            write_marked_block(args.readme, table, TABLE_START, TABLE_END)
        return 0
    if args.tag and not args.tag.startswith("_"):
        args.tag = "_" + args.tag
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before flexmask (and Triton) are first imported
    elif torch.cuda.device_count() < args.nproc:
        print(f"train_context_parallel: needs {args.nproc} CUDA devices, found {torch.cuda.device_count()} "
              f"(on the CPU: --tiny)", flush=True)
        return 1
    device = torch.device("cpu" if args.tiny else "cuda")
    cfg = RunConfig(model=TINY_MODEL if args.tiny else CP_MODEL, seq_len=args.seq_len or (128 if args.tiny else 262144),
                    batch_size=1, steps=args.steps or (2 if args.tiny else 12), lr=args.lr, warmup=args.warmup,
                    seed=args.seed, device=device, dtype=args.dtype or ("fp32" if args.tiny else "bf16"),
                    compile=False, log_every=0)
    if cfg.seq_len % (2 * args.nproc):
        raise SystemExit(f"--seq-len must be a multiple of 2 x --nproc = {2 * args.nproc}, got {cfg.seq_len}")
    import torch.multiprocessing as mp

    init = f"file://{tempfile.mkdtemp(prefix='cp_train_')}/init"
    # fork on the CPU (the children inherit the imported modules); CUDA cannot be forked
    mp.start_processes(worker, args=(args.nproc, init, cfg, args, argv), nprocs=args.nproc, join=True,
                       start_method="fork" if args.tiny else "spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
