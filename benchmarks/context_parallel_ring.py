"""PyTorch's own context parallelism as a baseline: ring attention over SDPA
(`torch.distributed.tensor.experimental.context_parallel`), causal only.

Inside ``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` PyTorch patches
``F.scaled_dot_product_attention``: its inputs become DTensors sharded along dim 2 and SDPA's
flash / cuDNN / efficient kernels run as a ring (the K/V shards rotate by all-gather or
all-to-all, partial results merged by their LSE). With ``_cp_options.enable_load_balance`` and
``is_causal=True`` PyTorch uses its head-tail layout: rank r holds chunks r and 2W-1-r of the 2W
chunks, the layout of `flexmask.distributed.shard`, so both providers time the same shards.

The context shards its ``buffers`` in place; here the only buffer is a small marker tensor of
S positions (it fixes S, hence the layout), and the q, k, v shards are cut by `fmd.shard`.
Backward must run inside the context too (the DTensor dispatch of SDPA's backward ops is only
installed there), so `ring_context` wraps the whole timed forward + backward.

GQA: ``enable_gqa=True`` passes Hkv-headed K/V to the ring (PyTorch's flash kernel takes GQA
natively), the "native" variant; "repeat" repeats K/V to Hq heads first (``repeat_interleave``,
inside autograd, so the ring rotates Hq/Hkv times more bytes). Which one ran is in the row.
"""

from __future__ import annotations

import contextlib

import torch

BACKENDS = ("flash", "cudnn", "efficient")
ROTATE_METHODS = ("allgather", "alltoall")
GQA_MODES = ("native", "repeat")


def variant_name(backend: str, rotate: str, gqa: str, heads: int, kv_heads: int) -> str:
    if heads == kv_heads:
        kv = "MHA"
    elif gqa == "native":
        kv = f"GQA {heads}/{kv_heads} native (enable_gqa)"
    else:
        kv = f"GQA: K/V repeated to {heads} heads"
    return f"sdpa {backend}, rotate {rotate}, head-tail layout, {kv}"


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def device_mesh(device: torch.device, world: int):
    """The 1-D mesh of the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,))


@contextlib.contextmanager
def ring_context(mesh, seq_len: int, backend: str, rotate: str):
    """PyTorch's context parallelism around SDPA (load-balanced, `rotate` method) with only SDPA
    backend `backend` allowed; restores PyTorch's options on exit."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
    from torch.nn.attention import sdpa_kernel

    if rotate not in ROTATE_METHODS:
        raise ValueError(f"rotate must be one of {ROTATE_METHODS}, got {rotate!r}")
    saved = (_cp_options.enable_load_balance, _cp_options.rotate_method)
    _cp_options.enable_load_balance = True
    set_rotate_method(rotate)
    marker = torch.zeros(1, seq_len, dtype=torch.uint8, device=mesh.device_type)
    try:
        with context_parallel(mesh, buffers=[marker], buffer_seq_dims=[1], no_restore_buffers={marker}), \
                sdpa_kernel([_sdpa_backend(backend)]):
            yield
    finally:
        _cp_options.enable_load_balance, _cp_options.rotate_method = saved


def ring_attention(gqa: str):
    """attn(q, k, v) -> out on this rank's shards (call inside `ring_context`): causal SDPA,
    GQA by `gqa` ("native" or "repeat")."""
    if gqa not in GQA_MODES:
        raise ValueError(f"gqa must be one of {GQA_MODES}, got {gqa!r}")

    def attn(q, k, v):
        group = q.shape[1] // k.shape[1]
        if gqa == "repeat" and group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # looked up at call time: context_parallel replaces the attribute of torch.nn.functional
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

    return attn


def ring_bytes_moved(seq_len: int, world: int, batch: int, heads: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype, gqa: str) -> dict[str, int]:
    """K/V bytes the ring's forward moves over all ranks: every rank receives every other rank's
    whole K and V shard (2 chunks each), as in an all-gather; Hq heads of them when repeated."""
    from flexmask.distributed import context_plan

    heads_moved = heads if gqa == "repeat" else kv_heads
    moved = context_plan(None, seq_len, world).bytes_moved(batch, heads_moved, head_dim, dtype)
    return {"kv_chunks_moved": moved["kv_chunks_all_gather"], "kv_chunks_all_gather": moved["kv_chunks_all_gather"],
            "forward_bytes": moved["all_gather_forward_bytes"]}
