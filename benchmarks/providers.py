"""The attention implementations under test, behind one small interface.

`Provider.prepare(setup)` builds whatever the provider needs outside the timed region (the
flexmask tile tables, FlexAttention's BlockMask, a dense boolean mask) and returns a
`Prepared`: the attention callable ``attn(q, k, v) -> out`` plus the mask build time and the
mask memory. `Provider.applies(case)` says whether it can express the mask at all (no row
when not), `Provider.skip_reason(setup)` why it cannot run this configuration (a SKIP row),
`Provider.missing()` why it cannot run here at all (not installed: benchmarks.run leaves it out).

  flexmask     flexmask.attention with a CompiledMask from flexmask.compile_mask (fused backward,
               deterministic=False)
  flexmask_det the same with deterministic=True (two-pass backward, bitwise reproducible)
  flex         torch.compile(flex_attention) with a BlockMask from create_block_mask(_compile=True),
               whose mask_mod reads the same canonical column intervals as flexmask
  flex_native  the same with each family's hand-written mask_mod (optional: it compiles
               FlexAttention once per family and shape)
  sdpa_cudnn   SDPA's cuDNN backend (full and causal only)
  sdpa_flash   SDPA's flash backend (full and causal only)
  sdpa_mask    SDPA's memory-efficient backend with a dense boolean mask, where it fits
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .families import Case
from .timing import time_host

GIB = 1 << 30


@dataclass
class Setup:
    """One benchmark configuration: a mask case at one shape, on one device."""

    case: Case
    intervals: torch.Tensor  # canonical int32 [B|1, H|1, S, 4] on `device`
    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    build_reps: int = 10
    dense_budget_bytes: float = 8 * GIB


@dataclass
class Prepared:
    attn: Callable  # (q, k, v) -> out
    build_ms: float | None = None  # mask build, warm (from the user-facing description)
    build_iv_ms: float | None = None  # flexmask only: build from the intervals tensor
    mask_bytes: int | None = None
    info: dict = field(default_factory=dict)


class Provider:
    name = ""
    label = ""

    def applies(self, case: Case) -> bool:
        return True

    def skip_reason(self, setup: Setup) -> str | None:
        return None

    def missing(self) -> str | None:
        """None when this provider can be imported here, else why not, in one line."""
        return None

    def prepare(self, setup: Setup) -> Prepared:
        raise NotImplementedError


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Flexmask(Provider):
    name, label = "flexmask", "flexmask"
    deterministic = False

    def prepare(self, setup: Setup) -> Prepared:
        import flexmask
        from flexmask import masks

        s, dev = setup.seqlen, setup.device
        cm = flexmask.compile_mask(setup.case.make(), s, s, device=dev)
        build_ms = time_host(lambda: flexmask.compile_mask(setup.case.make(), s, s, device=dev),
                             setup.build_reps, device=dev)
        lts, lte, uts, ute = setup.intervals.unbind(-1)
        build_iv_ms = time_host(
            lambda: flexmask.compile_mask(masks.column_intervals(lts, lte, uts, ute), s, s, device=dev),
            setup.build_reps, device=dev,
        )
        summary = cm.summary()
        info = {k: summary[k] for k in ("full", "partial", "skip")}
        return Prepared(
            attn=lambda q, k, v: flexmask.attention(q, k, v, mask=cm, deterministic=self.deterministic),
            build_ms=build_ms,
            build_iv_ms=build_iv_ms,
            mask_bytes=summary["table_bytes"],  # every tensor of the CompiledMask, intervals included
            info=info,
        )


def intervals_mask_mod(intervals: torch.Tensor, heads: int) -> tuple[Callable, list[torch.Tensor]]:
    """A FlexAttention mask_mod equivalent to canonical column intervals [B|1, H|1, S, 4]:
    query q attends key kv unless q lies in [LTS, LTE) or [UTS, UTE) of column kv. A size-1
    batch or head dimension is indexed at 0; a head dimension of Hkv < heads is shared by each
    query group. Returns the mask_mod and the tensors it reads."""
    bm, hm = intervals.shape[:2]
    if hm != 1 and heads % hm != 0:
        raise ValueError(f"intervals with {hm} heads do not fit {heads} query heads")
    per_batch, per_head, group = bm > 1, hm > 1, heads // hm
    # the broadcast dimensions dropped, so that every index is one of the function's arguments:
    # FlexAttention's FLASH backend traces the mask_mod with CuTe, which indexes by its own
    # values only (a literal 0 there failed: "Expected TensorSSA, but got int")
    planes = [intervals[..., i] for i in range(4)]  # [Bm, Hm, S]
    planes = [(p if per_head else p[:, 0]) for p in planes]
    lts, lte, uts, ute = planes = [(p if per_batch else p[0]).contiguous() for p in planes]

    def mask_mod(b, h, q_idx, kv_idx):
        at = ((b,) if per_batch else ()) + (((h // group if group > 1 else h),) if per_head else ()) + (kv_idx,)
        lower = (q_idx >= lts[at]) & (q_idx < lte[at])
        upper = (q_idx >= uts[at]) & (q_idx < ute[at])
        return ~(lower | upper)

    return mask_mod, planes


@functools.cache
def compiled_flex_attention() -> Callable:
    import torch._functorch.config as functorch_config
    from torch.nn.attention.flex_attention import flex_attention

    # the timing loop replays backward with retain_graph=True, which donated buffers forbid
    functorch_config.donated_buffer = False
    return torch.compile(flex_attention, dynamic=False)


def build_block_mask(mask_mod: Callable, batch: int | None, heads: int | None, seqlen: int, device):
    """create_block_mask with its compiled path (`_compile=True`, or torch.compile where that
    flag is gone)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if "_compile" in inspect.signature(create_block_mask).parameters:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return create_block_mask(mask_mod, batch, heads, seqlen, seqlen, device=device, _compile=True)
    return _compiled_create_block_mask()(mask_mod, batch, heads, seqlen, seqlen, device=device)


@functools.cache
def _compiled_create_block_mask() -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def _closure_tensors(fn: Callable, seen: set | None = None) -> list[torch.Tensor]:
    """Tensors a mask_mod reads through its closure (nested functions included)."""
    seen = set() if seen is None else seen
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)
        elif callable(value) and getattr(value, "__closure__", None) and id(value) not in seen:
            seen.add(id(value))
            found += _closure_tensors(value, seen)
    return found


class Flex(Provider):
    name, label = "flex", "FlexAttention"

    def missing(self) -> str | None:
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as err:
            return f"FlexAttention is not importable in torch {torch.__version__} ({err})"
        return None

    def mask_mod(self, setup: Setup) -> Callable:
        return intervals_mask_mod(setup.intervals, setup.heads)[0]

    def prepare(self, setup: Setup) -> Prepared:
        iv, s, dev = setup.intervals, setup.seqlen, setup.device
        mask_batch = 1 if iv.shape[0] == 1 else setup.batch
        mask_heads = 1 if iv.shape[1] == 1 else setup.heads
        mask_mod = self.mask_mod(setup)
        block_mask = build_block_mask(mask_mod, mask_batch, mask_heads, s, dev)
        build_ms = time_host(lambda: build_block_mask(mask_mod, mask_batch, mask_heads, s, dev),
                             setup.build_reps, device=dev)
        # the BlockMask's tensors plus what its mask_mod reads on partial blocks
        mask_bytes = _tensor_bytes(block_mask.as_tuple()) + _tensor_bytes(_closure_tensors(mask_mod))
        flex = compiled_flex_attention()
        gqa = setup.heads != setup.kv_heads
        return Prepared(
            attn=lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=gqa),
            build_ms=build_ms,
            mask_bytes=mask_bytes,
        )


class FlexNative(Flex):
    name, label = "flex_native", "FlexAttention (hand-written mask_mod)"

    def applies(self, case: Case) -> bool:
        from .flex_masks import NATIVE_KINDS

        return case.make().kind in NATIVE_KINDS

    def mask_mod(self, setup: Setup) -> Callable:
        from .flex_masks import native_mask_mod

        return native_mask_mod(setup.case.make(), setup.seqlen, setup.device)


def _gqa_kwargs(setup: Setup) -> dict:
    return {"enable_gqa": True} if setup.heads != setup.kv_heads else {}


class SdpaBackend(Provider):
    """An SDPA backend forced with `sdpa_kernel`; only the masks SDPA expresses natively."""

    def __init__(self, name: str, backend: str, label: str) -> None:
        self.name, self.backend, self.label = name, backend, label

    def applies(self, case: Case) -> bool:
        return case.family in ("full", "causal")

    def missing(self) -> str | None:
        try:
            from torch.nn.attention import SDPBackend
        except ImportError as err:
            return f"torch {torch.__version__} has no torch.nn.attention ({err})"
        if not hasattr(SDPBackend, self.backend):
            return f"torch {torch.__version__}'s SDPA has no {self.backend} backend"
        return None

    def prepare(self, setup: Setup) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        backend = getattr(SDPBackend, self.backend)
        causal = setup.case.family == "causal"
        kwargs = _gqa_kwargs(setup)

        def attn(q, k, v):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=causal, **kwargs)

        return Prepared(attn=attn, mask_bytes=0)


def dense_mask(intervals: torch.Tensor, q_len: int, heads: int, rows_per_chunk: int = 2048) -> torch.Tensor:
    """Boolean [B|1, H|1, q_len, kv_len] (True = attend), built in row chunks."""
    iv = intervals
    if iv.shape[1] not in (1, heads):
        iv = iv.repeat_interleave(heads // iv.shape[1], dim=1)
    bm, hm, kv_len, _ = iv.shape
    out = torch.empty(bm, hm, q_len, kv_len, dtype=torch.bool, device=iv.device)
    lts, lte, uts, ute = (iv[..., i].unsqueeze(-2) for i in range(4))  # [Bm, Hm, 1, Sk]
    for r0 in range(0, q_len, rows_per_chunk):
        rows = torch.arange(r0, min(q_len, r0 + rows_per_chunk), device=iv.device).view(1, 1, -1, 1)
        masked = ((rows >= lts) & (rows < lte)) | ((rows >= uts) & (rows < ute))
        out[:, :, r0:r0 + rows.shape[2]] = ~masked
    return out


class SdpaDenseMask(Provider):
    name, label = "sdpa_mask", "SDPA mem-efficient + dense bool mask"

    @staticmethod
    def _bytes_needed(setup: Setup) -> int:
        iv = setup.intervals
        hm = 1 if iv.shape[1] == 1 else setup.heads
        # the bool mask, plus the additive bf16/fp16 bias SDPA makes from it on every call
        elems = iv.shape[0] * hm * setup.seqlen * setup.seqlen
        return elems * (1 + max(2, torch.finfo(setup.dtype).bits // 8))

    def skip_reason(self, setup: Setup) -> str | None:
        need = self._bytes_needed(setup)
        if need > setup.dense_budget_bytes:
            return f"dense mask needs ~{need / GIB:.1f} GiB > budget {setup.dense_budget_bytes / GIB:.1f} GiB"
        return None

    def prepare(self, setup: Setup) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        holder = []  # built once (it can be GiBs): the build time is a cold one
        build_ms = time_host(lambda: holder.append(dense_mask(setup.intervals, setup.seqlen, setup.heads)),
                             reps=1, warm=0, device=setup.device)
        dense = holder[0]
        kwargs = _gqa_kwargs(setup)

        def attn(q, k, v):
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return sdpa(q, k, v, attn_mask=dense, **kwargs)

        return Prepared(attn=attn, build_ms=build_ms, mask_bytes=_tensor_bytes([dense]))


class FlexmaskDeterministic(Flexmask):
    name, label = "flexmask_det", "flexmask (deterministic)"
    deterministic = True


def registry() -> dict[str, Provider]:
    """Every provider by name, in the order they run (flexmask and FlexAttention first)."""
    providers = [
        Flexmask(),
        FlexmaskDeterministic(),
        Flex(),
        FlexNative(),
        SdpaBackend("sdpa_cudnn", "CUDNN_ATTENTION", "SDPA cuDNN"),
        SdpaBackend("sdpa_flash", "FLASH_ATTENTION", "SDPA flash"),
        SdpaDenseMask(),
    ]
    return {p.name: p for p in providers}
