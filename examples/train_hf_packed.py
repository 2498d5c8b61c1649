"""Train a Hugging Face `transformers` Llama on packed documents with attn_implementation="flexmask".

The change to an ordinary transformers training loop is one import and one argument::

    import flexmask.integrations.transformers                         # registers "flexmask"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexmask")
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits

The data is the standard-library text of `examples.packed_data` (byte tokens), each file cut
into documents of at most --max-doc-len bytes (default a quarter of the sequence) so that every
sequence packs several of them. As with transformers' ``DataCollatorWithFlattening``, document
boundaries travel in ``position_ids`` (they restart at 0 at every document), and attention never
crosses a document (the unfilled tail is a padding document of its own, with no loss).

Parity: the same init, data and seed through "sdpa" (transformers' SDPA path, which reads the
same position_ids into a dense 4-D mask; the reference), "sdpa-fp32" (the control: the same in
float32, measuring bf16 noise) and "flexmask". A backend passes when its largest per-step loss
difference to the reference is at most 2x the control's plus 0.01 nats (the rule of
`examples.train_packed_lm`). Per-step CSV, a summary CSV with the verdict and a PNG go to
--out (default $OUT, else benchmarks/results)::

    PYTHONPATH=$PWD python3 -m examples.train_hf_packed --steps 60 --seq-len 4096 --batch-size 2
    TRITON_INTERPRET=1 python -m examples.train_hf_packed --tiny      # CPU, float32, seconds
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .packed_data import IGNORE_INDEX, VOCAB_SIZE, collate, document_stream, pack_documents, stdlib_source_files
from .train_packed_lm import (
    PARITY_CONTROL,
    PARITY_REFERENCE,
    make_optimizer,
    max_abs_diff,
    parity_tolerance,
    peak_memory_gib,
    reset_peak_memory,
    step_noise,
    synchronize,
)
from .train_report import plot_parity, results_dir, run_metadata, write_csv

BACKENDS = {  # run name -> attn_implementation (the control runs SDPA without autocast)
    PARITY_REFERENCE: "sdpa",
    PARITY_CONTROL: "sdpa",
    "flexmask": "flexmask",
}


@dataclass(frozen=True)
class RunConfig:
    seq_len: int
    max_doc_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    seed: int
    device: torch.device
    dtype: str  # "bf16" (autocast) or "fp32"
    hidden: int
    layers: int
    heads: int
    kv_heads: int


def llama_config(cfg: RunConfig):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq_len, attention_dropout=0.0, tie_word_embeddings=False,
    )


def packed_batches(cfg: RunConfig):
    """`examples.packed_data`'s stream, with every file cut into documents of at most
    cfg.max_doc_len bytes, so that each sequence packs several documents."""
    files = stdlib_source_files()

    def pieces():
        for text in document_stream(files, cfg.seed):
            yield from (text[i:i + cfg.max_doc_len] for i in range(0, len(text), cfg.max_doc_len))

    packs = pack_documents(pieces(), cfg.seq_len)
    while True:
        yield collate([next(packs) for _ in range(cfg.batch_size)])


def position_ids_of(seqlens: list[list[int]]) -> torch.Tensor:
    """(B, S) positions that restart at 0 at every document: how transformers marks packing."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in seqlens])


def build_model(cfg: RunConfig, backend: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)  # the same init for every backend
    model = AutoModelForCausalLM.from_config(copy.deepcopy(llama_config(cfg)), attn_implementation=BACKENDS[backend])
    return model.to(cfg.device)


def train(cfg: RunConfig, backend: str) -> list[dict]:
    reset_peak_memory(cfg.device)
    model = build_model(cfg, backend)
    optimizer, scheduler = make_optimizer(model, cfg)
    amp = cfg.dtype == "bf16" and backend != PARITY_CONTROL
    batches = packed_batches(cfg)
    rows = []
    for step in range(1, cfg.steps + 1):
        batch = next(batches)
        synchronize(cfg.device)
        start = time.perf_counter()
        inputs, targets = batch.inputs.to(cfg.device), batch.targets.to(cfg.device)
        position_ids = position_ids_of(batch.seqlens).to(cfg.device)
        with torch.autocast(cfg.device.type, dtype=torch.bfloat16, enabled=amp):
            # use_cache=False: transformers reads packing from position_ids only without a cache
            logits = model(input_ids=inputs, position_ids=position_ids, use_cache=False).logits
            loss = F.cross_entropy(logits.view(-1, VOCAB_SIZE).float(), targets.view(-1), ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        synchronize(cfg.device)
        seconds = time.perf_counter() - start
        rows.append({"backend": backend, "step": step, "loss": value, "step_time_s": seconds,
                     "tokens_per_s": inputs.numel() / seconds, "docs": sum(len(r) for r in batch.seqlens),
                     "peak_mem_gib": peak_memory_gib(cfg.device)})
        if not math.isfinite(value):
            raise FloatingPointError(f"{backend}: non-finite loss {value} at step {step}")
        if step == 1 or step % 10 == 0 or step == cfg.steps:
            print(f"[{backend}] step {step:4d}  loss {value:.4f}  {rows[-1]['tokens_per_s']:,.0f} tok/s", flush=True)
    del model, optimizer
    return rows


def summarize(curves: dict[str, list[float]], steps: dict[str, list[dict]], cfg: RunConfig, meta: dict) -> list[dict]:
    tolerance, noise = parity_tolerance(curves, cfg.dtype)
    ref = curves[PARITY_REFERENCE]
    rows = []
    for backend, losses in curves.items():
        if backend == PARITY_REFERENCE:
            continue
        diff = max_abs_diff(losses, ref)
        verdict = "control" if backend == PARITY_CONTROL else ("PASS" if diff <= tolerance else "FAIL")
        timed = sorted(r["tokens_per_s"] for r in steps[backend][1:]) or [steps[backend][0]["tokens_per_s"]]
        rows.append({"backend": backend, "reference": PARITY_REFERENCE, "steps": len(losses), "max_abs_diff": diff,
                     "tolerance": tolerance, "control_noise": noise, "step_noise": step_noise(ref),
                     "final_loss": losses[-1], "reference_final_loss": ref[-1],
                     "median_tokens_per_s": timed[len(timed) // 2], "verdict": verdict, **meta})
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.train_hf_packed", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke size: 2 layers, hidden 64, 128 tokens, fp32")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per packed sequence (default 4096; tiny 128)")
    p.add_argument("--max-doc-len", type=int, default=None,
                   help="files are cut into documents of at most this many bytes (default seq-len / 4)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 2)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per backend (default 60; tiny 3)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default 10; tiny 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default $OUT, else benchmarks/results)")
    return p.parse_args(argv)


def run_config(args: argparse.Namespace) -> RunConfig:
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_hf_packed: no CUDA device (use --tiny with TRITON_INTERPRET=1 for a CPU run)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("train_hf_packed: on CPU the flexmask kernels need TRITON_INTERPRET=1 set before Python starts")

    def pick(value, tiny, big):
        return value if value is not None else (tiny if args.tiny else big)

    seq_len = pick(args.seq_len, 128, 4096)
    return RunConfig(
        seq_len=seq_len, max_doc_len=args.max_doc_len or max(1, seq_len // 4), batch_size=pick(args.batch_size, 2, 2),
        steps=pick(args.steps, 3, 60), lr=args.lr, warmup=pick(args.warmup, 1, 10), seed=args.seed,
        device=device, dtype=args.dtype or ("bf16" if device.type == "cuda" else "fp32"),
        hidden=pick(None, 64, 512), layers=pick(None, 2, 4), heads=pick(None, 4, 8), kv_heads=2,
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cfg = run_config(args)
    import transformers

    import flexmask.integrations.transformers  # noqa: F401  (registers "flexmask")

    meta = {"seq_len": cfg.seq_len, "max_doc_len": cfg.max_doc_len, "batch": cfg.batch_size, "dtype": cfg.dtype, "layers": cfg.layers,
            "hidden": cfg.hidden, "heads": cfg.heads, "kv_heads": cfg.kv_heads, "seed": cfg.seed,
            "transformers": transformers.__version__, **run_metadata(argv, cfg.device)}
    meta["command"] = "python -m examples.train_hf_packed " + shlex.join(argv)
    backends = [PARITY_REFERENCE] + ([PARITY_CONTROL] if cfg.dtype != "fp32" else []) + ["flexmask"]
    steps = {b: train(cfg, b) for b in backends}
    curves = {b: [r["loss"] for r in rows] for b, rows in steps.items()}
    summary = summarize(curves, steps, cfg, meta)
    # tiny CPU runs never land in benchmarks/results unless asked to
    out = results_dir(args.out or (tempfile.mkdtemp(prefix="hf_parity_") if args.tiny and not os.environ.get("OUT") else None))
    tag = "_tiny" if args.tiny else ""
    paths = [
        write_csv(out / f"hf_parity{tag}.csv", [{**r, **meta} for rows in steps.values() for r in rows]),
        write_csv(out / f"hf_parity{tag}_summary.csv", summary),
        plot_parity(out / f"hf_parity{tag}.png", curves, PARITY_REFERENCE, summary[-1]["tolerance"],
                    f"transformers {transformers.__version__} Llama {cfg.layers}L h{cfg.hidden} "
                    f"{cfg.heads}q/{cfg.kv_heads}kv | {cfg.dtype} | seq {cfg.seq_len} x {cfg.batch_size} packed | "
                    f"{meta['device']} | torch {meta['torch']} triton {meta['triton']}\n{meta['command']} | {meta['date']}"),
    ]
    for row in summary:
        print(f"parity {row['backend']:>9} vs {PARITY_REFERENCE}: max |dloss| {row['max_abs_diff']:.4g} "
              f"(tolerance {row['tolerance']:.4g}) median {row['median_tokens_per_s']:,.0f} tok/s -> {row['verdict']}")
    print("wrote " + ", ".join(map(str, paths)))
    if any(row["verdict"] == "FAIL" for row in summary):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
