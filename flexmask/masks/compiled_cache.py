"""Compiled tables shared by equal masks, so that a mask written in the call
(`mask=masks.causal()`) costs what a compiled one costs.

Two specs that say the same thing (`masks.causal()` twice, documents of equal length lists,
equal compositions) have the same structural key and find the same `CompiledMask`, and with it
the first-use work cached on its tables (the Hopper kernels' work lists). The key holds values,
never identities: ints, floats, lists, and CPU tensors of up to CONTENT_KEY_MAX_BYTES by their
bytes (reading a CPU tensor costs no sync), so a tensor changed in place afterwards gives another
key and is never served stale. A spec holding anything else (a GPU tensor, whose content would
need a sync; a large CPU tensor) is not keyed: it is compiled as before and its tables cached on
the spec object itself. The cache is a bounded LRU, by count and by the bytes of the tables it
holds (long masks have large tables: a causal mask over 1M tokens lists ~33M tiles).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

CONTENT_KEY_MAX_BYTES = 1 << 14  # CPU tensors up to this size are keyed by their bytes
TABLE_BYTES_BUDGET = 1 << 30  # the tables the cache keeps alive, beyond the most recent entry


class Unkeyable(Exception):
    """A parameter that the structural key does not cover."""


def structural_key(mask) -> tuple:
    """A hashable key, equal for specs that say the same thing. Raises Unkeyable. Kept on a spec
    whose parameters hold no tensor (a tensor may change in place: its key is read every time)."""
    key = mask.__dict__.get("_structural_key")
    if key is not None:
        return key
    kind = mask.kind
    if kind in ("and", "or"):
        return (kind, structural_key(mask.a), structural_key(mask.b))
    params = mask.params()
    key = (kind, tuple((name, _value_key(value)) for name, value in sorted(params.items())))
    if not torch.compiler.is_compiling() and not any(isinstance(value, torch.Tensor) for value in params.values()):
        mask._structural_key = key
    return key


def traceable_key(mask, tensors: list | None = None) -> tuple | None:
    """`structural_key` for a spec built inside torch.compile, where it is traced: plain Python on
    the spec's parameters, no exception, no tensor read. None where a parameter is a tensor or of
    an unknown type (the spec must then be built outside the compiled region). Given a list
    `tensors`, a tensor parameter is appended to it and keyed by its place there instead: the
    tensors then go to the op with the key, and the op rebuilds the spec from both."""
    kind = mask.kind
    if kind in ("and", "or"):
        a = traceable_key(mask.a, tensors)
        b = None if a is None else traceable_key(mask.b, tensors)
        return None if b is None else (kind, a, b)
    items = []
    # sorted by name alone: a value may be a symbolic size, which dynamo cannot compare
    for name, value in sorted(mask.params().items(), key=lambda item: item[0]):
        value = _static(value)
        if value is None or isinstance(value, (bool, int, float, str)):
            items.append((name, (type(value).__name__, value)))
        elif isinstance(value, (list, tuple)) and all(v.__class__ is int for v in value):
            items.append((name, ("ints", tuple(value))))
        elif isinstance(value, (list, tuple)) and all(
                isinstance(row, (list, tuple)) and all(v.__class__ is int for v in row) for row in value):
            items.append((name, ("seq", tuple(("ints", tuple(row)) for row in value))))
        elif tensors is not None and isinstance(value, torch.Tensor):
            items.append((name, ("tensor", len(tensors))))
            tensors.append(value)
        else:
            return None
    return (kind, tuple(items))


def tensor_versions(mask) -> tuple:
    """The version counters of the tensors a spec holds (no sync: host metadata), in order: they
    key the tables cached on a spec that `structural_key` cannot cover, so that a tensor changed
    in place since (its counter moved) is compiled again, never served stale."""
    if mask.kind in ("and", "or"):
        return tensor_versions(mask.a) + tensor_versions(mask.b)
    return tuple(v._version for v in mask.params().values() if isinstance(v, torch.Tensor))


def built_in_graph(mask) -> bool:
    """Whether a part of the spec was built while torch.compile traced (specs.Mask records it):
    dynamo hands such an object to code it does not trace without its attributes."""
    if mask.kind in ("and", "or"):
        return built_in_graph(mask.a) or built_in_graph(mask.b)
    return getattr(mask, "_in_graph", False)


def _static(value):
    """`value` with its ints made constants: a length computed from a tensor's shape under
    dynamic shapes is symbolic, and dynamo specialises len(range(n)) (int(n) would stay
    symbolic); on a plain int it is the int. Such a mask is another mask at another length."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return len(range(value)) if value >= 0 else -len(range(-value))
    if isinstance(value, (list, tuple)):
        return [_static(v) for v in value]
    return value


def spec_from_key(key: tuple, tensors=()):
    """The spec a key describes (`structural_key` or `traceable_key`, with the tensors that
    `traceable_key` listed): the same builders' objects, so that a spec that dynamo rebuilt
    without its attributes can still be compiled."""
    from .specs import _Simple  # the builders' class: specs sits above this module

    kind = key[0]
    if kind in ("and", "or"):
        a, b = spec_from_key(key[1], tensors), spec_from_key(key[2], tensors)
        return a & b if kind == "and" else a | b
    return _Simple(kind, **{name: _value(v, tensors) for name, v in key[1]})


def _value(v, tensors=()):
    tag = v[0]
    if tag == "tensor":
        return tensors[v[1]]
    if tag == "ints":
        return list(v[1])
    if tag == "seq":
        return [_value(x, tensors) for x in v[1]]
    if tag == "data":
        _, dtype, shape, data = v
        return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype.split(".")[-1])).reshape(shape).clone()
    return v[1]


def _value_key(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, (list, tuple)):
        if all(v.__class__ is int for v in value):  # the common case (document lengths), in C
            return ("ints", tuple(value))
        if all((r.__class__ is list or r.__class__ is tuple) and all(v.__class__ is int for v in r) for r in value):
            return ("seq", tuple([("ints", tuple(r)) for r in value]))  # lengths per batch row, the same key
        return ("seq", tuple(_value_key(v) for v in value))
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.is_floating_point():
        if value.numel() * value.element_size() <= CONTENT_KEY_MAX_BYTES:
            return ("data", str(value.dtype), tuple(value.shape), value.contiguous().numpy().tobytes())
    raise Unkeyable(type(value).__name__)


class CompiledCache:
    """Bounded LRU: (structural key, shape key) -> CompiledMask, at most `size` entries and
    `max_bytes` of tensors (the most recent entry stays whatever its size)."""

    def __init__(self, size: int = 64, max_bytes: int = TABLE_BYTES_BUDGET) -> None:
        self.size, self.max_bytes = size, max_bytes
        self._entries: OrderedDict = OrderedDict()  # key -> (CompiledMask, its bytes)
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def get(self, mask, shape_key: tuple, compile_fn):
        """The CompiledMask of `mask` for `shape_key` (lengths, device, tile), made by
        `compile_fn()` on a miss; None when the spec cannot be keyed."""
        try:
            key = structural_key(mask)
        except Unkeyable:
            return None
        return self.get_by_key(key, shape_key, compile_fn)

    def get_by_key(self, spec_key: tuple, shape_key: tuple, compile_fn):
        key = (spec_key, shape_key)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry[0]
        compiled = compile_fn()
        size = sum(t.numel() * t.element_size() for t in vars(compiled).values() if isinstance(t, torch.Tensor))
        self._entries[key] = (compiled, size)
        self._bytes += size
        while len(self._entries) > 1 and (len(self._entries) > self.size or self._bytes > self.max_bytes):
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped
        return compiled
