"""Train a small byte-level GPT on packed documents with a document mask.

The documents are the Python standard library's own ``.py`` files (see `examples.packed_data`),
packed whole into long sequences; attention is causal within each file and never crosses a
file boundary: ``masks.document(seqlens)``. Three modes (run from the repository root):

  train    one run: loss, tokens/s and peak memory on a progress bar
  parity   the same init, data and seed through several attention backends; per-step losses
           (CSV), a plot (PNG) and a verdict against a stated tolerance
  scale    tokens/s and peak memory at long sequence lengths (batch 1) per backend; a backend
           that runs out of memory is recorded as "OOM"

    python -m examples.train_packed_lm train --backend flexmask --seq-len 8192 --steps 200
    python -m examples.train_packed_lm parity --steps 100 --seq-len 8192
    python -m examples.train_packed_lm scale --seq-lens 8192 32768 131072
    TRITON_INTERPRET=1 python -m examples.train_packed_lm train --tiny     # CPU, seconds

Parity tolerance (bf16). Two correct bf16 attention kernels differ by their rounding, and the
difference grows through training as the weights drift apart. The control run ``sdpa-fp32``
(the same dense-mask SDPA, computed in float32) measures that noise for SDPA itself:
``noise = max over steps |loss(sdpa) - loss(sdpa-fp32)|``. A backend passes when
``max over steps |loss(backend) - loss(sdpa)| <= 2 * noise + 0.01`` nats: the 2x is the
project's rule for "as accurate as the same math in the input dtype" (DESIGN.md, section 4;
two independently rounded runs sit about sqrt(2) x noise apart), and 0.01 nats (0.2% of the
initial loss of about 5.5) is a floor for runs where the control happens to land very close.
The step-to-step fluctuation of the reference loss (different files every step) is reported
next to it, to show how small the differences are on the scale of the curves themselves. In
float32 (tiny CPU runs) there is no control; the tolerance is 1e-3 nats.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import math
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .gpt_model import BACKENDS, ModelConfig, build_attention_mask, build_model
from .packed_data import IGNORE_INDEX, VOCAB_SIZE, packed_batches
from .train_report import plot_parity, plot_scale, results_dir, run_metadata, write_csv

TINY_MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=128)
GPU_MODEL = ModelConfig()  # 6 layers, d_model 768, 6 query heads of D=128, 2 KV heads
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PARITY_REFERENCE, PARITY_CONTROL = "sdpa", "sdpa-fp32"
PARITY_FLOOR = 0.01  # nats, bf16
FP32_TOLERANCE = 1e-3


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    seed: int
    device: torch.device
    dtype: str
    compile: bool
    log_every: int


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    seconds: float
    tokens: int
    real_tokens: int
    docs: int
    peak_mem_gib: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


# -- one training run -------------------------------------------------------------------------------
def make_optimizer(model: torch.nn.Module, cfg: RunConfig):
    """AdamW with linear warmup then cosine decay to 10% of the peak learning rate."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy (nats) over the positions that have a target."""
    return F.cross_entropy(logits.view(-1, VOCAB_SIZE).float(), targets.view(-1), ignore_index=IGNORE_INDEX)


def train_step(model, optimizer, scheduler, inputs, targets, mask, cfg: RunConfig) -> torch.Tensor:
    amp = DTYPES[cfg.dtype] != torch.float32
    with torch.autocast(cfg.device.type, dtype=DTYPES[cfg.dtype], enabled=amp):
        loss = language_model_loss(model(inputs, mask), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak CUDA memory allocated since the last reset; on CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def train(cfg: RunConfig, backend: str, desc: str | None = None, leave: bool = True) -> list[StepRecord]:
    """Train from ``cfg.seed`` for ``cfg.steps`` steps; the time of a step includes building its
    mask (every backend pays for its own mask), not reading the files."""
    reset_peak_memory(cfg.device)
    model = build_model(cfg.model, backend, cfg.seed, cfg.device)
    optimizer, scheduler = make_optimizer(model, cfg)
    step_fn = torch.compile(model, fullgraph=True) if cfg.compile else model
    batches = packed_batches(cfg.seq_len, cfg.batch_size, cfg.seed)
    records: list[StepRecord] = []
    quiet = not sys.stderr.isatty()  # captured logs: a bar line every 30 s, not every step
    bar = tqdm(range(1, cfg.steps + 1), desc=desc or backend, leave=leave, mininterval=30.0 if quiet else 0.5)
    for step in bar:
        batch = next(batches)
        synchronize(cfg.device)
        start = time.perf_counter()
        inputs, targets = batch.inputs.to(cfg.device), batch.targets.to(cfg.device)
        mask = build_attention_mask(backend, batch.seqlens, cfg.device)
        lr = scheduler.get_last_lr()[0]
        loss = train_step(step_fn, optimizer, scheduler, inputs, targets, mask, cfg).item()
        synchronize(cfg.device)
        record = StepRecord(
            step,
            loss,
            lr,
            time.perf_counter() - start,
            batch.inputs.numel(),
            batch.num_real_tokens,
            sum(len(r) for r in batch.seqlens),
            peak_memory_gib(cfg.device),
        )
        records.append(record)
        bar.set_postfix(
            loss=f"{loss:.4f}", tok_s=f"{record.tokens_per_s:,.0f}", mem=f"{record.peak_mem_gib:.2f}G", refresh=False
        )
        if cfg.log_every and step % cfg.log_every == 0:
            tqdm.write(format_record(backend, record))
    bar.close()
    if not all(math.isfinite(r.loss) for r in records):
        raise FloatingPointError(f"{backend}: non-finite loss in {[r.loss for r in records]}")
    return records


def format_record(backend: str, r: StepRecord) -> str:
    return (
        f"[{backend}] step {r.step:4d}  loss {r.loss:.4f}  lr {r.lr:.2e}  {r.tokens_per_s:,.0f} tok/s  "
        f"peak mem {r.peak_mem_gib:.2f} GiB  docs {r.docs}  real tokens {r.real_tokens}/{r.tokens}"
    )


def steady_tokens_per_s(records: list[StepRecord], skip: int) -> float:
    """Median tokens/s over the steps after the first ``skip`` (compilation, autotuning)."""
    timed = records[skip:] or records[-1:]
    return statistics.median(r.tokens_per_s for r in timed)


def summary_line(backend: str, records: list[StepRecord]) -> str:
    return (
        f"{backend}: {len(records)} steps, loss {records[0].loss:.4f} -> {records[-1].loss:.4f}, "
        f"{steady_tokens_per_s(records, skip=1):,.0f} tokens/s (median after step 1), "
        f"peak memory {max(r.peak_mem_gib for r in records):.2f} GiB"
    )


# -- parity -------------------------------------------------------------------------------------------
def parity_tolerance(curves: dict[str, list[float]], dtype: str) -> tuple[float, float]:
    """(tolerance, noise) for |loss(backend) - loss(reference)|: see the module docstring."""
    if dtype == "fp32":
        return FP32_TOLERANCE, 0.0
    noise = max_abs_diff(curves[PARITY_CONTROL], curves[PARITY_REFERENCE])
    return 2 * noise + PARITY_FLOOR, noise


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def step_noise(losses: list[float]) -> float:
    """Typical step-to-step change of a loss curve over its second half (median |Δ|)."""
    tail = losses[len(losses) // 2 :]
    return statistics.median(abs(b - a) for a, b in itertools.pairwise(tail)) if len(tail) > 1 else float("nan")


def parity_backends(requested: list[str], dtype: str) -> list[str]:
    """The reference first, then the control (mixed precision only), then the rest."""
    order = [PARITY_REFERENCE] + ([PARITY_CONTROL] if dtype != "fp32" else [])
    return order + [b for b in requested if b not in order]


def run_parity(cfg: RunConfig, backends: list[str], argv: list[str], out_dir: str | None, tag: str) -> list[dict]:
    meta = {**config_columns(cfg), "seq_len": cfg.seq_len, "batch": cfg.batch_size, **run_metadata(argv, cfg.device)}
    curves: dict[str, list[float]] = {}
    step_rows: list[dict] = []
    failures: dict[str, str] = {}
    for backend in parity_backends(backends, cfg.dtype):
        try:
            records = train(cfg, backend)
        except Exception as exc:  # recorded in the summary; the reference must succeed
            if backend in (PARITY_REFERENCE, PARITY_CONTROL):
                raise
            failures[backend] = failure_status(exc)
            continue
        tqdm.write(summary_line(backend, records))
        curves[backend] = [r.loss for r in records]
        step_rows += [{"backend": backend, **record_row(r), **meta} for r in records]
        free_memory(cfg.device)
    tolerance, noise = parity_tolerance(curves, cfg.dtype)
    summary = parity_summary(curves, failures, tolerance, noise, cfg, meta)
    out = results_dir(out_dir)
    paths = [
        write_csv(out / f"train_parity{tag}.csv", step_rows),
        write_csv(out / f"train_parity{tag}_summary.csv", summary),
        plot_parity(
            out / f"train_parity{tag}.png",
            curves,
            PARITY_REFERENCE,
            tolerance,
            plot_title(cfg, meta, f"seq {cfg.seq_len} x batch {cfg.batch_size}"),
        ),
    ]
    for row in summary:
        tqdm.write(parity_line(row))
    tqdm.write("wrote " + ", ".join(map(str, paths)))
    return summary


def parity_line(row: dict) -> str:
    if "max_abs_diff" not in row:
        return f"parity {row['backend']:>9} vs {PARITY_REFERENCE}: {row['verdict']}"
    return (
        f"parity {row['backend']:>9} vs {PARITY_REFERENCE}: max |Δloss| {row['max_abs_diff']:.4g} "
        f"(tolerance {row['tolerance']:.4g}, step-to-step noise {row['step_noise']:.4g}) -> {row['verdict']}"
    )


def parity_summary(curves, failures, tolerance, noise, cfg: RunConfig, meta: dict) -> list[dict]:
    ref = curves[PARITY_REFERENCE]
    rows = []
    for backend, losses in curves.items():
        if backend == PARITY_REFERENCE:
            continue
        diff = max_abs_diff(losses, ref)
        verdict = "control" if backend == PARITY_CONTROL else ("PASS" if diff <= tolerance else "FAIL")
        rows.append(
            {
                "backend": backend,
                "reference": PARITY_REFERENCE,
                "steps": len(losses),
                "max_abs_diff": diff,
                "mean_abs_diff": statistics.fmean(abs(a - b) for a, b in zip(losses, ref)),
                "tolerance": tolerance,
                "control_noise": noise,
                "step_noise": step_noise(ref),
                "final_loss": losses[-1],
                "reference_final_loss": ref[-1],
                "verdict": verdict,
                **meta,
            }
        )
    for backend, status in failures.items():
        rows.append({"backend": backend, "reference": PARITY_REFERENCE, "verdict": status, **meta})
    return rows


# -- scale --------------------------------------------------------------------------------------------
def run_scale(
    cfg: RunConfig,
    backends: list[str],
    seq_lens: list[int],
    warmup_steps: int,
    argv: list[str],
    out_dir: str | None,
    tag: str,
) -> list[dict]:
    meta = {**config_columns(cfg), **run_metadata(argv, cfg.device)}
    rows = []
    for backend in backends:
        for seq_len in seq_lens:
            row = {
                "backend": backend,
                "seq_len": seq_len,
                "batch": 1,
                **measure_scale_point(cfg, backend, seq_len, warmup_steps),
                **meta,
            }
            tqdm.write(
                f"scale {backend:>8} S={seq_len:>7}: {row['status']}, "
                f"{row['tokens_per_s']:,.0f} tokens/s, peak {row['peak_mem_gib']:.2f} GiB"
            )
            rows.append(row)
    out = results_dir(out_dir)
    title = plot_title(cfg, meta, f"batch 1, {cfg.steps} timed steps after {warmup_steps}")
    paths = [write_csv(out / f"train_scale{tag}.csv", rows), plot_scale(out / f"train_scale{tag}.png", rows, title)]
    tqdm.write("wrote " + ", ".join(map(str, paths)))
    return rows


def measure_scale_point(cfg: RunConfig, backend: str, seq_len: int, warmup_steps: int) -> dict:
    """Median tokens/s after ``warmup_steps`` and peak memory (weights, optimizer state and the
    step); "OOM" (or the error) instead when the run fails."""
    point = dataclasses.replace(cfg, seq_len=seq_len, batch_size=1, steps=cfg.steps + warmup_steps, log_every=0)
    result = {"status": "ok", "tokens_per_s": float("nan"), "peak_mem_gib": float("nan"), "final_loss": float("nan")}
    try:
        records = train(point, backend, desc=f"{backend} S={seq_len}", leave=False)
        result.update(
            tokens_per_s=steady_tokens_per_s(records, warmup_steps),
            peak_mem_gib=max(r.peak_mem_gib for r in records),
            final_loss=records[-1].loss,
        )
    except Exception as exc:  # noqa: BLE001 - recorded in the CSV row, traceback on stderr
        result["status"] = failure_status(exc)
    free_memory(cfg.device)
    return result


def failure_status(exc: Exception) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "OOM"
    traceback.print_exception(exc, file=sys.stderr)
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- output helpers -----------------------------------------------------------------------------------
def record_row(r: StepRecord) -> dict:
    return {
        "step": r.step,
        "loss": r.loss,
        "lr": r.lr,
        "step_time_s": r.seconds,
        "tokens": r.tokens,
        "real_tokens": r.real_tokens,
        "docs": r.docs,
        "tokens_per_s": r.tokens_per_s,
        "peak_mem_gib": r.peak_mem_gib,
    }


def config_columns(cfg: RunConfig) -> dict:
    """The model and run settings, repeated in every CSV row."""
    m = cfg.model
    return {
        "dtype": cfg.dtype,
        "n_layers": m.n_layers,
        "d_model": m.d_model,
        "n_heads": m.n_heads,
        "n_kv_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "seed": cfg.seed,
        "compile": cfg.compile,
    }


def plot_title(cfg: RunConfig, meta: dict, shape: str) -> str:
    m = cfg.model
    return (
        f"{meta['device']} | torch {meta['torch']} triton {meta['triton']} | {cfg.dtype} | "
        f"{m.n_layers}L d{m.d_model} {m.n_heads}q/{m.n_kv_heads}kv heads D{m.head_dim} | {shape}\n"
        f"{meta['command']} | {meta['date']}"
    )


# -- command line -------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--tiny",
        action="store_true",
        help="CPU smoke size: 2 layers, d_model 64, 2 query heads / 1 KV head of D=32, "
        "sequences of 128 bytes, a few steps, fp32 (needs TRITON_INTERPRET=1 for flexmask)",
    )
    common.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    common.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="autocast dtype; default bf16 on cuda, fp32 on cpu"
    )
    common.add_argument("--seq-len", type=int, default=None, help="tokens per packed sequence (default 8192; tiny 128)")
    common.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 1; tiny 2)")
    common.add_argument("--steps", type=int, default=None, help="optimizer steps (scale: timed steps per point)")
    common.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3; tiny 3e-3)")
    common.add_argument("--warmup", type=int, default=None, help="learning-rate warmup steps (default 10; tiny 1)")
    common.add_argument("--seed", type=int, default=0, help="model init and data order")
    common.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True)")
    common.add_argument("--log-every", type=int, default=None, help="print a log line every N steps (0: never)")
    common.add_argument(
        "--out-dir", default=None,
        help="where CSV/PNG go (default $OUT if set, else benchmarks/results; --tiny: a temporary folder)"
    )
    for field in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden"):
        common.add_argument("--" + field.replace("_", "-"), type=int, default=None, help=f"model {field}")

    parser = argparse.ArgumentParser(prog="python -m examples.train_packed_lm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    train_p = sub.add_parser("train", parents=[common], help="one training run")
    train_p.add_argument("--backend", choices=BACKENDS, default="flexmask")
    parity_p = sub.add_parser("parity", parents=[common], help="loss curves of several backends from the same start")
    parity_p.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=None,
        help=f"compared with {PARITY_REFERENCE}, which always runs (with the {PARITY_CONTROL} "
        "control in bf16); default flexmask flex on cuda, flexmask on cpu "
        "(FlexAttention has no CPU backward)",
    )
    scale_p = sub.add_parser("scale", parents=[common], help="tokens/s and peak memory against sequence length")
    scale_p.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=None,
        help="default flexmask sdpa flex on cuda, flexmask sdpa on cpu",
    )
    scale_p.add_argument("--seq-lens", nargs="+", type=int, default=None, help="default 8192 32768 131072; tiny 64 128")
    scale_p.add_argument(
        "--warmup-steps", type=int, default=1, help="untimed steps per point (compilation, autotuning)"
    )
    return parser.parse_args(argv)


def run_config(args: argparse.Namespace) -> RunConfig:
    """Defaults by mode and size, overridden by any option given."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    model = TINY_MODEL if args.tiny else GPU_MODEL
    overrides = {f: getattr(args, f) for f in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden")}
    model = dataclasses.replace(model, **{k: v for k, v in overrides.items() if v is not None})
    default_steps = {
        "train": 3 if args.tiny else 200,
        "parity": 3 if args.tiny else 100,
        "scale": 2 if args.tiny else 3,
    }

    def pick(value, tiny, big):
        return value if value is not None else (tiny if args.tiny else big)

    return RunConfig(
        model=model,
        seq_len=pick(args.seq_len, 128, 8192),
        batch_size=pick(args.batch_size, 2, 1),
        steps=args.steps if args.steps is not None else default_steps[args.mode],
        lr=pick(args.lr, 3e-3, 1e-3),
        warmup=pick(args.warmup, 1, 10),
        seed=args.seed,
        device=device,
        dtype=args.dtype or ("bf16" if device.type == "cuda" else "fp32"),
        compile=args.compile,
        log_every=pick(args.log_every, 1, 10),
    )


def check_environment(backends: list[str], device: torch.device) -> None:
    if "flexmask" in backends and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(
            "the flexmask backend on CPU runs its Triton kernels in the interpreter: set "
            "TRITON_INTERPRET=1 in the environment before Python starts (or pass --device cuda)"
        )


CPU_MAX_SEQ_LEN = 1024  # longer sequences are GPU runs: hours in the Triton interpreter


def check_cpu_sizes(args: argparse.Namespace, cfg: RunConfig) -> None:
    """Stop at once, with one line, where a GPU run was asked for on a machine without one."""
    if cfg.device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"examples.train_packed_lm {args.mode} --device {args.device}: no CUDA device is "
                         f"available here; on the CPU: TRITON_INTERPRET=1 python -m examples.train_packed_lm "
                         f"{args.mode} --tiny")
    lengths = [cfg.seq_len] + (list(args.seq_lens or []) if args.mode == "scale" else [])
    if args.mode == "scale" and not args.seq_lens and not args.tiny:
        lengths += [8192, 32768, 131072]
    if cfg.device.type == "cpu" and max(lengths) > CPU_MAX_SEQ_LEN:
        raise SystemExit(f"examples.train_packed_lm {args.mode}: {max(lengths)}-token sequences are a GPU run and "
                         f"no CUDA device is in use; on the CPU (seconds): TRITON_INTERPRET=1 python -m "
                         f"examples.train_packed_lm {args.mode} --tiny")


def default_out_dir(args: argparse.Namespace) -> str | None:
    """--out-dir, else $OUT; a --tiny run (a smoke test) otherwise writes to a fresh temporary
    folder, never over the GPU results tracked in benchmarks/results/."""
    if args.out_dir or os.environ.get("OUT") or not args.tiny:
        return args.out_dir
    return tempfile.mkdtemp(prefix=f"flexmask-{args.mode}-tiny-")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cfg = run_config(args)
    check_cpu_sizes(args, cfg)
    if args.mode != "train":
        args.out_dir = default_out_dir(args)
    tag = "_tiny" if args.tiny else ""
    cuda = cfg.device.type == "cuda"
    if args.mode == "train":
        check_environment([args.backend], cfg.device)
        tqdm.write(summary_line(args.backend, train(cfg, args.backend)))
    elif args.mode == "parity":
        backends = args.backends or (["flexmask", "flex"] if cuda else ["flexmask"])
        check_environment(backends, cfg.device)
        run_parity(cfg, backends, argv, args.out_dir, tag)
    else:
        backends = args.backends or (["flexmask", "sdpa", "flex"] if cuda else ["flexmask", "sdpa"])
        check_environment(backends, cfg.device)
        seq_lens = args.seq_lens or ([64, 128] if args.tiny else [8192, 32768, 131072])
        run_scale(cfg, backends, seq_lens, args.warmup_steps, argv, args.out_dir, tag)


if __name__ == "__main__":
    main()
