"""Train the small GPT of `examples.gpt_model` the way gpt-oss attends: a learnable sink per query
head in every layer, and layers alternating a 128-token sliding window and full causal attention
(layer 0 sliding, as gpt-oss's `layer_types`), each inside the packed documents.

    python -m examples.train_sinks --steps 200 --seq-len 8192            # GPU, bf16 autocast
    TRITON_INTERPRET=1 python -m examples.train_sinks --tiny             # CPU, seconds

- Model: `examples.gpt_model.GPT` (flexmask backend), each layer's attention function replaced by
  a `SinkAttention`: a module that holds the layer's sinks ((Hq,) float32 logits, starting at 0,
  so a sink first takes the weight of one key with score 0) and calls
  ``flexmask.attention(q, k, v, mask=<its kind's mask>, sinks=self.sinks)``. P_ij = exp(s_ij) /
  (exp(sink_h) + sum_j exp(s_ij)): a head can put weight on "nothing" (DESIGN.md, "Score terms").
- Masks: per batch, two CompiledMasks, `document & sliding_window(window - 1)` (window keys per
  query, itself included, as transformers' `sliding_window=window`) and `document` (causal), built
  once and shared by the layers of each kind and by the backward (plan once, run many).
- Data, optimizer and step: `examples.packed_data` and `examples.train_packed_lm` (the stdlib's
  .py files packed whole, AdamW with warmup and cosine decay, `train_step`).

Every step prints the loss and the norm of each layer's sinks gradient; the run fails (non-zero
exit) unless the loss stays finite and every layer's sinks get a finite, non-zero gradient at
every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import torch
from torch import nn

import flexmask
from flexmask import masks

from .gpt_model import GPT, build_model
from .packed_data import packed_batches
from .train_packed_lm import DTYPES, GPU_MODEL, TINY_MODEL, RunConfig, make_optimizer, train_step

WINDOW = 128  # gpt-oss's sliding window
TINY_WINDOW = 32  # the tiny run's sequences are 128 tokens: a window that still cuts


class SinkAttention(nn.Module):
    """The attention function of one layer: flexmask with this layer's learnable sinks and the mask
    of its kind ("sliding" or "full") from the per-batch dict `layer_masks`."""

    def __init__(self, n_heads: int, sliding: bool) -> None:
        super().__init__()
        self.kind = "sliding" if sliding else "full"
        # float32 even under bf16 autocast: flexmask takes float32 sinks (autocast leaves parameters alone)
        self.sinks = nn.Parameter(torch.zeros(n_heads))

    def forward(self, q, k, v, layer_masks: dict):
        return flexmask.attention(q, k, v, mask=layer_masks[self.kind], sinks=self.sinks)


def add_sinks(model: GPT) -> GPT:
    """gpt-oss's pattern on `model`: sinks in every layer, even layers sliding, odd layers full."""
    for i, block in enumerate(model.blocks):
        block.attn.attend = SinkAttention(model.cfg.n_heads, sliding=i % 2 == 0)
    return model


def layer_masks(seqlens: list[list[int]], window: int, device) -> dict:
    """The two masks of a batch: causal within documents, and that inside a sliding window."""
    s = sum(seqlens[0])
    docs = masks.document(seqlens)
    return {"full": flexmask.compile_mask(docs, s, s, device=device),
            "sliding": flexmask.compile_mask(docs & masks.sliding_window(window - 1), s, s, device=device)}


def sink_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [m.sinks for m in model.modules() if isinstance(m, SinkAttention)]


def check_sink_gradients(norms: list[list[float]]) -> None:
    """norms[step][layer]: every one finite and non-zero, else a RuntimeError naming the first."""
    for step, per_layer in enumerate(norms, 1):
        for layer, norm in enumerate(per_layer):
            if not (math.isfinite(norm) and norm > 0):
                raise RuntimeError(f"step {step}: the sinks of layer {layer} got gradient norm {norm}; "
                                   f"expected finite and non-zero")


def train(cfg: RunConfig, window: int, log=print) -> tuple[list[float], list[list[float]]]:
    """Train from `cfg.seed`; returns the loss and the per-layer sinks gradient norm of every step."""
    model = add_sinks(build_model(cfg.model, "flexmask", cfg.seed, cfg.device)).to(cfg.device)
    sinks = sink_parameters(model)
    step_grads: dict[int, torch.Tensor] = {}  # layer -> the norm of its sinks' gradient this step
    for layer, p in enumerate(sinks):  # as the backward leaves it, before clipping and the optimizer
        p.register_post_accumulate_grad_hook(lambda p, layer=layer: step_grads.update({layer: p.grad.detach().norm()}))
    optimizer, scheduler = make_optimizer(model, cfg)
    step_fn = torch.compile(model, fullgraph=True) if cfg.compile else model
    batches = packed_batches(cfg.seq_len, cfg.batch_size, cfg.seed)
    losses, norms = [], []
    for step in range(1, cfg.steps + 1):
        batch = next(batches)
        inputs, targets = batch.inputs.to(cfg.device), batch.targets.to(cfg.device)
        step_grads.clear()
        loss = train_step(step_fn, optimizer, scheduler, inputs, targets, layer_masks(batch.seqlens, window, cfg.device),
                          cfg).item()
        layer_norms = [float(step_grads.get(layer, 0.0)) for layer in range(len(sinks))]  # 0: no gradient
        losses.append(loss)
        norms.append(layer_norms)
        if cfg.log_every and (step % cfg.log_every == 0 or step == 1):
            mean_sink = torch.stack([p.detach().mean() for p in sinks]).mean().item()
            log(f"step {step:4d}  loss {loss:.4f}  sinks |grad| per layer "
                f"[{', '.join(f'{n:.2e}' for n in layer_norms)}]  mean sink {mean_sink:+.3f}")
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"non-finite loss in {losses}")
    check_sink_gradients(norms)
    return losses, norms


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny model on 128-token sequences, fp32 (CPU, seconds)")
    p.add_argument("--steps", type=int, default=None, help="default 200; tiny 3")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per packed sequence (default 8192; tiny 128)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 1; tiny 2)")
    p.add_argument("--window", type=int, default=None, help=f"sliding window of the even layers "
                                                            f"(default {WINDOW}; tiny {TINY_WINDOW})")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3; tiny 3e-3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="autocast dtype (default bf16; tiny fp32)")
    p.add_argument("--device", default=None, help="default cuda when available (tiny: cpu)")
    p.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=None, help="print every N steps (default 10; tiny 1)")
    return p.parse_args(argv)


def run_config(args: argparse.Namespace) -> RunConfig:
    def pick(value, tiny, big):
        return value if value is not None else (tiny if args.tiny else big)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    return RunConfig(model=TINY_MODEL if args.tiny else GPU_MODEL, seq_len=pick(args.seq_len, 128, 8192),
                     batch_size=pick(args.batch_size, 2, 1), steps=pick(args.steps, 3, 200),
                     lr=pick(args.lr, 3e-3, 1e-3), warmup=1 if args.tiny else 10, seed=args.seed, device=device,
                     dtype=pick(args.dtype, "fp32", "bf16"), compile=args.compile, log_every=pick(args.log_every, 1, 10))


def main(argv: list[str] | None = None) -> tuple[list[float], list[list[float]]]:
    args = parse_args(argv)
    cfg = run_config(args)
    window = args.window if args.window is not None else (TINY_WINDOW if args.tiny else WINDOW)
    if window < 1:
        raise ValueError(f"--window must be a positive number of tokens, got {window}")
    print(f"gpt-oss pattern on {dataclasses.asdict(cfg.model)}: layers {cfg.model.n_layers} (even: {window}-token "
          f"window, odd: full causal), sinks per head; seq {cfg.seq_len} x batch {cfg.batch_size}, {cfg.dtype}, "
          f"{cfg.device}")
    losses, norms = train(cfg, window)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; every layer's sinks got gradients")
    return losses, norms


if __name__ == "__main__":
    main(sys.argv[1:])
