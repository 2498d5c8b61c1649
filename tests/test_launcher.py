"""`kernels.launcher.FastLaunch` (issue 13: a compile is host-bound): the key under which it keeps
a compiled kernel must tell apart every pair of calls that Triton would specialise differently,
else a later launch would run a kernel compiled for other arguments. Checked on the CPU on the
generated key function; the launches themselves run in the GPU tests of the compiler."""

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from flexmask.kernels.common.launcher import FastLaunch, _key_function


def _kernel(X, Y, n, m, flag, BLOCK: tl.constexpr):
    pass


# built as Triton's own JITFunction whatever TRITON_INTERPRET says (only its parameter list is used)
KERNEL = JITFunction(_kernel, do_not_specialize=["m"])
KEY = _key_function(KERNEL)


def _args(**changes):
    x = torch.zeros(64, dtype=torch.int32)
    args = dict(X=x, Y=x, n=32, m=32, flag=None, BLOCK=128)
    args.update(changes)
    return tuple(args.values())


@pytest.mark.parametrize("change", [
    dict(X=torch.zeros(64, dtype=torch.int64)),  # dtype
    dict(X=torch.zeros(64, dtype=torch.int32)[1:]),  # 4 bytes off: not 16-byte aligned
    dict(n=1),  # a specialised int equal to 1 becomes a constexpr
    dict(n=33),  # ... not a multiple of 16
    dict(n=2**31),  # ... a 64-bit int
    dict(m=2**31),  # a non-specialised int: its width still counts
    dict(m=2**63),  # unsigned 64-bit
    dict(flag=True),  # None is a constexpr, a bool an i1
    dict(BLOCK=64),  # constexpr value
], ids=["dtype", "misaligned", "int-one", "int-not-16", "int-64", "dns-int-64", "dns-uint-64", "none-bool",
        "constexpr"])
def test_key_tells_specialisations_apart(change):
    assert KEY(_args(**change)) != KEY(_args())


def test_key_values_of_different_kinds_never_meet():
    """The key's values are flat (ints, dtypes, strings): an int 1 and True (equal in Python), an
    aligned and an unaligned tensor, an i32 and an i64 multiple of 16 stay apart."""
    x = torch.zeros(64, dtype=torch.int32)
    assert KEY(_args(n=1)) != KEY(_args(n=True))
    assert KEY(_args(flag=1.0)) != KEY(_args(flag=None)) != KEY(_args(flag=False))
    assert KEY(_args(X=x)) != KEY(_args(X=x[1:])) and KEY(_args(n=2**32)) != KEY(_args(n=16))


def test_key_ignores_what_triton_does_not_specialise():
    """Other addresses of the same alignment and other values of a non-specialised int reuse the
    kernel (the point of the cache); so do other multiples of 16 of a specialised int."""
    other = torch.zeros(128, dtype=torch.int32)
    assert KEY(_args(X=other, Y=other[16:], m=7, n=48)) == KEY(_args())


def test_unkeyed_arguments_take_triton_path():
    """A numpy scalar is not modelled by the key: the launch goes through Triton."""
    import numpy as np

    from flexmask.kernels.common import launcher

    with pytest.raises(launcher._Unkeyed):
        KEY(_args(n=np.int64(3)))


def test_floats_are_fp32_whatever_their_value():
    """Triton passes a Python float as fp32 and never specialises on its value."""
    assert KEY(_args(m=1.5)) == KEY(_args(m=-2.0)) != KEY(_args(m=2))


def test_descriptors_are_keyed_by_tritons_own_specialisation():
    """A host TMA descriptor: another block or dtype is another kernel; another tensor of the same
    block and dtype is the same one."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t, rows):
        layout = gl.NVMMASharedLayout.get_default_for([1, rows, 64], gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 64], layout)

    a, b = torch.zeros(2, 128, 64, dtype=torch.bfloat16), torch.zeros(3, 256, 64, dtype=torch.bfloat16)
    assert KEY(_args(flag=desc(a, 128))) == KEY(_args(flag=desc(b, 128)))
    assert KEY(_args(flag=desc(a, 64))) != KEY(_args(flag=desc(a, 128)))
    assert KEY(_args(flag=desc(a.half(), 128))) != KEY(_args(flag=desc(a, 128)))


def _recording_launch(monkeypatch, kernel, calls: list) -> FastLaunch:
    """FastLaunch(kernel) with Triton's launch and the compiled kernel's run replaced by fakes that
    record into `calls`: ("triton", args, kwargs) for Triton's path, ("fast", params) for the
    fast one (no GPU needed)."""
    from flexmask.kernels.common import launcher

    class Compiled:
        function, packed_metadata = "f", "m"

        def run(self, *args):
            calls.append(("fast", args[9:]))

    class Jit:
        params = kernel.params

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(("triton", args, kwargs))
                return Compiled()
            return launch

    monkeypatch.setattr(launcher.torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # a CPU build has none
    monkeypatch.setattr(launcher.torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    fast = FastLaunch(kernel)
    fast.fn = Jit()
    return fast


def test_launch_binds_parameters_by_name_and_keys_launch_options(monkeypatch):
    """Parameters given by name run in the kernel's order; a launch option (maxnreg) is part of
    the key; a parameter left to its default goes through Triton's path, which binds it."""
    calls = []
    fast = _recording_launch(monkeypatch, KERNEL, calls)
    x = torch.zeros(64, dtype=torch.int32)
    fast((1,), x, x, n=32, m=5, flag=None, BLOCK=128, maxnreg=168)
    fast((1,), x, x, n=32, m=6, flag=None, BLOCK=128, maxnreg=168)
    fast((1,), x, x, n=32, m=6, flag=None, BLOCK=128, maxnreg=128)
    fast((1,), x, x, 32, 6, None, BLOCK=128)
    fast((1,), x, x, n=32, m=6, flag=None)  # BLOCK left out
    assert [c[0] for c in calls] == ["triton", "fast", "triton", "triton", "triton"]
    assert calls[1][1] == (x, x, 32, 6, None, 128) and fast.triton_launches == 4


def test_launch_passes_num_warps_to_a_kernel_that_takes_it(monkeypatch):
    """Gluon kernels take `num_warps` as a constexpr parameter: the fast path passes it in its place
    (a regression: such launches always fell back to Triton's path)."""

    def _gluon_like(X, n, BLOCK: tl.constexpr, num_warps: tl.constexpr):
        pass

    calls = []
    fast = _recording_launch(monkeypatch, JITFunction(_gluon_like), calls)
    x = torch.zeros(64, dtype=torch.int32)
    for _ in range(2):
        fast((1,), x, 32, BLOCK=64, num_warps=4, maxnreg=168)
    assert [c[0] for c in calls] == ["triton", "fast"] and calls[1][1] == (x, 32, 64, 4)


def test_interpreter_kernels_take_triton_path():
    """Under the interpreter (the CPU tests) FastLaunch only forwards to `kernel[grid](...)`."""
    from flexmask.masks import compiler_kernels as ck

    assert isinstance(ck._CLASSIFY, FastLaunch)
    assert ck._CLASSIFY._fast == isinstance(ck._classify_kernel, JITFunction)


def test_launch_hooks_take_triton_path(monkeypatch):
    """A registered launch hook (a profiler such as proton) must see every launch: FastLaunch then
    leaves the launch to Triton, whose path calls the hooks."""
    from triton import knobs

    from flexmask.kernels.common import launcher

    assert not launcher._hooks_registered()
    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    assert launcher._hooks_registered()


def _descriptor_kernel(monkeypatch, encodings: list):
    """A stand-in for a compiled kernel with two host TMA descriptors (parameters 1 and 3 of five),
    whose launcher is Triton's own `wrap_handle_tensordesc` around a recorder, and Triton's
    encoder replaced by one that records what it encodes (no GPU needed)."""
    from triton.backends.nvidia import driver as nvidia_driver

    def encode(d, meta):
        encodings.append((d.base.data_ptr(), tuple(d.shape), tuple(d.strides)))
        return [("map", meta["swizzle"], d.base.data_ptr(), *d.shape, *d.strides), *d.shape, *d.strides]

    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", encode)
    raw_calls = []
    signature = {"X": "*bf16", "A": "tensordesc<bf16[64, 64]>", "n": "i32", "B": "tensordesc<bf16[64, 64]>",
                 "BLOCK": "constexpr"}
    metas = [{"swizzle": 3}, {"swizzle": 2}]

    class Run:
        launch_cooperative_grid, launch_pdl = False, True
        global_scratch_size = profile_scratch_size = 0
        launch = staticmethod(nvidia_driver.wrap_handle_tensordesc(lambda *a: raw_calls.append(a), signature, metas))

    class Kernel:
        function, packed_metadata, run = 7, (4, 1, 0), Run()

    return Kernel(), raw_calls


def _desc(t):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [64, 64], layout)


def _same(got: tuple, expected: tuple) -> bool:
    """Launcher arguments equal: tensors by identity, the rest by value."""
    return len(got) == len(expected) and all(
        g is e if isinstance(e, torch.Tensor) else not isinstance(g, torch.Tensor) and g == e
        for g, e in zip(got, expected))


def test_direct_launch_passes_what_tritons_launcher_passes(monkeypatch):
    """The direct launch of a kernel with TMA descriptors calls the C launcher with exactly the
    arguments Triton's wrapper builds (each descriptor expanded to map, shape, strides), and
    encodes a descriptor once per pointer, shape and strides."""
    from flexmask.kernels.common.launcher import _DirectLaunch

    encodings = []
    kernel, raw_calls = _descriptor_kernel(monkeypatch, encodings)
    direct = _DirectLaunch.of(kernel)
    assert direct is not None
    x = torch.zeros(64, dtype=torch.bfloat16)
    a, b = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(256, 64, dtype=torch.bfloat16)
    params = (x, _desc(a), 32, _desc(b), 64)
    kernel.run.launch(2, 3, 1, 99, kernel.function, False, True, None, None, kernel.packed_metadata, None, None,
                      None, *params)
    direct(2, 3, 1, 99, params)
    assert _same(raw_calls[1], raw_calls[0]) and len(encodings) == 4  # Triton's two, the direct launch's two
    direct(2, 3, 1, 99, (x, _desc(a), 33, _desc(b), 64))  # new descriptor objects, same tensors
    expected = (*raw_calls[0][:19], 33, *raw_calls[0][20:])  # [13] x, [14:19] map and sizes of A, [19] n
    assert len(encodings) == 4 and _same(raw_calls[2], expected)
    c = torch.zeros(128, 64, dtype=torch.bfloat16)  # another pointer
    direct(2, 3, 1, 99, (x, _desc(c), 32, _desc(b), 64))
    assert encodings[-1] == (c.data_ptr(), (128, 64), (64, 1)) and len(encodings) == 5
    direct(2, 3, 1, 99, (x, _desc(a[:64]), 32, _desc(b), 64))  # same pointer, another shape
    assert encodings[-1] == (a.data_ptr(), (64, 64), (64, 1)) and len(encodings) == 6


def test_direct_launch_cache_is_bounded(monkeypatch):
    from flexmask.kernels.common import launcher

    encodings = []
    kernel, _ = _descriptor_kernel(monkeypatch, encodings)
    direct = launcher._DirectLaunch.of(kernel)
    x, b = torch.zeros(64, dtype=torch.bfloat16), _desc(torch.zeros(64, 64, dtype=torch.bfloat16))
    tensors = [torch.zeros(64, 64, dtype=torch.bfloat16) for _ in range(launcher.DESCRIPTORS_KEPT + 8)]
    for t in tensors:
        direct(1, 1, 1, 0, (x, _desc(t), 1, b, 64))
    assert all(len(cache) <= launcher.DESCRIPTORS_KEPT for _, _, cache in direct.descriptors)


def test_direct_launch_needs_the_launcher_it_models(monkeypatch):
    """Scratch memory, or a launcher without descriptors, keeps `CompiledKernel.run`."""
    from flexmask.kernels.common.launcher import _DirectLaunch

    kernel, _ = _descriptor_kernel(monkeypatch, [])
    kernel.run.global_scratch_size = 128
    assert _DirectLaunch.of(kernel) is None

    class Plain:
        function, packed_metadata = 1, ()

        class run:  # noqa: N801 (a stand-in for the launcher object)
            launch = print  # a builtin: Triton's C launcher called as is
            global_scratch_size = profile_scratch_size = 0

    assert _DirectLaunch.of(Plain()) is None
