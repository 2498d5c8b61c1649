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


def test_stall_phases_splits_a_walk_step(tmp_path):
    """tools.stall_phases on a made-up ncu source page: one loop of S and PV issue, the wait for
    S, a softmax, the wait for PV and a tail; a cold instruction outside the loop is left out."""
    from tools import stall_phases

    rows = [("UMOV", 5, 1), ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4]", 100, 3),
            ("WARPGROUP.ARRIVE", 100, 1), ("HGMMA.64x128x16.F32.BF16 R24", 100, 7),
            ("WARPGROUP.DEPBAR.LE gsb0, 0x1", 100, 11), ("MUFU.EX2 R1, R1", 100, 13),
            ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 100, 17), ("FMUL R2, R2, R3", 100, 19)]
    path = tmp_path / "source.csv"
    lines = ['"Kernel Name","k",', '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"']
    lines += [f'"0x{i:x}","  {sass}","{samples}","{executed}"' for i, (sass, executed, samples) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    counts = stall_phases.phases(stall_phases.read_source(str(path)))
    assert dict(counts) == {"top": 3, "issue": 8, "wait S": 11, "softmax": 13, "wait PV": 17, "after": 19}


def test_stall_phases_by_opcode(tmp_path):
    """tools.stall_phases --by-opcode: samples and executed counts per opcode, predicates left out."""
    from tools import stall_phases

    path = tmp_path / "source.csv"
    path.write_text('"Kernel Name","k",\n"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
                    '"0x0","  MUFU.EX2 R1, R1","5","10"\n"0x10","  @P0 MUFU.EX2 R2, R2","2","4"\n'
                    '"0x20","  HGMMA.64x128x16.F32.BF16 R24","7","3"\n')
    samples, executed = stall_phases.by_opcode(stall_phases.read_source(str(path)))
    assert dict(samples) == {"MUFU": 7, "HGMMA": 7} and dict(executed) == {"MUFU": 14, "HGMMA": 3}


def test_ab_runs_each_tree_from_its_own_directory(tmp_path):
    """tools/gpu_jobs/ab.sh: a `python -m` command run for two trees imports each tree's flexmask in
    turn (not the repository's, which `python -m` from the root would put first), round by round."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    for name in ("a", "b"):
        (tmp_path / name / "flexmask").mkdir(parents=True)
        (tmp_path / name / "flexmask" / "__init__.py").write_text(f"WHO = {name!r}\n")
        (tmp_path / name / "which.py").write_text("import flexmask\nprint('tree', flexmask.WHO)\n")
    env = {**os.environ, "NEED_GPUS": "0", "ROUNDS": "2", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "tools/gpu_jobs/ab.sh", str(tmp_path / "a"), str(tmp_path / "b"), "--",
                          sys.executable, "-m", "which"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if ": tree " in line]
    assert lines == ["A r1: tree a", "B r1: tree b", "A r2: tree a", "B r2: tree b"], run.stdout
    assert f"A r1: imports {tmp_path / 'a' / 'flexmask'}" in run.stdout, run.stdout


def test_ab_adds_b_extra_to_side_b_only(tmp_path):
    """tools/gpu_jobs/ab.sh with B_EXTRA: the A/B of a switch within one tree, side B's command
    given the extra arguments, side A's not."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    (tmp_path / "t" / "flexmask").mkdir(parents=True)
    (tmp_path / "t" / "flexmask" / "__init__.py").write_text("")
    (tmp_path / "t" / "args.py").write_text("import sys\nprint('args', sys.argv[1:])\n")
    env = {**os.environ, "NEED_GPUS": "0", "ROUNDS": "1", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "B_EXTRA": "--switch"}
    run = subprocess.run(["bash", "tools/gpu_jobs/ab.sh", str(tmp_path / "t"), str(tmp_path / "t"), "--",
                          sys.executable, "-m", "args", "--seq-len", "8"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if ": args " in line]
    assert lines == ["A r1: args ['--seq-len', '8']", "B r1: args ['--seq-len', '8', '--switch']"], run.stdout


def test_l2_share_sweep_times_unhoisted_lists_and_puts_the_lists_back(monkeypatch):
    """tools.l2_share_sweep --hoist: the unhoisted side builds its work lists with hoist = 0 and the
    hoisted side with the caller's hoist, in turn; the modules' work-list functions are restored after."""
    from flexmask.kernels.backward import hopper as backward_hopper
    from flexmask.kernels.forward import hopper as forward_hopper
    from tools import l2_share_sweep

    hoists = []
    monkeypatch.setattr(forward_hopper, "work_list", lambda *a, hoist=0: hoists.append(("fwd", hoist)))
    monkeypatch.setattr(backward_hopper, "backward_work_list", lambda *a, hoist=0: hoists.append(("bwd", hoist)))
    kept = (forward_hopper.work_list, backward_hopper.backward_work_list)
    runs = {"fwd": lambda: forward_hopper.work_list(None, hoist=132),
            "bwd": lambda: backward_hopper.backward_work_list(None, hoist=132)}
    monkeypatch.setattr(l2_share_sweep.triton.testing, "do_bench", lambda fn, **_: fn() or 1.0)
    best = {}
    l2_share_sweep._time_hoist(runs, best)
    assert hoists == [("fwd", 132), ("bwd", 132), ("fwd", 0), ("bwd", 0)] * 2
    assert set(best) == {("fwd", True), ("bwd", True), ("fwd", False), ("bwd", False)}
    assert (forward_hopper.work_list, backward_hopper.backward_work_list) == kept


def test_l2_share_sweep_times_every_share_and_puts_the_default_back(monkeypatch):
    """tools.l2_share_sweep: each direction timed at every share of SHARES_MB, twice, with its work
    lists rebuilt for the share (the cache cleared); the default share is back afterwards."""
    from flexmask.kernels.backward import hopper as backward_hopper
    from flexmask.kernels.forward import hopper as forward_hopper
    from tools import l2_share_sweep

    seen = []
    runs = {"fwd": lambda: seen.append(("fwd", forward_hopper.L2_SHARE_BYTES >> 20, len(forward_hopper._WORK_CACHE))),
            "bwd": lambda: seen.append(("bwd", backward_hopper.L2_SHARE_BYTES >> 20, len(backward_hopper._WORK_CACHE)))}
    monkeypatch.setattr(l2_share_sweep.triton.testing, "do_bench", lambda fn, **_: fn() or 1.0)
    best = {}
    l2_share_sweep._time_shares(runs, best)
    assert seen == [(d, mb, 0) for mb in l2_share_sweep.SHARES_MB for d in ("fwd", "bwd")] * 2
    assert set(best) == {(d, mb) for d in ("fwd", "bwd") for mb in l2_share_sweep.SHARES_MB}
    assert forward_hopper.L2_SHARE_BYTES == backward_hopper.L2_SHARE_BYTES == l2_share_sweep.DEFAULT_MB << 20
