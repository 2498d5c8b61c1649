"""Launch a Triton kernel again without `JITFunction.run`'s per-call work (issue 13).

The mask compiler and short attention calls are host-bound: their GPU work takes microseconds,
and each `kernel[grid](...)` costs ~10-25 us of Python in Triton 3.6 before the driver call (the binder specialises every
argument, the cache key is rebuilt from them and `str(options)`, every module-level constexpr
the kernel reads is compared with its value at compile time, the launch hooks are called even
when none is registered).

`FastLaunch(kernel)` keeps the `CompiledKernel` that the first launch of each specialisation
returns and later calls its C launcher (`CompiledKernel.run`) directly. The key covers everything
Triton specialises on: each constexpr's value, each tensor's dtype and 16-byte alignment, each
int's width (and, where the kernel specialises it, whether it is 1 or a multiple of 16), None
arguments, floats (always fp32), TMA descriptors (Triton's own specialisation of them: dtype,
block and layout), num_warps and the other launch options (maxnreg), the current device. A new key, a registered launch hook (a profiler), or
the interpreter (CPU tests) take the ordinary path. The launch is the same driver call on the
current stream, so it is captured by a CUDA graph like any other.

A kernel that takes host TMA descriptors goes one step further (`_DirectLaunch`): Triton 3.6
wraps its C launcher in `wrap_handle_tensordesc`, which loops over every argument in Python and
encodes each descriptor again (`cuTensorMapEncodeTiled`) at every launch. The direct launch calls
the C launcher itself and keeps each encoded descriptor under everything the encoding reads
(pointer, shape, strides, padding; block, swizzle and dtype are the kernel's): training hands the
caching allocator's same pointers back step after step. A launcher of another shape (a new
Triton) or one that needs scratch memory keeps `CompiledKernel.run`.
"""

from __future__ import annotations

import torch
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia import driver as nvidia_driver
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _int_width(v: int) -> int:
    """Triton's integer argument types: 0 for i32, 1 for i64, 2 for u64."""
    if _I32_MIN <= v <= _I32_MAX:
        return 0
    return 2 if v >= 2**63 else 1


class _Unkeyed(Exception):
    """An argument whose specialisation the key does not model: take Triton's path."""


# a 16-byte-aligned tensor's key: its dtype's name with "@16" (the key's values are flat and
# cheap to hash; a plain dtype is an unaligned tensor)
_ALIGNED = {d: f"{d}@16" for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS: dict = {}  # id(layout) -> (layout, token): each layout object hashed once, kept alive
_TOKENS: dict = {}  # layout -> token: equal layouts share one
_LAYOUTS_KEPT = 1024


def _layout_token(layout):
    """A small int standing for a Gluon shared layout, equal for equal layouts (its own hash is
    Python code over its fields: paid once per layout object, not at every launch)."""
    kept = _LAYOUTS.get(id(layout))
    if kept is not None and kept[0] is layout:
        return kept[1]
    if len(_LAYOUTS) >= _LAYOUTS_KEPT:
        return layout
    token = _TOKENS.setdefault(layout, len(_TOKENS))
    _LAYOUTS[id(layout)] = (layout, token)
    return token


def _wide(v: int) -> int:
    """Key of a specialised int outside i32: its width, whether it is 1, whether a multiple of 16."""
    return 16 * _int_width(v) + (v == 1) + 2 * (v & 15 == 0)


def _other(a, aligned: bool):
    """Key of an argument that is not a plain tensor, an int, a float or None."""
    if isinstance(a, torch.Tensor):  # a subclass (nn.Parameter)
        return _ALIGNED[a.dtype] if aligned and a.data_ptr() & 15 == 0 else a.dtype
    if a.__class__ is bool:
        return (a,)  # not True itself: True == 1, the key of an int 1
    if hasattr(a, "block_shape") and hasattr(a, "base"):  # a host TMA descriptor
        layout = getattr(a, "layout", None)
        if layout is not None:  # Gluon's: what Triton's key reads (dtype, block, layout), ~10x cheaper
            return a.base.dtype, *a.block_shape, _layout_token(layout)
        return native_specialize_impl(BaseBackend, a, False, aligned, aligned)
    raise _Unkeyed  # numpy scalars and whatever else


def _key_function(fn):
    """A function of the kernel's arguments (one tuple) -> their specialisation key, written out
    parameter by parameter (no loop: this runs at every launch), each value flat and cheap to
    hash. Constexprs: their value. Tensors: dtype, and 16-byte alignment where Triton specialises
    on it (the C launcher still checks that each pointer is a device pointer). Ints: their width,
    and where Triton specialises on the value, whether it is 1 and whether it is a multiple of 16
    (0-2 for an i32, 16 and up for wider). Gluon's TMA descriptors: dtype, block and layout (what
    Triton's own key reads). Floats: fp32. None: None."""
    names, items = [], []
    for i, p in enumerate(fn.params):
        a = f"a{i}"
        names.append(a)
        if p.is_constexpr:
            items.append(a)
            continue
        specialised = not p.do_not_specialize
        aligned = specialised and not p.do_not_specialize_on_alignment
        tensor = f"(_ALIGNED[{a}.dtype] if {a}.data_ptr() & 15 == 0 else {a}.dtype)" if aligned else f"{a}.dtype"
        in_i32 = f"-2147483648 <= {a} <= 2147483647"
        number = (f"(({a} == 1) + 2 * ({a} & 15 == 0) if {in_i32} else _wide({a}))" if specialised
                  else f"(0 if {in_i32} else _int_width({a}))")
        descriptor = f"({a}.base.dtype, *{a}.block_shape, _layout_token({a}.layout))"
        items.append(f"{tensor} if {a}.__class__ is _Tensor else {number} if {a}.__class__ is int "
                     f"else {descriptor} if {a}.__class__ is _Descriptor "
                     f"else 'fp32' if {a}.__class__ is float else None if {a} is None else _other({a}, {aligned})")
    unpack = f"    {', '.join(names)}, = args\n" if names else ""
    src = f"def key(args):\n{unpack}    return ({', '.join(items)},)\n"
    scope = {"_Tensor": torch.Tensor, "_int_width": _int_width, "_wide": _wide, "_other": _other,
             "_ALIGNED": _ALIGNED, "_Descriptor": GluonTensorDescriptor, "_layout_token": _layout_token}
    exec(src, scope)  # noqa: S102 -- source built above from the kernel's parameter list only
    return scope["key"]


def _hooks_registered() -> bool:
    """Whether a launch hook is registered (a profiler): those launches take Triton's path, which
    calls them. (Triton 3.6 keeps the hooks in chains that are never None.)"""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


# encoded descriptors kept per descriptor argument of a kernel; past this many the cache starts over
DESCRIPTORS_KEPT = 64


class _DirectLaunch:
    """`CompiledKernel.run` for a kernel with host TMA descriptors, without `CudaLauncher.__call__`
    and `wrap_handle_tensordesc`: the C launcher is called with the arguments Triton would build,
    each descriptor expanded to its encoded map, shape and strides, the map encoded once per
    (pointer, shape, strides, padding)."""

    def __init__(self, kernel, raw, positions, metas) -> None:
        self.raw = raw
        run = kernel.run
        self.base = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                     kernel.packed_metadata, None, None, None)
        self.descriptors = tuple((p, m, {}) for p, m in sorted(zip(positions, metas)))

    @classmethod
    def of(cls, kernel):
        """The direct launch of `kernel`, or None where its launcher is not the one this models
        (no descriptors, scratch memory, another Triton): then `kernel.run` stays."""
        run = getattr(kernel, "run", None)
        launch = getattr(run, "launch", None)
        code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
        if (code is None or closure is None or getattr(run, "global_scratch_size", 1)
                or getattr(run, "profile_scratch_size", 1)):
            return None
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure)))
        if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
            return None
        indices, metas = sorted(cells["tensordesc_indices"]), list(cells["tensordesc_meta"])
        if len(indices) != len(metas) or any(m is None for m in metas):
            return None  # descriptors passed as shapes and strides: nothing to encode or keep
        return cls(kernel, cells["launcher"], indices, metas)

    def __call__(self, g0, g1, g2, stream, params) -> None:
        args = [g0, g1, g2, stream, *self.base]
        start = 0
        for position, meta, encoded in self.descriptors:
            args += params[start:position]
            d = params[position]
            key = (d.base.data_ptr(), *d.shape, *d.strides, d.padding)
            expanded = encoded.get(key)
            if expanded is None:
                if len(encoded) >= DESCRIPTORS_KEPT:
                    encoded.clear()
                expanded = encoded[key] = nvidia_driver.make_tensordesc_arg(d, meta)
            args += expanded
            start = position + 1
        args += params[start:]
        self.raw(*args)


class FastLaunch:
    """`FastLaunch(jit_fn)(grid, *args, num_warps=4, **kwargs)`: `jit_fn[grid](*args, num_warps=num_warps,
    **kwargs)`, where `args` and the kernel parameters among `kwargs` are all the kernel's
    parameters (constexprs included, by position or by name) and the other `kwargs` are launch
    options (maxnreg, ...)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self._fast = isinstance(fn, JITFunction)  # not under the interpreter
        self._key = _key_function(fn) if self._fast else None
        self._names = [p.name for p in fn.params] if self._fast else []
        self._param_names = frozenset(self._names)
        self._kernels: dict = {}
        self._plans: dict = {}  # (number of positional arguments, keyword names) -> _plan's answer
        self.triton_launches = 0  # launches that took Triton's path (a test checks steady state has none)

    def _plan(self, n_args: int, kwarg_names: tuple):
        """(the parameters given by name, in the kernel's order, or None where one is left to its
        default; the launch options' names, sorted) for calls of this shape, kept."""
        rest = tuple(self._names[n_args:])
        given = set(kwarg_names) | {"num_warps"}
        plan = (rest if all(name in given for name in rest) else None,
                tuple(sorted(name for name in kwarg_names if name not in self._param_names)))
        self._plans[(n_args, *kwarg_names)] = plan
        return plan

    def _triton(self, grid, args, num_warps, kwargs):
        self.triton_launches += 1
        return self.fn[grid](*args, num_warps=num_warps, **kwargs)

    def _params_and_key(self, args: tuple, num_warps: int, kwargs: dict):
        """(every kernel parameter in order, the launch's specialisation key ending with the current
        device), or None where Triton's own path must bind the call."""
        plan = self._plans.get((len(args), *kwargs))
        if plan is None:
            plan = self._plan(len(args), tuple(kwargs))
        rest, option_names = plan
        if rest is None:  # a parameter left to its default: Triton binds it
            return None
        if rest:  # parameters by name; a Gluon kernel may take `num_warps` as a parameter too
            named = {**kwargs, "num_warps": num_warps}
            params = args + tuple([named[name] for name in rest])
        else:
            params = args
        options = (option_names, *[kwargs[name] for name in option_names])
        try:
            key = self._key(params)
        except _Unkeyed:
            return None
        device = torch._C._cuda_getDevice()  # (CUDA is initialised: the arguments live there)
        return params, (key, num_warps, options, device)

    def __call__(self, grid, *args, num_warps: int = 4, **kwargs):
        if not self._fast or _hooks_registered():
            return self._triton(grid, args, num_warps, kwargs)
        found = self._params_and_key(args, num_warps, kwargs)
        if found is None:
            return self._triton(grid, args, num_warps, kwargs)
        params, key = found
        device = key[-1]
        launch = self._kernels.get(key)
        if launch is None:  # the first launch of this specialisation: Triton's own path
            kernel = self._triton(grid, args, num_warps, kwargs)
            self._kernels[key] = (kernel, _DirectLaunch.of(kernel))
            return kernel
        kernel, direct = launch
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        if direct is not None:
            direct(grid[0], g1, g2, stream, params)
        else:
            kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *params)
        return kernel


class BoundLaunch:
    """`fast(grid, *args, num_warps=..., **kwargs)` kept with every argument but the tensors at
    `positions` (positional arguments), which each call passes: `bound(t0, t1, ...)`. The first
    two calls launch through `fast` (binding after the second, so a launch made once, a step
    planned for one call, pays nothing for it); later ones call the kept launch (its C launcher, or
    the direct launch) with the parameters already in order, no key to build. The key a launch is
    kept under holds each tensor's dtype and 16-byte alignment: the caller passes tensors of the
    first call's dtypes and alignment (decoding's steps: fresh outputs, inputs of one signature). A
    registered launch hook, another current device or the interpreter take `fast` again. The
    swapped positions are emptied once bound, so no call's tensors are kept alive."""

    def __init__(self, fast: FastLaunch, grid: tuple, args: tuple, positions: tuple, num_warps: int = 4,
                 **kwargs) -> None:
        self.fast, self.grid, self.positions = fast, tuple(grid), positions
        self.num_warps, self.kwargs, self.args = num_warps, kwargs, list(args)
        self.kernel, self.calls = None, 0

    def _swapped(self, values: list, tensors: tuple) -> list:
        values = values.copy()
        for position, t in zip(self.positions, tensors):
            values[position] = t
        return values

    def _bind(self, args: list) -> None:
        found = self.fast._params_and_key(tuple(args), self.num_warps, self.kwargs)
        launch = None if found is None else self.fast._kernels.get(found[1])
        if launch is None:
            return
        self.kernel, self.direct = launch
        self.params, self.device = list(found[0]), found[1][-1]
        for position in self.positions:
            self.params[position] = None
        g0, g1, g2 = (*self.grid, 1, 1)[:3]
        self.g = (g0, g1, g2)

    def __call__(self, *tensors) -> None:
        kernel = self.kernel
        if kernel is None or _hooks_registered() or torch._C._cuda_getDevice() != self.device:
            args = self._swapped(self.args, tensors)
            self.fast(self.grid, *args, num_warps=self.num_warps, **self.kwargs)
            self.calls += 1
            if kernel is None and self.calls > 1 and self.fast._fast and not _hooks_registered():
                self._bind(args)  # from the second call: a launch made once costs no binding
            return
        params = self._swapped(self.params, tensors)
        g0, g1, g2 = self.g
        stream = torch._C._cuda_getCurrentRawStream(self.device)
        if self.direct is not None:
            self.direct(g0, g1, g2, stream, params)
        else:
            kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *params)
