"""A small GPT-style language model whose attention backend is chosen by name.

Pre-norm blocks (RMSNorm), rotary position embeddings, grouped-query attention and a SwiGLU
MLP. The attention of every layer goes through one function, picked by ``backend``:

  flexmask   ``flexmask.attention(q, k, v, mask=CompiledMask)``: only the tiles the
             document mask needs, GQA by indexing
  sdpa       ``F.scaled_dot_product_attention`` with a dense boolean (B, 1, S, S) mask
             (K/V repeated to Hq heads, so SDPA can use its masked fused kernels)
  sdpa-fp32  the same, computed in float32: the control run that measures bf16 noise
  flex       FlexAttention (``torch.compile``d on CUDA) with a document ``BlockMask``

The mask object each backend consumes is built once per batch by `build_attention_mask`
and shared by all layers (plan once, run many).

RoPE uses positions 0..S-1 of the packed sequence. Rotary scores depend only on the
distance between query and key, and no query attends across a document boundary, so this
gives the same attention as restarting positions at every document.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flexmask
from flexmask import masks

BACKENDS = ("flexmask", "sdpa", "sdpa-fp32", "flex")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 768
    n_layers: int = 6
    n_heads: int = 6
    n_kv_heads: int = 2
    mlp_hidden: int = 2048
    rope_base: float = 10_000.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# -- masks: one object per batch, consumed by every layer ---------------------------------------
def document_ids(seqlens: list[list[int]], device) -> torch.Tensor:
    """int64 (B, S): the index of the document each position belongs to."""
    rows = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in seqlens]
    return torch.stack(rows).to(device)


def dense_document_mask(seqlens: list[list[int]], device) -> torch.Tensor:
    """Boolean (B, 1, S, S), True = attend: same document and key <= query. O(S^2) memory."""
    doc = document_ids(seqlens, device)
    allowed = doc[:, :, None] == doc[:, None, :]
    return allowed.tril_().unsqueeze(1)


def flex_document_block_mask(seqlens: list[list[int]], device):
    """FlexAttention ``BlockMask`` for causal attention within documents."""
    doc = document_ids(seqlens, device)
    batch, seq_len = doc.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    # compiled on CUDA so that the mask is never evaluated densely (S x S) at long lengths
    return create_block_mask(
        mask_mod, batch, None, seq_len, seq_len, device=device, _compile=torch.device(device).type == "cuda"
    )


def build_attention_mask(backend: str, seqlens: list[list[int]], device):
    """The causal document mask in the form ``backend`` consumes."""
    seq_len = sum(seqlens[0])
    if backend == "flexmask":
        return flexmask.compile_mask(masks.document(seqlens), seq_len, seq_len, device=device)
    if backend in ("sdpa", "sdpa-fp32"):
        return dense_document_mask(seqlens, device)
    if backend == "flex":
        return flex_document_block_mask(seqlens, device)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


# -- attention functions: (q (B,Hq,S,D), k, v (B,Hkv,S,D), mask) -> (B,Hq,S,D) -----------------
def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def flexmask_attention(q, k, v, mask):
    return flexmask.attention(q, k, v, mask=mask)


def sdpa_attention(q, k, v, mask):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _repeat_kv(k, group), _repeat_kv(v, group), attn_mask=mask)


def sdpa_fp32_attention(q, k, v, mask):
    with torch.autocast(q.device.type, enabled=False):
        out = sdpa_attention(q.float(), k.float(), v.float(), mask)
    return out.to(q.dtype)


@functools.cache
def _flex_kernel(device_type: str):
    """FlexAttention is only fast when compiled; on CPU it runs eagerly (tiny runs only)."""
    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


def flex_attention_fn(q, k, v, mask):
    return _flex_kernel(q.device.type)(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


ATTENTION_FUNCTIONS = {
    "flexmask": flexmask_attention,
    "sdpa": sdpa_attention,
    "sdpa-fp32": sdpa_fp32_attention,
    "flex": flex_attention_fn,
}


# -- model ----------------------------------------------------------------------------------------
def rope_tables(seq_len: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (S, 1, D) for the rotate-half convention, in float32."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, S, H, D); rotated in its own dtype (bf16 stays bf16 under autocast)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__()
        if backend not in ATTENTION_FUNCTIONS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.attend = ATTENTION_FUNCTIONS[backend]

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim)
        k, v = self.kv_proj(x).view(b, s, 2, self.n_kv_heads, self.head_dim).unbind(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # (B, S, H, D) -> (B, H, S, D) views, no copy
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg, backend)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Byte-level decoder. ``forward(tokens (B, S), mask) -> logits (B, S, vocab)``."""

    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, backend) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers)."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("o_proj.weight", "down.weight")) else 0.02
            nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor, mask) -> torch.Tensor:
        cos, sin = rope_tables(tokens.shape[1], self.cfg.head_dim, self.cfg.rope_base, tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def build_model(cfg: ModelConfig, backend: str, seed: int, device) -> GPT:
    """Initialised on the CPU from ``seed``, then moved: every backend starts from the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg, backend)
    return model.to(device)
