"""examples/train_context_parallel.py on the CPU: two gloo ranks train the tiny GPT with
`fmd.attention` and must match one process training the same model on the same tokens."""

from __future__ import annotations

import csv
import os

import pytest

from examples import train_context_parallel

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="flexmask on CPU needs TRITON_INTERPRET=1"
)


@needs_interpreter
def test_two_ranks_match_one_process(tmp_path):
    # seed 6: the second 128-byte sequence packs two documents, so the mask is not plain causal
    assert train_context_parallel.main(["--tiny", "--nproc", "2", "--seed", "6", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "train_context_parallel.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    single = [r for r in rows if r["mode"] == "single"]
    multi = [r for r in rows if r["mode"] == "context_parallel"]
    (summary,) = [r for r in rows if r["mode"] == "summary"]
    assert len(single) == len(multi) == 2 and [r["docs"] for r in multi] == ["1", "2"]
    for a, b in zip(single, multi):
        assert abs(float(a["loss"]) - float(b["loss"])) <= train_context_parallel.FP32_TOLERANCE
        assert a["real_tokens"] == b["real_tokens"]
    assert summary["verdict"] == "PASS" and float(summary["max_abs_diff"]) <= float(summary["tolerance"])
    assert (tmp_path / "train_context_parallel.png").exists()

    # the README table of the run: one line, its speedup from the summary's tokens/s per GPU
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- cp-training:start -->\nold\n<!-- cp-training:end -->\nafter\n")
    csv_path = str(tmp_path / "train_context_parallel.csv")
    assert train_context_parallel.main(["--table", csv_path, "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old" not in text and text.startswith("before\n") and text.endswith("after\n")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("| 2 | ")]
    speedup = 2 * float(summary["tokens_per_s_per_gpu_multi"]) / float(summary["tokens_per_s_per_gpu_single"])
    assert f"| {speedup:.2f}x |" in line and "| PASS |" in line


def test_table_needs_the_summary_row(tmp_path):
    path = tmp_path / "run.csv"
    path.write_text("mode,gpus,step,loss\nsingle,1,1,5.0\n")
    with pytest.raises(ValueError, match="no summary row"):
        train_context_parallel.markdown_table([str(path)])


def test_sequence_must_split_into_2w_chunks():
    with pytest.raises(SystemExit, match="multiple of 2 x --nproc"):
        train_context_parallel.main(["--tiny", "--nproc", "3", "--seq-len", "100"])
