"""Smoke tests of the benchmark suite (benchmarks/).

The CPU mode of ``python -m benchmarks.run`` runs in a subprocess on three families (kernels
under the Triton interpreter, checked against the dense reference); the FlexAttention mask_mod
that the GPU sweep derives from our intervals is checked against the dense mask; the results
tables of the README and docs/results.md are regenerated from a CSV.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import csv
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import families, flex_masks, providers, readme_table, report
from flexmask.masks.intervals import intervals_to_dense

REPO = Path(__file__).resolve().parents[1]


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_cpu_mode_runs_three_families_against_the_reference(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "benchmarks.run", "--quick", "--families", "causal,document,random_eviction",
           "--seqlens", "100", "--out", str(tmp_path), "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _read_csv(tmp_path / "quick.csv")
    assert [r["family"] for r in rows] == ["causal", "document", "random_eviction"]
    for row in rows:
        assert row["status"] == "ok" and row["check"] == "pass", row
        assert row["mode"] == "quick" and row["torch"] == torch.__version__ and row["date"]
        assert row["command"].startswith("python -m benchmarks.run --quick --families causal,document")
        assert float(row["fwd_bwd_ms"]) > 0 and 0 < float(row["density"]) < 1
    assert "random_eviction" in proc.stdout  # the table


def test_flex_mask_mods_match_the_intervals():
    """The GPU cross-check is only as good as the FlexAttention masks built for each family."""
    from torch.nn.attention.flex_attention import create_mask

    s, batch, heads = 97, 2, 4
    for case in families.cases_for(families.FAMILIES, s, batch, heads):
        mask = case.make()
        iv = mask.intervals(s, s, "cpu")
        want = intervals_to_dense(iv, s).expand(batch, heads, s, s)
        mask_mod, _ = providers.intervals_mask_mod(iv, heads)
        assert torch.equal(create_mask(mask_mod, batch, heads, s, s, device="cpu"), want), case.family
        native = flex_masks.native_mask_mod(mask, s, "cpu")
        assert (native is None) == (mask.kind not in flex_masks.NATIVE_KINDS)
        if native is not None:
            assert torch.equal(create_mask(native, batch, heads, s, s, device="cpu"), want), case.family
        assert torch.equal(providers.dense_mask(iv, s, heads, rows_per_chunk=13).expand_as(want), want)


def test_intervals_mask_mod_of_kv_heads_and_broadcast_dimensions():
    """intervals_mask_mod of a mask with one row per KV head (query head h reads h // group) and of
    one that broadcasts over batch and heads (no literal index into its tables: the FLASH backend's
    CuTe tracing takes only the function's own arguments as indices)."""
    from torch.nn.attention.flex_attention import create_mask

    s, batch, heads = 61, 2, 4
    gen = torch.Generator().manual_seed(3)
    ends = torch.randint(0, s + 1, (batch, 2, s, 4), generator=gen).sort(-1).values.to(torch.int32)
    want = intervals_to_dense(ends, s)  # [B, 2, S, S]
    mask_mod, planes = providers.intervals_mask_mod(ends, heads)
    got = create_mask(mask_mod, batch, heads, s, s, device="cpu")
    assert torch.equal(got, want.repeat_interleave(2, dim=1))
    assert all(p.shape == (batch, 2, s) for p in planes)
    mask_mod, planes = providers.intervals_mask_mod(ends[:1, :1], heads)
    assert all(p.shape == (s,) for p in planes)
    got = create_mask(mask_mod, batch, heads, s, s, device="cpu")
    assert torch.equal(got, want[:1, :1].expand(batch, heads, s, s))


def test_readme_table_is_generated_between_the_markers(tmp_path):
    env = {"date": "2026-11-22T00:00:00+00:00", "gpu": "Test GPU", "torch": "2.11", "triton": "3.6",
           "command": "python -m benchmarks.run --shapes 8K:128", "mode": "gpu"}
    base = dict(env, family="causal", params="", batch=4, heads=16, kv_heads=16, seqlen=8192, head_dim=128,
                dtype="bfloat16", density=0.5)
    writer = report.CsvWriter(str(tmp_path / "gpu.csv"))
    writer.write([
        dict(base, provider="flexmask", status="ok", fwd_tflops=412.3, bwd_tflops=301.0, fwd_bwd_tflops=330.4,
             fwd_vs_flex=1.31, bwd_vs_flex=1.2, fwd_bwd_vs_flex=1.25, mask_build_ms=0.21, mask_bytes=4096,
             check="pass"),
        dict(base, provider="flex", status="ok", fwd_tflops=314.7, bwd_tflops=250.8, fwd_bwd_tflops=264.3,
             mask_build_ms=3.5, mask_bytes=9000),
        dict(base, provider="sdpa_cudnn", status="OOM"),
    ])
    writer.close()
    readme = tmp_path / "README.md"
    readme.write_text("# title\n<!-- results:start -->\nold\n<!-- results:end -->\ntail\n")
    assert readme_table.main([str(tmp_path / "gpu.csv"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n<!-- results:start -->\n") and text.endswith("<!-- results:end -->\ntail\n")
    assert "old" not in text and "Test GPU" in text
    assert "| causal | 8K | 4 | 0.500 | 412 / 315 | 301 / 251 | 330 / 264 | 1.31x / 1.20x / 1.25x |" in text
    assert "OOM" in text
    assert readme_table.main([str(tmp_path / "gpu.csv"), "--readme", str(readme), "--check"]) == 0


def test_readme_summary_block_is_the_32k_d128_rows(tmp_path):
    """The README's summary block takes the S = 32K, D = 128 rows of a CSV, and names SDPA's
    backends on full and causal in one line; --readme fills whichever blocks a file has."""
    env = {"date": "2026-11-22T00:00:00+00:00", "gpu": "Test GPU", "torch": "2.11", "triton": "3.6",
           "command": "python -m benchmarks.run", "mode": "gpu"}
    rows = []
    for seqlen, head_dim, tflops in ((32768, 128, 500.0), (8192, 128, 111.0), (32768, 64, 222.0)):
        base = dict(env, family="full", params="", batch=1, heads=16, kv_heads=16, seqlen=seqlen, head_dim=head_dim,
                    dtype="bfloat16", density=1.0)
        rows += [dict(base, provider="flexmask", status="ok", fwd_tflops=tflops, bwd_tflops=tflops, fwd_bwd_tflops=tflops,
                      fwd_vs_flex=1.5, bwd_vs_flex=1.4, fwd_bwd_vs_flex=1.45, mask_build_ms=0.1, mask_bytes=4096,
                      check="pass"),
                 dict(base, provider="flex", status="ok", fwd_tflops=300.0, bwd_tflops=300.0, fwd_bwd_tflops=300.0),
                 dict(base, provider="sdpa_cudnn", status="ok", fwd_tflops=610.0, fwd_bwd_tflops=548.0)]
    writer = report.CsvWriter(str(tmp_path / "summary.csv"))
    writer.write(rows)
    writer.close()
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n{readme_table.SUMMARY_START}\nold\n{readme_table.SUMMARY_END}\n")
    assert readme_table.main([str(tmp_path / "summary.csv"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old" not in text and "| full | 32K | 1 | 1.000 | 500 / 300 |" in text
    assert "111" not in text and "222" not in text  # only S = 32K, D = 128
    assert "full: cudnn 610 / 548." in text
    assert readme_table.main([str(tmp_path / "summary.csv"), "--readme", str(readme), "--check"]) == 0


def test_repository_results_blocks_are_generated():
    """The README's summary and docs/results.md's full block are what readme_table gives from
    the committed CSVs (regenerate with `python -m benchmarks.readme_table`)."""
    assert readme_table.regenerate(check=True, quiet=True) == 0


def test_summary_leaves_out_peers_that_are_not_installed(monkeypatch, capsys):
    """`python -m benchmarks.run` on a GPU: 32K, D = 128, 16/16 heads, flexmask and the peers that
    import; a missing one is left out with a one-line note."""
    from benchmarks import run

    monkeypatch.setattr(providers.Flex, "missing", lambda self: "FlexAttention is not importable here")
    opts = run.make_options(run.build_parser().parse_args([]), quick=False)
    assert opts.shapes == [(32768, 128)] and opts.sweep_shapes == [] and opts.heads == 16
    assert opts.kv_heads in (None, 16) and str(opts.dtype) == "torch.bfloat16"
    assert opts.providers == ["flexmask", "sdpa_cudnn", "sdpa_flash"]
    assert capsys.readouterr().err.strip() == "note: flex left out: FlexAttention is not importable here"
    full = run.make_options(run.build_parser().parse_args(["--full"]), quick=False)
    assert len(full.shapes) == 6 and full.sweep_shapes == [(32768, 128)] and "flexmask_det" in full.providers


def test_targets_reports_misses(tmp_path):
    """tools.targets flags a case under its target and counts the ones met."""
    from tools import targets

    fields = ["provider", "family", "params", "seqlen", "head_dim", "status", "mode", "fwd_vs_flex", "bwd_vs_flex",
              "fwd_bwd_vs_flex", "fwd_tflops", "bwd_tflops"]
    rows = [
        ["flexmask", "causal", "", "32768", "128", "ok", "gpu", "1.3", "1.3", "1.3", "550", "500"],
        ["flexmask", "document", "", "8192", "128", "ok", "gpu", "1.1", "1.3", "1.3", "400", "400"],
        ["sdpa_cudnn", "causal", "", "32768", "128", "ok", "gpu", "", "", "", "600", "600"],
        ["flexmask_det", "causal", "", "32768", "128", "ok", "gpu", "", "0.9", "", "", ""],
    ]
    path = tmp_path / "gpu.csv"
    path.write_text("\n".join(",".join(r) for r in [fields, *rows]) + "\n")
    out = targets.check(str(path))
    assert "document 8K D=128: forward 1.10x FlexAttention" in out
    assert "causal 32K D=128: backward 0.83x SDPA cuDNN" in out
    assert "causal 32K D=128: deterministic backward 0.90x FlexAttention" in out
    assert out[-1] == "4 of 7 checks met"


def test_error_status_keeps_the_cause_under_a_rule():
    """A failed row says what failed: Inductor's template errors put a rule of "=" under their
    first line and the cause below it; the status takes the cause, not the rule."""
    from benchmarks.report import error_message, error_status

    err = RuntimeError("CuteDSL template failed:\n" + "=" * 80 + "\nNotImplementedError: floordiv of index\nmore")
    assert error_status(err) == "error: RuntimeError: CuteDSL template failed: NotImplementedError: floordiv of index"
    assert error_message(ValueError("x" * 300), 10) == "ValueError: " + "x" * 10
    assert error_status(KeyError()) == "error: KeyError: "
