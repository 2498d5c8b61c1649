"""Public entry points: validation with clear errors, mask resolution, dispatch. No math here."""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import numbers
from typing import Optional, Sequence

import torch
from torch import Tensor

from .autograd import (_backward_impl, _forward_impl, _terms, attention_eager, attention_fwd, attention_in_pieces,
                       op_outputs, reorder)
from .kernels.common.gather import gather_rows
from .kernels.common.score_terms import ScoreTerms
from .kernels.common.tiles import default_tile, is_valid_tile
from .kernels.decode import configs as decode_configs
from .kernels.decode import steps as decode_steps
from .kernels.decode.split_kv import decode_forward, decode_fwd, decode_step, mask_view
from .kernels.dispatch import split_kv_plan
from .kernels.forward.portable import _forward_kernel
from .lse_merge import MergeByLse
from .masks import natten_order, natten_pieces, specs, token_order, token_order_kernels
from .masks.run_bounds import MAX_RUNS_LIMIT, TooManyRuns
from .masks.compiled_cache import (CompiledCache, Unkeyable, built_in_graph, spec_from_key, structural_key,
                                   tensor_versions, traceable_key)
from .masks.compiler import CompiledMask, compile_canonical, compile_spec

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def compile_mask(mask, q_len: int, kv_len: int, device=None, *, block_m: int | None = None,
                 block_n: int | None = None) -> CompiledMask:
    """Compile a mask for one (q_len, kv_len, device) into tile tables, once; pass the result
    as `mask=` to every layer of that shape (and it serves the backward pass too).

    `device` defaults to CUDA when available. `block_m` x `block_n` is the tile of the tables
    (powers of two in [16, 256]; the default suits the kernels on that device).
    """
    if mask is None:
        mask = specs.full()
    if isinstance(mask, CompiledMask):
        raise TypeError("mask is already a CompiledMask; pass it to flexmask.attention directly")
    if not isinstance(mask, specs.Mask):
        raise TypeError(f"mask must be a flexmask.masks.Mask or None, got {_describe_mask(mask)}")
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    q_len, kv_len = int(q_len), int(kv_len)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise ValueError(f"device must be a torch.device or a device string such as 'cuda', got {device!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} asks for CUDA, which is not available here (compile for the "
                         f"device of the inputs: 'cpu' under TRITON_INTERPRET=1)")
    default_m, default_n = default_tile(device)
    block_m = default_m if block_m is None else block_m
    block_n = default_n if block_n is None else block_n
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, int) or not is_valid_tile(value):
            raise ValueError(f"{name} must be a power of two in [16, 256], got {value!r}")
    if natten_order.is_dilated_natten(mask):
        return _compiled_dilated_natten(mask, q_len, kv_len, device, block_m, block_n)
    if natten_pieces.needs_pieces(mask):
        return _compiled_in_pieces(mask, q_len, kv_len, device, block_m, block_n)
    compiled = compile_spec(mask, q_len, kv_len, device, block_m, block_n)  # no host sync on a GPU
    if q_len != kv_len or q_len < token_order.MIN_TOKENS:
        return compiled
    # flexmask.attention takes the global tokens first (masks/token_order.py): those of a spec
    # `x | global_tokens(P)`, or those found in the runs of a from_mask_mod or k-run mask (whose
    # compile read its runs on the host already), where the new order visits fewer tiles or fewer
    # PARTIAL ones, and no more
    found = _global_tokens_first(mask, compiled, device, block_m, block_n)
    if found is not None and token_order.fewer_tiles(found[0], compiled):
        compiled.token_order = found
    return compiled


def _global_tokens_first(mask, compiled: CompiledMask, device: torch.device, block_m: int,
                         block_n: int) -> tuple | None:
    """(tables, order, inverse) of a self-attention mask with its global tokens first
    (masks/token_order.py), or None where it has none to move. On a GPU the tokens of a spec
    `x | global_tokens(P)` and of a mask_mod are found in the compiled runs by the kernels of
    masks/token_order_kernels.py (three launches and one host read), and the moved runs compile as
    they come where they fit two a column; where they do not, and off a GPU, by torch ops."""
    seq_len = compiled.q_len
    from_function = token_order.holds_mask_mod(mask)
    named = token_order.global_positions(mask) is not None
    searched, more_runs = compiled.free_columns is not False, False
    if (named or from_function) and searched and _order_on_device(compiled.intervals):
        front = token_order_kernels.front_runs(compiled.intervals, seq_len, any_count=named)
        if front is None:
            return None
        if front.intervals is not None:
            tables = compile_canonical(front.intervals, seq_len, seq_len, block_m, block_n)
            return tables, front.order, front.inverse
        more_runs = True  # the tokens exist and their moved runs need k slots: no merge, no free-column read
    found = token_order.reordered(mask, seq_len, device)
    if found is None and (compiled.runs > 2 or from_function) and searched:
        found = token_order.reordered_runs(compiled.intervals, seq_len, merge=from_function and not more_runs,
                                           free=True if more_runs else compiled.free_columns)
    if found is None:
        return None
    spec, order, inverse = found
    return compile_spec(spec, seq_len, seq_len, device, block_m, block_n), order, inverse


def _order_on_device(intervals: torch.Tensor) -> bool:
    """Whether global tokens are found by the Triton kernels (on a GPU; the CPU tests take them
    under the interpreter by patching this)."""
    return intervals.is_cuda


def _compiled_dilated_natten(mask, q_len: int, kv_len: int, device: torch.device, block_m: int,
                             block_n: int) -> CompiledMask:
    """A self-attention dilated natten's CompiledMask (masks/natten_order.py): in the tokens' own
    order with the sub-image order beside it where that visits fewer tiles (from MIN_TOKENS
    tokens), or in the sub-image order alone where a column of the own order needs more runs than
    a column holds: counted below MIN_TOKENS tokens; from them on, wherever the bound from the
    parameters passes it (the own order's runs, bound x tokens of them, are not built to be
    counted)."""
    if q_len != kv_len:
        try:
            return compile_spec(mask, q_len, kv_len, device, block_m, block_n)
        except TooManyRuns as err:
            raise TooManyRuns(f"{err}; a dilated natten takes its sub-image token order, where it fits, in "
                              f"self-attention only (q_len == kv_len), got q_len={q_len}, kv_len={kv_len}") from None
    seq_len, natural = q_len, None
    if not natten_order.natural_may_not_fit(mask):
        natural = compile_spec(mask, seq_len, seq_len, device, block_m, block_n)
        if seq_len < token_order.MIN_TOKENS:
            return natural
    elif seq_len < token_order.MIN_TOKENS:
        try:
            return compile_spec(mask, seq_len, seq_len, device, block_m, block_n)
        except TooManyRuns:
            pass
    spec, order, inverse = natten_order.reordered(mask, seq_len, device)
    try:
        tables = compile_spec(spec, seq_len, seq_len, device, block_m, block_n)
    except TooManyRuns as err:  # (its columns named in the sub-image order)
        raise TooManyRuns(f"{mask!r} needs more masked runs a column than a column holds in its sub-image token "
                          f"order too: {err}") from None
    if natural is None:
        return dataclasses.replace(tables, source=mask, token_order=(tables, order, inverse), in_token_order=True)
    if token_order.fewer_tiles(tables, natural):
        natural.token_order = (tables, order, inverse)
    return natural


def _compiled_in_pieces(mask, q_len: int, kv_len: int, device: torch.device, block_m: int,
                       block_n: int) -> CompiledMask:
    """A natten past the runs a column holds, as the CompiledMasks of its two pieces
    (masks/natten_pieces.py), which flexmask.attention runs and merges."""
    try:
        parts = tuple(compile_mask(p, q_len, kv_len, device=device, block_m=block_m, block_n=block_n)
                      for p in natten_pieces.pieces(mask))
    except TooManyRuns as err:
        raise TooManyRuns(f"{mask!r} needs more masked runs a column than a column holds, in each of its two "
                          f"pieces too (query rows up to the key's image row, and past it): {err}") from None
    return dataclasses.replace(parts[0], source=mask, token_order=None, pieces=parts)


def _check_mask_at_length_zero(mask, q_len: int, kv_len: int, device: torch.device, batch: int, hq: int,
                               hkv: int) -> None:
    """`_resolve_mask`'s and `_check_mask_heads`' checks without a compile (inputs of length 0,
    where nothing is computed and no tables can be built): a spec's intervals at these lengths
    (cheap: O(kv_len)) raise what a compile would (kv_lengths past kv_len, ...), and their batch
    and heads must fit the inputs."""
    if isinstance(mask, CompiledMask):
        _resolve_mask(mask, q_len, kv_len, device)
    elif mask is not None and not isinstance(mask, specs.Mask):
        raise TypeError(f"mask must be None, a flexmask.masks.Mask or a CompiledMask, got {_describe_mask(mask)}")
    elif mask is not None and not torch.compiler.is_compiling():
        intervals = mask.intervals(q_len, kv_len, device)
        _check_mask_heads(intervals.shape[0], intervals.shape[1], batch, hq, hkv, mask)


def _resolve_mask(mask, q_len: int, kv_len: int, device: torch.device) -> CompiledMask:
    if isinstance(mask, CompiledMask):
        if (mask.q_len, mask.kv_len) != (q_len, kv_len):
            raise ValueError(
                f"mask was compiled for (q_len, kv_len)=({mask.q_len}, {mask.kv_len}), "
                f"got q_len={q_len}, kv_len={kv_len}"
            )
        if mask.device != device:
            raise ValueError(f"mask was compiled for device {mask.device}, got inputs on {device}")
        return mask
    if mask is not None and not isinstance(mask, specs.Mask):
        raise TypeError(f"mask must be None, a flexmask.masks.Mask or a CompiledMask, got {_describe_mask(mask)}")
    spec = _FULL if mask is None else mask
    shape_key = (q_len, kv_len, device.type, device.index)
    compiled = COMPILED.get(spec, shape_key, lambda: compile_mask(spec, q_len, kv_len, device=device))
    if compiled is not None:
        return compiled
    cache = spec._compiled_cache  # a spec the structural key does not cover (a GPU tensor in it)
    shape_key += tensor_versions(spec)  # a tensor changed in place since is another mask: never served stale
    if shape_key not in cache:
        if len(cache) >= 16:  # a bounded cache: masks are usually reused for a few shapes
            cache.pop(next(iter(cache)))
        cache[shape_key] = compile_mask(spec, q_len, kv_len, device=device)
    return cache[shape_key]


_FULL = specs.full()
# equal specs share their tables: `mask=masks.causal()` in the call costs what a compiled mask costs
COMPILED = CompiledCache(size=64)


def _describe_mask(mask) -> str:
    """What was passed as a mask, with the likely fix for the two common slips."""
    if callable(mask) and getattr(mask, "__module__", "") == specs.__name__:
        return f"the builder masks.{mask.__name__} itself (call it: masks.{mask.__name__}(...))"
    if isinstance(mask, torch.Tensor):
        return (f"a {tuple(mask.shape)} {mask.dtype} tensor (dense masks are not taken: build the mask from "
                f"flexmask.masks, e.g. masks.column_intervals(...) for per-column row intervals)")
    return type(mask).__name__


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, H, S, D), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    device = q.device
    if k.device != device or v.device != device:
        raise ValueError(f"q, k and v must be on one device, got q={device}, k={k.device}, v={v.device}")
    qs, ks, vs = q.shape, k.shape, v.shape
    if ks != vs:
        if ks[:3] == vs[:3]:  # the head dims differ: name the one that disagrees with q
            if ks[3] == qs[3]:
                raise ValueError(f"v's head dim Dv must equal D (the head dim of q and k), got Dv={vs[3]}, D={ks[3]}")
            raise ValueError(f"k's head dim must equal q's (and v's), got q={qs[3]}, k={ks[3]}, v={vs[3]}")
        raise ValueError(f"k and v must have the same shape (B, Hkv, Sk, D), got k={tuple(ks)}, v={tuple(vs)}")
    if qs[0] != ks[0]:
        raise ValueError(f"q and k must have the same batch size, got q={qs[0]}, k={ks[0]}")
    if qs[3] != ks[3]:
        raise ValueError(f"q and k must have the same head dim, got q={qs[3]}, k={ks[3]}")
    hq, hkv = qs[1], ks[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"the number of query heads must be a multiple of the KV heads, got Hq={hq}, Hkv={hkv}")
    if not 1 <= qs[3] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {MAX_HEAD_DIM}], got {qs[3]}")
    if device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"q is on {device}: the flexmask kernels run on CUDA, or on the CPU only under the Triton "
            f"interpreter (set TRITON_INTERPRET=1 before importing flexmask)"
        )


def _check_score_terms(softcap, alibi_slopes, sinks, batch: int, hq: int, device: torch.device) -> float:
    """Validates the score terms (DESIGN.md section 1); returns softcap as a float (0 = off)."""
    if softcap is None:
        softcap = 0.0
    softcap = _plain_number(softcap)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0 = off), got {type(softcap).__name__} {softcap!r}")
    if softcap < 0 or not softcap < math.inf:  # negative, inf or NaN (comparisons: traceable by dynamo)
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    for name, t, shapes in (("alibi_slopes", alibi_slopes, ((hq,), (batch, hq))), ("sinks", sinks, ((hq,),))):
        if t is None:
            continue
        want = _shapes_text(shapes) if not isinstance(t, torch.Tensor) or tuple(t.shape) not in shapes else ""
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a float32 tensor of shape {want}, got {type(t).__name__}")
        if tuple(t.shape) not in shapes:
            raise ValueError(f"{name} must have shape {want} (Hq={hq}" + (f", B={batch}" if len(shapes) > 1 else "")
                             + f"), got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} must be on the device of q ({device}), got {t.device}")
    return float(softcap)


def _plain_number(value):
    """A numpy scalar as the Python number it holds (SDPA and FlashAttention take them too);
    anything else unchanged."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


def _shapes_text(shapes) -> str:  # only for an error: dynamo does not trace str() of a tuple
    return " or ".join(str(s) for s in shapes)


def _interpreting() -> bool:
    return type(_forward_kernel).__name__ == "InterpretedFunction"


def _check_mask_heads(mask_batch: int, mask_heads: int, batch: int, hq: int, hkv: int, mask=None) -> None:
    if mask_batch not in (1, batch):
        raise ValueError(f"mask has batch size {mask_batch}; expected 1 or B={batch}"
                         + _cache_rows_hint(mask, mask_batch))
    if mask_heads not in (1, hq, hkv):
        raise ValueError(f"mask has {mask_heads} heads; expected 1, Hq={hq} or Hkv={hkv}")


def _cache_rows_hint(mask, mask_batch: int) -> str:
    """Where a mask's batch rows come from a masks.kv_cache (a spec, or a CompiledMask's source),
    the words that name kv_lengths in the batch error; "" otherwise."""
    stack = [mask.source if isinstance(mask, CompiledMask) else mask]
    while stack:
        m = stack.pop()
        if not isinstance(m, specs.Mask):
            continue
        if m.kind in ("and", "or"):
            stack += [m.a, m.b]
        elif m.kind == "kv_cache" and len(m.params()["kv_lengths"]) == mask_batch:
            return f" (kv_lengths of its masks.kv_cache holds {mask_batch} lengths: it takes one per batch row)"
    return ""


def _table_args(cm: CompiledMask) -> tuple:
    """What the custom op takes from a CompiledMask: its tables, then (batch, heads, tile, tiles visited)."""
    if cm.pieces is not None:
        raise ValueError(
            f"mask: {cm.source!r} is compiled as {len(cm.pieces)} pieces (a key column needs more than "
            f"{MAX_RUNS_LIMIT} masked runs; masks/natten_pieces.py): flexmask.attention runs each and merges "
            f"them, and no other path can use them"
        )
    if cm.in_token_order:
        raise ValueError(
            f"mask: {cm.source!r} has tables in its sub-image token order only (a key column needs more than "
            f"{MAX_RUNS_LIMIT} masked runs in the tokens' own order): flexmask.attention takes that order for self-attention "
            f"without alibi_slopes (ALiBi's distances are the tokens' own positions), and no other path can use it"
        )
    return (
        cm.kernel_intervals, cm.fwd_offsets, cm.fwd_num_full, cm.fwd_blocks,
        cm.bwd_offsets, cm.bwd_num_full, cm.bwd_blocks,
        cm.batch, cm.heads, cm.block_m, cm.block_n, cm.num_tiles_visited,
    )


@torch.compiler.assume_constant_result
def _spec_table_args(mask, q_len: int, kv_len: int, device: torch.device) -> tuple:
    """Under torch.compile, a mask spec is compiled while the graph is traced (cached on the
    spec as in eager mode) and its tables enter the graph as constants: the compilation's
    data-dependent sizes never reach the tracer."""
    return _table_args(_resolve_mask(mask, q_len, kv_len, device))


@torch.compiler.assume_constant_result
def _key_table_args(key: tuple, q_len: int, kv_len: int, device: torch.device) -> tuple:
    """`_spec_table_args` for a spec written inside the compiled region, by its structural key:
    dynamo hands such an object over without the attributes it set while tracing, so the spec is
    rebuilt from the key (or found in the cache by it)."""
    return _table_args(_compiled_by_key(key, q_len, kv_len, device))


def _compiled_by_key(key: tuple | None, q_len: int, kv_len: int, device: torch.device,
                     tensors: Sequence[Tensor] = ()) -> CompiledMask:
    """The shared CompiledMask of the spec a traceable key describes (None: full attention); with
    `tensors`, of the spec rebuilt from the key and those tensors as they hold now (cached by
    their content where `structural_key` reads it, never by the key alone)."""
    if key is None:
        return _resolve_mask(None, q_len, kv_len, device)
    if tensors:
        return _resolve_mask(spec_from_key(key, tensors), q_len, kv_len, device)
    shape_key = (q_len, kv_len, device.type, device.index)
    return COMPILED.get_by_key(key, shape_key, lambda: compile_mask(spec_from_key(key), q_len, kv_len, device=device))


# --- Masks written inside torch.compile, by key: one graph for every length ---------------------
# A spec whose key holds plain values (causal, a window, documents of fixed lengths) enters the
# graph as a string, and the op compiles (or finds) its tables for the lengths it is called with,
# at run time: the graph holds no tables, so a new sequence length reuses it (dynamic shapes)
# instead of compiling another graph with other constant tables.


@torch.compiler.assume_constant_result
def _key_string(key: tuple) -> str:
    return repr(key)


@functools.lru_cache(maxsize=256)
def _parse_key(mask_key: str):
    return ast.literal_eval(mask_key)


def _is_literal(key) -> bool:
    """Whether a traceable key holds plain values only (no symbolic size: a mask that depends
    on the length, such as documents cut from it, is a different mask at each length)."""
    if isinstance(key, tuple):
        return all(_is_literal(x) for x in key)
    return key is None or type(key) in (bool, int, float, str)


@torch.library.custom_op("flexmask::attention_by_key", mutates_args=())
def attention_by_key(q: Tensor, k: Tensor, v: Tensor, mask_key: str, mask_tensors: list[Tensor], scale: float,
                     deterministic: int, split_kv: int, softcap: float, alibi_slopes: Optional[Tensor],
                     sinks: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(out, lse) of the mask `mask_key` names (`_key_string`; "None": full attention) with the
    tensors it holds (a spec built in the compiled region: traceable_key), its tables resolved for
    these lengths when the op runs; `split_kv` allows the split-KV path (no gradient will be
    asked)."""
    cm = _compiled_by_key(_parse_key(mask_key), q.shape[2], k.shape[2], q.device, mask_tensors)
    found = _by_key_order(cm, alibi_slopes)
    tables = _table_args(cm if found is None else found[0])
    _check_mask_heads(tables[7], tables[8], q.shape[0], q.shape[1], k.shape[1])
    if found is not None:  # the order flexmask.attention takes in eager mode (global tokens first, ...)
        order, inverse = found[1:]
        out, lse = _forward_impl(*(gather_rows(t, order, like=t) for t in (q, k, v)), *tables, scale,
                                 deterministic, softcap, alibi_slopes, sinks)
        return _gathered_back(out, q, inverse), lse.index_select(2, inverse)
    if split_kv:
        terms = ScoreTerms(softcap, alibi_slopes, sinks)
        plan = _split_kv_plan(q, k, v, tables, terms if terms.active else None)
        if plan is not None:
            return decode_forward(q, k, v, *tables[:4], *tables[7:11], scale, plan, softcap, alibi_slopes, sinks)
    return _forward_impl(q, k, v, *tables, scale, deterministic, softcap, alibi_slopes, sinks)


@attention_by_key.register_fake
def _(q, k, v, mask_key, mask_tensors, scale, deterministic, split_kv, softcap, alibi_slopes, sinks):
    b, h, s, _ = q.shape
    return torch.empty_like(q), q.new_empty(b, h, s, dtype=torch.float32)


@torch.library.custom_op("flexmask::attention_by_key_bwd", mutates_args=())
def attention_by_key_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor,
                         lse: Tensor, mask_key: str, mask_tensors: list[Tensor], scale: float, deterministic: int,
                         softcap: float, alibi_slopes: Optional[Tensor],
                         sinks: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks) of `attention_by_key`; dsinks is empty without sinks."""
    cm = _compiled_by_key(_parse_key(mask_key), q.shape[2], k.shape[2], q.device, mask_tensors)
    found = _by_key_order(cm, alibi_slopes)
    if found is None:
        return op_outputs(*_backward_impl(do, dlse, q, k, v, o, lse, *_table_args(cm), scale, deterministic, softcap,
                                          alibi_slopes, sinks))
    reordered, order, inverse = found  # the forward ran in this order: so does its backward
    gathered = [None if t is None else gather_rows(t, order, like=t) for t in (do, dlse, q, k, v, o, lse)]
    dq, dk, dv, dsinks = _backward_impl(*gathered, *_table_args(reordered), scale, deterministic, softcap,
                                        alibi_slopes, sinks)
    return op_outputs(_gathered_back(dq, q, inverse), _gathered_back(dk, k, inverse), _gathered_back(dv, v, inverse),
                      dsinks)


def _by_key_order(cm: CompiledMask, alibi_slopes) -> tuple | None:
    """(tables, order, inverse) of the token order the keyed ops run in, or None: the one
    flexmask.attention takes in eager mode (masks/token_order.py and natten_order.py; compile_mask
    sets it for self-attention only; not with ALiBi)."""
    return None if alibi_slopes is not None else cm.token_order


def _gathered_back(x: Tensor, like: Tensor, inverse: Tensor) -> Tensor:
    """x in the caller's token order and in `like`'s layout (the one the op's fake gives)."""
    return gather_rows(x, inverse, like=like)


@attention_by_key_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, mask_key, mask_tensors, scale, deterministic, softcap, alibi_slopes, sinks):
    dsinks = q.new_empty(q.shape[1] if sinks is not None else 0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _by_key_setup(ctx, inputs, output):
    q, k, v, mask_key, mask_tensors, scale, deterministic, _, softcap, alibi_slopes, sinks = inputs
    ctx.save_for_backward(q, k, v, *output, alibi_slopes, sinks, *mask_tensors)
    ctx.consts = (mask_key, scale, deterministic, softcap)


def _by_key_backward(ctx, do, dlse):
    q, k, v, o, lse, alibi_slopes, sinks, *mask_tensors = ctx.saved_tensors
    mask_key, scale, deterministic, softcap = ctx.consts
    if do is None:  # only the LSE was used
        do = torch.zeros_like(o)
    if dlse is not None:
        dlse = dlse.contiguous()
    dq, dk, dv, dsinks = attention_by_key_bwd(do, dlse, q, k, v, o, lse, mask_key, mask_tensors, scale, deterministic,
                                              softcap, alibi_slopes, sinks)
    return (dq, dk, dv, None, [None] * len(mask_tensors), None, None, None, None, None,
            dsinks if sinks is not None else None)


attention_by_key.register_autograd(_by_key_backward, setup_context=_by_key_setup)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def attention(q, k, v, mask=None, *, scale: float | None = None, return_lse: bool = False,
              deterministic: bool | None = None, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None):
    """Attention with a FlashMask-style column-interval mask.

    q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D) with Hq % Hkv == 0 (GQA/MQA by indexing). Any
    strides with a contiguous last dimension (a ``.transpose(1, 2)`` of (B, S, H, D) works
    without a copy). fp16/bf16 are the fast path; fp32 is computed exactly in fp32.
    Head dim D: any value in [1, 256] (powers of two from 16 waste nothing; other values are
    padded to the next one inside the kernel). v's head dim Dv must equal D (k and v have the
    same shape).

    On a CPU (no GPU): set TRITON_INTERPRET=1 in the environment before flexmask (or triton)
    is first imported and pass CPU tensors; the kernels then run in Triton's interpreter, exact
    but slow (seconds for a few hundred tokens), for tests and trying things out.

    mask: None (full attention), a `flexmask.masks.Mask` (compiled once per shape and device,
    then cached on the mask), or a `CompiledMask` from `flexmask.compile_mask`.
    When Sq != Sk, query row i sits at position ``i + Sk - Sq`` (bottom-right alignment)::

        causal(), Sq=2, Sk=5:   ####.
                                #####

    scale defaults to 1/sqrt(D). Rows that attend nothing give output 0 and LSE -inf (and zero
    gradients). Returns out (B, Hq, Sq, D), and with return_lse=True also the natural-log
    log-sum-exp (B, Hq, Sq) float32.

    Decoding: few queries against many keys (Sq <= 64 on a GPU) take a split-KV path
    (Flash-Decoding) when no gradient is needed; with gradients (q, k or v requiring grad under
    grad mode) the q-block path runs. Same results either way.

    deterministic: None follows torch.are_deterministic_algorithms_enabled() at this call;
    True gives gradients bitwise identical run to run (two-pass backward); False the fastest
    backward (dQ accumulated with fp32 atomics, last bits vary run to run).

    Score terms (FlashAttention's keyword names), applied in this order to s = scale * q_i . k_j:

    - softcap > 0: s = softcap * tanh(s / softcap) (Gemma-2 logit soft-capping; 0 = off);
    - alibi_slopes ((Hq,) or (B, Hq) float32): s -= slope[b, h] * |i + Sk - Sq - j| (query row i
      at its bottom-right position, as causal);
    - then the mask;
    - sinks ((Hq,) float32, learnable, as gpt-oss): the softmax denominator gains exp(sinks[h]),
      P_ij = exp(s_ij) / (exp(sinks[h]) + sum_j exp(s_ij)), and the LSE is log(exp(sinks[h]) +
      sum_j exp(s_ij)); a row that sees no key outputs 0 with LSE sinks[h]. A sink of -inf is no
      sink for its head; finite sinks must lie within +-2.3e38, as the kernels take them in log2
      units in fp32 (beyond, the LSE of a row that sees no key is -inf, or the row NaN for a
      positive sink: the values are not read on the host, which would sync).

    Gradients flow to q, k, v and sinks (not to the slopes or the cap). The terms run in the same
    kernels as inputs without them (the Gluon kernels on Hopper); split-KV decoding with a term
    takes its Triton kernel (kernels/dispatch.py).
    """
    # a decode step of a signature seen before (kernels/decode/steps.py): its plan kept, only launches
    step_key, compiling = None, torch.compiler.is_compiling()
    if (not compiling and alibi_slopes is None and sinks is None
            and (softcap is None or softcap.__class__ in (float, int) and softcap == 0)
            and return_lse.__class__ is bool and (deterministic is None or deterministic.__class__ is bool)):
        step_key = decode_steps.signature(q, k, v, mask, scale, _step_mask_key)
        step = decode_steps.find(step_key, q, k, v)
        if step is not None:
            out, lse = step(q, k, v, return_lse)
            return (out, lse) if return_lse else out
    _check_qkv(q, k, v)
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = _plain_number(scale)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if deterministic is None:  # resolved here, in Python, so the op gets a plain int (no graph break)
        deterministic = torch.are_deterministic_algorithms_enabled()
    elif not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be None or a bool, got {type(deterministic).__name__}")
    softcap = _check_score_terms(softcap, alibi_slopes, sinks, batch, hq, q.device)

    if sq == 0 or sk == 0:  # nothing to attend: zeros, LSE -inf (the sink with sinks), zero gradients
        _check_mask_at_length_zero(mask, sq, sk, q.device, batch, hq, hkv)
        # k and v take part through empty slices, so that they get zero gradients, as SDPA gives
        # them, not None (at Sq = 0 the output would not depend on them otherwise)
        out = q * 0.0 + k[:, :1, :0].sum() + v[:, :1, :0].sum()
        if sinks is None:
            lse = torch.full((batch, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
        else:
            lse = sinks.view(1, hq, 1).expand(batch, hq, sq).contiguous()
        return (out, lse) if return_lse else out
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().contiguous()  # no gradient to the slopes
    if sinks is not None:
        sinks = sinks.contiguous()
    terms = _terms(softcap, alibi_slopes, sinks)

    parts = _pieces(mask)
    if parts is not None:  # a mask as disjoint pieces (masks/natten_pieces.py): each one, then merged
        if compiling:  # each piece an op (by key for a spec), merged by a traced autograd function
            results = [attention(q, k, v, part, scale=scale, return_lse=True, deterministic=deterministic,
                                 softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks if i == 0 else None)
                       for i, part in enumerate(parts)]
            out, lse = MergeByLse.apply(*(r[0] for r in results), *(r[1] for r in results))
        else:
            tables = [_table_args(_resolve_mask(part, sq, sk, q.device)) for part in parts]
            for piece in tables:
                _check_mask_heads(piece[7], piece[8], batch, hq, hkv, mask)
            q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
            out, lse = attention_in_pieces(q, k, v, tables, (float(scale), int(deterministic)), softcap=softcap,
                                           alibi_slopes=alibi_slopes, sinks=sinks)
        return (out, lse) if return_lse else out

    resolved = None
    # global tokens first (masks/token_order.py): under torch.compile for a CompiledMask (its gathers
    # are traced); a spec written in the compiled region goes by key, and its op takes the order
    ordered = isinstance(mask, CompiledMask) or (mask is not None and not compiling)
    # (compile_mask sets an order from MIN_TOKENS tokens, or at any length for a dilated natten whose
    # columns do not fit in its own order)
    if ordered and sq == sk and alibi_slopes is None:
        resolved = _resolve_mask(mask, sq, sk, q.device)
        reordered = getattr(resolved, "token_order", None)
        if reordered is not None:
            cm, order, inverse = reordered
            q, k, v = (reorder(t, order, inverse) for t in (q, k, v))
            out, lse = attention(q, k, v, cm, scale=scale, return_lse=True, deterministic=deterministic,
                                 softcap=softcap, sinks=sinks)
            out, lse = reorder(out, inverse, order), reorder(lse, inverse, order)
            return (out, lse) if return_lse else out
    if compiling and not isinstance(mask, CompiledMask):
        key = None if mask is None else traceable_key(mask)
        mask_tensors = []
        if key is None and mask is not None and built_in_graph(mask):  # its tensors go to the op
            key = traceable_key(mask, mask_tensors)
            if key is None:  # a function (from_mask_mod) or another object no op can take
                raise ValueError("mask: a spec holding a function (masks.from_mask_mod) or another value that no op "
                                 "can take cannot be built inside torch.compile; build it outside the compiled "
                                 "function (or compile_mask it there) and pass it in")
        if mask is None or (key is not None and _is_literal(key)):  # by key: no tables in the graph
            q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
            split_kv = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                                         or (sinks is not None and sinks.requires_grad)))
            out, lse = attention_by_key(q, k, v, "None" if key is None else _key_string(key), mask_tensors,
                                        float(scale), int(deterministic), int(split_kv), softcap, alibi_slopes,
                                        sinks)
            return (out, lse) if return_lse else out
    if isinstance(mask, CompiledMask) or not compiling:
        tables = _table_args(resolved if resolved is not None else _resolve_mask(mask, sq, sk, q.device))
    else:  # a spec holding a tensor or a symbolic size, inside torch.compile: tables as constants
        # the tables are constants of one length: a symbolic length (dynamic shapes, after a new
        # length) is specialised, which dynamo does for len(range(n)) (int(n) would stay symbolic)
        key, lengths = None if mask is None else traceable_key(mask), (len(range(sq)), len(range(sk)))
        tables = (_spec_table_args(mask, *lengths, q.device) if key is None
                  else _key_table_args(key, *lengths, q.device))
    _check_mask_heads(tables[7], tables[8], batch, hq, hkv, mask)  # (mask batch, mask heads) follow the 7 tensors
    inputs = (q, k, v)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    plan = _split_kv_plan(q, k, v, tables, terms)
    if plan is not None:  # few queries, long keys, no gradient: Flash-Decoding
        if compiling:  # the op only for the compiler
            out, lse = decode_fwd(q, k, v, *tables[:4], *tables[7:11], float(scale), softcap, alibi_slopes, sinks)
        else:
            step = decode_step(q, k, v, mask_view(*tables[:4], *tables[7:11], sq, sk), float(scale), plan=plan,
                               terms=terms)
            if terms is None and step_key is not None and all(a is b for a, b in zip((q, k, v), inputs)):
                decode_steps.remember(step_key, step, q, k, v)  # planned once: kept for its signature's next calls
            out, lse = step(q, k, v, return_lse)
        return (out, lse) if return_lse else out
    if compiling:  # the op only for the compiler
        out, lse = attention_fwd(q, k, v, *tables, float(scale), int(deterministic), softcap, alibi_slopes, sinks)
    elif terms is None:
        out, lse = attention_eager(q, k, v, *tables, float(scale), int(deterministic))
    else:
        out, lse = attention_eager(q, k, v, *tables, float(scale), int(deterministic), softcap=softcap,
                                   alibi_slopes=alibi_slopes, sinks=sinks)
    return (out, lse) if return_lse else out


def chunk_attention(q, k, v, cm: CompiledMask, scale: float, softcap: float, alibi_slopes: Tensor,
                    alibi_shift: int) -> tuple[Tensor, Tensor]:
    """(out, lse) of `attention`'s eager path for a chunk of a longer sequence (context
    parallelism): query row 0 sits `alibi_shift` positions past key 0 in ALiBi's distances
    (|i + alibi_shift - j|, where `attention` takes Sk - Sq). The caller checked the terms."""
    _check_qkv(q, k, v)
    tables = _table_args(_resolve_mask(cm, q.shape[2], k.shape[2], q.device))
    _check_mask_heads(tables[7], tables[8], q.shape[0], q.shape[1], k.shape[1])
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return attention_eager(q, k, v, *tables, float(scale), int(torch.are_deterministic_algorithms_enabled()),
                           softcap=softcap, alibi_slopes=alibi_slopes, alibi_shift=int(alibi_shift))


def _pieces(mask) -> tuple | None:
    """The disjoint pieces whose union is `mask`, which flexmask.attention runs apart and merges
    (a natten past the runs a column holds: masks/natten_pieces.py), or None: a CompiledMask's
    compiled pieces, or a spec's own (under torch.compile too, each then an op by key)."""
    if isinstance(mask, CompiledMask):
        return mask.pieces
    if getattr(mask, "kind", None) == "natten":
        return natten_pieces.pieces(mask)
    return None


def _step_mask_key(mask):
    """The mask's part of a decode step's key (kernels/decode/steps.py): ("full",), a CompiledMask
    itself, a spec's structural key; None for a spec the key does not cover or no mask at all."""
    if mask is None:
        return ("full",)
    if mask.__class__ is CompiledMask:
        return ("compiled", mask)
    if not isinstance(mask, specs.Mask):
        return None
    try:
        return "spec", structural_key(mask)
    except Unkeyable:
        return None


def _split_kv_plan(q, k, v, tables, terms=None):
    """The split-KV forward's plan, or None for the q-block path: split-KV serves small Sq when no
    gradient is needed (kernels/dispatch.split_kv_plan decides by shape); with gradients (to q, k,
    v or the sinks) the q-block path runs (it saves what the backward needs)."""
    if q.shape[2] > max(decode_configs.DECODE_MAX_Q, decode_configs.CPU_DECODE_MAX_Q):  # on any device
        return None
    sinks = terms.sinks if terms is not None else None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return None
    return split_kv_plan(q, k, (tables[9], tables[10]), tables[8], terms, runs=tables[0].shape[-2] // 2)


def _check_flashmask_shapes(qs, ks, vs) -> None:
    """`_check_qkv`'s shape rules in flashmask_attention's names and (B, S, H, D) layout."""
    if ks != vs:
        raise ValueError(f"key and value must have the same shape (B, Sk, Hkv, D), got key={tuple(ks)}, "
                         f"value={tuple(vs)}")
    if qs[0] != ks[0] or qs[3] != ks[3]:
        raise ValueError(f"query and key must share B and D in (B, S, H, D), got query={tuple(qs)}, key={tuple(ks)}")
    if ks[2] == 0 or qs[2] % ks[2] != 0:
        raise ValueError(f"query's heads must be a multiple of key's (B, S, H, D), got Hq={qs[2]}, Hkv={ks[2]}")


def flashmask_attention(query, key, value, startend_row_indices=None, *, causal: bool = False,
                        softmax_scale: float | None = None, return_softmax_lse: bool = False):
    """Drop-in for FlashMask users: (B, S, H, D) layout and `startend_row_indices`
    (int32 [B, Hm, Sk, n], the table of `masks.from_startend_row_indices`). With no indices,
    `causal` selects causal or full attention. The layout change is a view, never a copy.
    Returns out (B, Sq, Hq, D), and the LSE (B, Hq, Sq) when return_softmax_lse=True."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B, S, H, D), got {shape}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    _check_flashmask_shapes(query.shape, key.shape, value.shape)
    if startend_row_indices is None:
        mask = specs.causal() if causal else None
    else:
        mask = specs.from_startend_row_indices(startend_row_indices, causal)
        mb, mh = startend_row_indices.shape[:2]
        if mb not in (1, query.shape[0]) or mh not in (1, query.shape[2], key.shape[2]):
            raise ValueError(f"startend_row_indices must have shape [B or 1, Hq or Hkv or 1, Sk, n] with "
                             f"B={query.shape[0]}, Hq={query.shape[2]}, Hkv={key.shape[2]}, got "
                             f"{tuple(startend_row_indices.shape)}")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, lse = attention(q, k, v, mask, scale=softmax_scale, return_lse=True)
    out = out.transpose(1, 2)
    return (out, lse) if return_softmax_lse else out
