"""The maintainer's offline compile tools (tools/offline_compile.py) on this machine, no GPU:
what their digests and SASS counts tell apart."""

from __future__ import annotations

import pytest

from conftest import compile_for_sm90

_KERNELS = """
import triton
import triton.language as tl


@triton.jit
def xy_plus_z(X, Y, Z, O):
    x, y, z = tl.load(X), tl.load(Y), tl.load(Z)
    tl.store(O, x * y + z)


@triton.jit
def xz_plus_y(X, Y, Z, O):
    x, y, z = tl.load(X), tl.load(Y), tl.load(Z)
    tl.store(O, x * z + y)
"""

# Triton reads a kernel's source from its file: the kernels go into a module of their own
_DIGESTS = """
import importlib.util, json, pathlib, tempfile
import torch
from tools import offline_compile as oc

path = pathlib.Path(tempfile.mkdtemp()) / "operand_kernels.py"
path.write_text(KERNELS)
spec = importlib.util.spec_from_file_location("operand_kernels", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
t = torch.empty(4)
for fn in (module.xy_plus_z, module.xz_plus_y, module.xy_plus_z):
    kernel = oc.compile_offline(fn, dict(X=t, Y=t, Z=t, O=t), {}, {"num_warps": 1})
    print(json.dumps({"digest": oc.instruction_digest(kernel)}))
"""


def test_digest_tells_operand_changes_apart():
    """Two kernels of the same operations on other operands (x * y + z, x * z + y): the opcode
    hash (`sha`) is equal, the renamed code's (`code`) is not; the same kernel twice, both equal."""
    pytest.importorskip("triton")
    a, b, again = compile_for_sm90(f"KERNELS = {_KERNELS!r}\n" + _DIGESTS, timeout=300)
    field = lambda r, key: r["digest"].split(f"{key} ")[1].split(",")[0]
    assert field(a, "sha") == field(b, "sha"), (a, b)
    assert field(a, "code") != field(b, "code"), (a, b)
    assert a["digest"] == again["digest"], (a, again)


_MASKING = """
import json, tempfile, os
from tools import forward_sass

counts = forward_sass.masking_counts(forward_sass.disassemble(128, os.path.join(tempfile.mkdtemp(), "fwd")))
print(json.dumps(dict(counts)))
"""


def test_forward_sass_finds_the_masking_helpers():
    """tools.forward_sass attributes the PARTIAL tiles' row-word selects to the masking helpers'
    lines of kernels/forward/hopper.py (it found none while it looked for the module's old name)."""
    pytest.importorskip("triton.experimental.gluon")
    (counts,) = compile_for_sm90(_MASKING, timeout=600)
    assert counts.get("FSEL", 0) >= 64, counts  # a select a score of the 64 x 128 tile's 64 a thread
    assert sum(counts.values()) > counts["FSEL"], counts
