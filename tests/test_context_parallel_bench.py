"""The context-parallel benchmark on the CPU: its schedule, its --layout switch, its torch_ring rows
(PyTorch's ring attention has no CPU kernel, so the row must carry that as its status, not crash
the run), and the table it writes into a README between the markers."""

from __future__ import annotations

import csv
import os

import pytest

from benchmarks import context_parallel as bench
from benchmarks import context_parallel_report as report
from benchmarks import context_parallel_ring as ring

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="flexmask on CPU needs TRITON_INTERPRET=1"
)


def test_schedule_orders_providers_and_masks():
    args = bench.parse_args(["--masks", "causal,causal_document", "--schedule",
                             "flexmask:1024,512;torch_ring:1024;flexmask:256"])
    assert bench.schedule(args) == [
        ("flexmask", "causal", 1024), ("flexmask", "causal_document", 1024),
        ("flexmask", "causal", 512), ("flexmask", "causal_document", 512),
        ("torch_ring", "causal", 1024),
        ("flexmask", "causal", 256), ("flexmask", "causal_document", 256),
    ]
    default = bench.schedule(bench.parse_args(["--seq-lens", "64", "--masks", "causal"]))
    assert default == [("flexmask", "causal", 64), ("torch_ring", "causal", 64)]
    with pytest.raises(ValueError, match="provider:S"):
        bench.schedule(bench.parse_args(["--schedule", "ring:64"]))


def test_ring_bytes_are_an_all_gather_of_the_heads_it_moves():
    native = ring.ring_bytes_moved(64, 2, 1, 8, 2, 16, bench.DTYPES["bf16"], "native")
    repeat = ring.ring_bytes_moved(64, 2, 1, 8, 2, 16, bench.DTYPES["bf16"], "repeat")
    chunk_bytes = 1 * 2 * 16 * 16 * 2  # B * Hkv * C * D * bf16, C = 64 / 4
    assert native["forward_bytes"] == 4 * 2 * chunk_bytes  # 4 chunks move (2 W (W - 1)), K and V
    assert repeat["forward_bytes"] == 4 * native["forward_bytes"]  # Hq / Hkv = 4
    with pytest.raises(ValueError, match="gqa"):
        ring.ring_attention("twice")


def test_layout_switch_and_its_ideal_speedup():
    """--layout balanced: the ideal speedup is that of the mask's balanced layout, no lower than
    the default layout's (equal for causal, whose balanced layout is the default)."""
    from flexmask import distributed as fmd

    args = bench.parse_args(["--layout", "balanced"])
    assert args.layout == "balanced" and bench.parse_args([]).layout == "default"
    with pytest.raises(SystemExit):
        bench.parse_args(["--layout", "sorted"])
    s, world = 4096, 4
    doc = bench.build_mask("causal_document", s, bench.parse_args(["--doc-min", "64", "--doc-max", "2048"]))
    iv = doc.intervals(s, s, "cpu")
    lay = bench.make_layout("balanced", doc, s, world)
    assert bench.make_layout("default", doc, s, world) is None
    default, balanced = bench.ideal_speedup(iv, s, world), bench.ideal_speedup(iv, s, world, lay)
    work = fmd.chunk_work(doc, s, world)
    assert balanced == pytest.approx(sum(work) / max(fmd.rank_work(work, lay)))
    assert default < balanced <= world
    causal = bench.build_mask("causal", s, args)
    assert bench.make_layout("balanced", causal, s, world) == fmd.Layout.default(world)


def test_readme_block_needs_both_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        report.write_readme_block(str(readme), "| table |\n")


@needs_interpreter
def test_cpu_run_writes_rows_png_table_and_readme(tmp_path):
    out = tmp_path / "cp.csv"
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n{report.START}\nold\n{report.END}\ntail\n")
    argv = ["--cpu", "--nproc", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--reps", "1",
            "--masks", "causal,causal_document", "--doc-min", "16", "--doc-max", "40",
            "--schedule", "flexmask:96;torch_ring:96", "--layout", "balanced", "--out", str(out), "--readme", str(readme)]
    assert bench.main(argv) == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["provider"], r["mask"]) for r in rows] == [("flexmask", "causal"), ("flexmask", "causal_document"),
                                                         ("torch_ring", "causal")]
    ours, doc, theirs = rows
    assert ours["status"] == "ok" and float(ours["err_out"]) < 1e-5
    # flexmask ran in the balanced layout (the documents' is not the default one here); the ring in its own
    assert [r["layout"] for r in rows] == ["balanced", "balanced", "default"]
    assert doc["status"] == "ok" and max(float(doc[n]) for n in ("err_out", "err_dq", "err_dk", "err_dv")) < 1e-5
    doc_mask = bench.build_mask("causal_document", 96, bench.parse_args(argv))
    iv = doc_mask.intervals(96, 96, "cpu")
    assert float(doc["ideal_speedup"]) == pytest.approx(
        bench.ideal_speedup(iv, 96, 2, bench.make_layout("balanced", doc_mask, 96, 2)), rel=1e-5)
    assert float(doc["ideal_speedup"]) > bench.ideal_speedup(iv, 96, 2)
    # no CPU kernel for the ring: every variant tried is named in the status, nothing measured
    assert theirs["status"].startswith("failed") and "GQA" in theirs["status"] and not theirs["tw_fwd_bwd_ms"]
    assert theirs["t1_fwd_bwd_ms"] == ours["t1_fwd_bwd_ms"]  # one denominator for every speedup
    assert os.path.exists(tmp_path / "cp.png") and os.path.exists(tmp_path / "cp.md")
    text = readme.read_text()
    assert text.startswith(f"# title\n{report.START}\n| GPUs |") and text.endswith(f"{report.END}\ntail\n")
    assert "| 2 | causal | 96 | flexmask (balanced layout) |" in text and "| 2 | causal | 96 | torch_ring |" in text
    assert "old" not in text
