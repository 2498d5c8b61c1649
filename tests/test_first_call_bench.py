"""benchmarks.first_call without a GPU: the run order, the cold caches a child gets, how a child's
results are read back (a timeout or a crash keeps the steps it finished), the CSV rows and the
table of docs/results.md."""

import json
import sys
import time

import pytest
import torch

from benchmarks import first_call
from benchmarks.report import CsvWriter, read_csv

ENV = {"date": "2026-01-01T00:00:00", "gpu": "GPU", "torch": "2", "triton": "3",
       "command": "python -m benchmarks.first_call"}


def test_plan_runs_flexmask_first():
    specs = first_call.plan(["flex", "flexmask"], [128, 64])
    assert [s["provider"] for s in specs[:4]] == ["flexmask"] * 4
    assert [(s["case"], s["head_dim"]) for s in specs[:4]] == [("causal", 128), ("causal_document", 128),
                                                               ("causal", 64), ("causal_document", 64)]
    assert {s["provider"] for s in specs[4:]} == {"flex"} and len(specs) == 8


def test_cold_env_moves_every_cache_to_a_new_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/warm")
    env = first_call.cold_env(str(tmp_path))
    assert "TRITON_INTERPRET" not in env
    for name in first_call.CACHE_VARS:
        folder = tmp_path / name.lower()
        assert env[name] == str(folder) and folder.is_dir() and not any(folder.iterdir())


def test_child_result_reads_the_last_results_line():
    lines = [first_call.RESULT + json.dumps({"compile_mask_ms": 1.5}), "a warning",
             first_call.RESULT + json.dumps({"compile_mask_ms": 1.5, "first_fwd_ms": 900.0, "status": "ok"})]
    assert first_call.child_result("\n".join(lines), "", 0) == {"compile_mask_ms": 1.5, "first_fwd_ms": 900.0,
                                                                "status": "ok"}


def test_child_result_of_a_timeout_or_a_crash_keeps_the_finished_steps():
    partial = first_call.RESULT + json.dumps({"compile_mask_ms": 2.0})
    timed_out = first_call.child_result(partial + "\n", "", -9, timed_out_after=150)
    assert timed_out == {"compile_mask_ms": 2.0, "status": "timeout after 150 s"}
    crashed = first_call.child_result(partial, "Traceback\nSegmentation fault\n", -11)
    assert crashed == {"compile_mask_ms": 2.0, "status": "error: exit -11: Segmentation fault"}
    assert first_call.child_result("", "", 1)["status"] == "error: exit 1: "


def test_run_child_stops_a_slow_child_with_cold_caches():
    """A real child: it sees empty cache folders, and its timeout stops it without losing the step
    it reported."""
    script = ("import json, os, time; "
              "empty = all(not os.listdir(os.environ[n]) for n in %r); "
              "print(%r + json.dumps({'compile_mask_ms': 1.0, 'empty': empty}), flush=True); "
              "time.sleep(60)") % (first_call.CACHE_VARS, first_call.RESULT)
    start = time.monotonic()
    result = first_call.run_child([sys.executable, "-c", script], timeout_s=5)
    assert time.monotonic() - start < 30
    assert result == {"compile_mask_ms": 1.0, "empty": True, "status": "timeout after 5 s"}


def test_measure_writes_a_row_per_spec_and_skips_past_the_deadline(tmp_path):
    specs = first_call.plan(["flexmask"], [64])
    seen = []

    def run(spec, left):
        seen.append(left)
        return {"compile_mask_ms": 3.0, "first_fwd_ms": 1200.0, "first_bwd_ms": 2500.0, "warm_fwd_bwd_ms": 0.8,
                "status": "ok"}

    path = tmp_path / "first_call.csv"
    with CsvWriter(str(path), columns=first_call.COLUMNS) as writer:
        first_call.measure(specs[:1], ENV, lambda row: writer.write([row]), time.monotonic() + 100, run,
                           log=lambda line: None)
        first_call.measure(specs[1:], ENV, lambda row: writer.write([row]), time.monotonic() - 1, run,
                           log=lambda line: None)
    rows = read_csv(str(path))
    assert len(seen) == 1 and 0 < seen[0] <= 100
    assert tuple(rows[0]) == first_call.COLUMNS
    assert rows[0]["first_bwd_ms"] == "2500" and rows[0]["status"] == "ok" and rows[0]["provider"] == "flexmask"
    assert rows[1]["case"] == "causal_document" and rows[1]["first_fwd_ms"] == ""
    assert rows[1]["status"] == "skipped: time budget spent"


def test_table_command_writes_the_results_block(tmp_path):
    path = tmp_path / "first_call.csv"
    rows = [{**ENV, "case": "causal", "head_dim": 128, "provider": "flexmask", "compile_mask_ms": 250.0,
             "first_fwd_ms": 4000.0, "first_bwd_ms": 9750.0, "warm_fwd_bwd_ms": 1.25, "status": "ok"},
            {**ENV, "case": "causal", "head_dim": 128, "provider": "flex", "compile_mask_ms": 5000.0,
             "status": "timeout after 150 s"}]
    with CsvWriter(str(path), columns=first_call.COLUMNS) as writer:
        writer.write(rows)
    full = tmp_path / "results.md"
    full.write_text(f"intro\n{first_call.FULL_START}\nold\n{first_call.FULL_END}\ntail\n")
    assert first_call.main(["--table", str(path), "--full", str(full)]) == 0
    text = full.read_text()
    assert "old" not in text and text.endswith(f"{first_call.FULL_END}\ntail\n")
    assert "| causal | 128 | GPU | flexmask | 250.0 | 4000.0 | 9750.0 | 14.00 | 1.250 | ok |" in text
    assert "| causal | 128 | GPU | flex | 5000.0 | - | - | - | - | timeout after 150 s |" in text
    assert "`python -m benchmarks.first_call`" in text  # the run's command


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_child_without_cuda_reports_its_error(capsys):
    spec = {"provider": "flexmask", "case": "causal", "head_dim": 64}
    assert first_call.main(["--child", json.dumps(spec)]) == 0
    result = first_call.child_result(capsys.readouterr().out, "", 0)
    assert result["status"].startswith("error: RuntimeError") and "first_fwd_ms" not in result


def test_main_writes_the_csv_and_leaves_out_what_is_not_importable(tmp_path, monkeypatch, capsys):
    """The parent's wiring with the GPU parts stubbed: a child per case, fa4 left out with a note."""
    from benchmarks import cuda_guard, peers

    monkeypatch.setattr(cuda_guard, "require_cuda", lambda *args: None)
    monkeypatch.setattr(first_call, "environment", lambda mode, argv: dict(ENV, mode=mode))
    monkeypatch.setattr(peers, "missing", lambda name: "ImportError: no flash_attn" if name == "fa4" else None)
    commands = []

    def run_child(command, timeout_s):
        commands.append(json.loads(command[-1]))
        return {"compile_mask_ms": 1.0, "first_fwd_ms": 2.0, "first_bwd_ms": 3.0, "warm_fwd_bwd_ms": 0.5,
                "status": "ok"}

    monkeypatch.setattr(first_call, "run_child", run_child)
    assert first_call.main(["--head-dims", "64", "--out", str(tmp_path)]) == 0
    assert "note: fa4 left out: ImportError: no flash_attn" in capsys.readouterr().out
    rows = read_csv(str(tmp_path / "first_call.csv"))
    assert [(r["provider"], r["case"]) for r in rows] == [(c["provider"], c["case"]) for c in commands] == [
        ("flexmask", "causal"), ("flexmask", "causal_document"), ("flex", "causal"), ("flex", "causal_document")]
    assert rows[0]["command"] == "python -m benchmarks.first_call --head-dims 64 --out " + str(tmp_path)
