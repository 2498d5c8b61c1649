"""Smoke tests of the packed-document training example (examples/train_packed_lm.py).

CPU only and fast: the tiny model (2 layers, d_model 64, 2 query heads / 1 KV head of D=32,
128-byte sequences) with the flexmask kernels under the Triton interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples import train_packed_lm
from examples.gpt_model import ModelConfig, build_attention_mask, build_model, dense_document_mask
from examples.packed_data import IGNORE_INDEX, collate, pack_documents, packed_batches, stdlib_source_files
from examples.train_packed_lm import TINY_MODEL, language_model_loss
from flexmask import masks

REPO = Path(__file__).resolve().parents[1]
# the tiny runs put the flexmask kernels on the CPU, which only the interpreter can run
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="flexmask on CPU needs TRITON_INTERPRET=1"
)


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# -- data --------------------------------------------------------------------------------------------
def test_pack_whole_documents_truncate_and_pad():
    docs = iter([b"a" * 5, b"b" * 3, b"c" * 6, b"d" * 20, b"e" * 2, b"f" * 1] + [b"g" * 9] * 10)
    packs = pack_documents(docs, seq_len=10)
    got = [(p.tokens, p.seqlens, p.pad) for p in (next(packs) for _ in range(4))]
    assert got == [
        (b"aaaaabbb\0\0", [5, 3, 2], 2),  # c (6) does not fit: padding is its own document
        (b"cccccc\0\0\0\0", [6, 4], 4),  # d (20) does not fit after c
        (b"d" * 10, [10], 0),  # d truncated to the sequence length
        (b"eef\0\0\0\0\0\0\0", [2, 1, 7], 7),
    ]


def test_targets_never_cross_a_document():
    batch = collate([next(pack_documents(iter([b"abc", b"de", b"x" * 10]), seq_len=8))])
    assert batch.seqlens == [[3, 2, 3]]
    expected = [ord("b"), ord("c"), IGNORE_INDEX, ord("e"), IGNORE_INDEX] + [IGNORE_INDEX] * 3
    assert batch.targets[0].tolist() == expected
    assert batch.num_real_tokens == 3


def test_data_order_is_deterministic_per_seed():
    files = stdlib_source_files()
    assert files and all(p.suffix == ".py" for p in files)
    first = [next(packed_batches(64, 2, seed=3, files=files)).inputs for _ in range(2)]
    assert torch.equal(first[0], first[1])
    other = next(packed_batches(64, 2, seed=4, files=files)).inputs
    assert not torch.equal(first[0], other)
    batch = next(packed_batches(64, 2, seed=3, files=files))
    assert all(sum(row) == 64 for row in batch.seqlens)


def test_dense_sdpa_mask_equals_flexmask_document_mask():
    seqlens = [[50, 1, 77], [128]]
    expected = masks.document(seqlens).to_dense(128, 128)
    assert torch.equal(dense_document_mask(seqlens, "cpu"), expected.expand(2, 1, 128, 128))


# -- training ----------------------------------------------------------------------------------------
@needs_interpreter
def test_tiny_parity_flexmask_matches_sdpa(tmp_path):
    """Same init, data and seed: in fp32 the loss curves agree to 1e-3 nats."""
    train_packed_lm.main(["parity", "--tiny", "--steps", "2", "--log-every", "0", "--out-dir", str(tmp_path)])
    (row,) = _read_csv(tmp_path / "train_parity_tiny_summary.csv")
    assert row["backend"] == "flexmask" and row["verdict"] == "PASS", row
    assert float(row["max_abs_diff"]) <= 1e-3
    steps = _read_csv(tmp_path / "train_parity_tiny.csv")
    assert {r["backend"] for r in steps} == {"sdpa", "flexmask"} and len(steps) == 4
    assert all(r["command"].startswith("python -m examples.train_packed_lm parity") for r in steps)
    assert (tmp_path / "train_parity_tiny.png").stat().st_size > 0


@needs_interpreter
def test_tiny_scale_writes_csv_and_plot(tmp_path):
    train_packed_lm.main(
        [
            "scale",
            "--tiny",
            "--seq-lens",
            "64",
            "--backends",
            "flexmask",
            "sdpa",
            "--steps",
            "1",
            "--out-dir",
            str(tmp_path),
        ]
    )
    rows = _read_csv(tmp_path / "train_scale_tiny.csv")
    assert [(r["backend"], r["seq_len"], r["status"]) for r in rows] == [("flexmask", "64", "ok"), ("sdpa", "64", "ok")]
    assert all(float(r["tokens_per_s"]) > 0 and r["torch"] == torch.__version__ for r in rows)
    assert (tmp_path / "train_scale_tiny.png").stat().st_size > 0


def test_scale_records_out_of_memory(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(train_packed_lm, "train", out_of_memory)
    parsed = train_packed_lm.parse_args(["scale", "--tiny"])
    point = train_packed_lm.measure_scale_point(train_packed_lm.run_config(parsed), "sdpa", 64, 1)
    assert point["status"] == "OOM"


@needs_interpreter
def test_cli_tiny_train_runs_as_a_module():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "examples.train_packed_lm", "train", "--tiny", "--steps", "1"],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "flexmask: 1 steps" in proc.stderr + proc.stdout


def test_cli_refuses_flexmask_on_cpu_without_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "examples.train_packed_lm", "train", "--tiny", "--device", "cpu"],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr


# -- torch.compile -----------------------------------------------------------------------------------
def _varied_batches():
    """Two batches of real text whose document layouts (and so tile tables) differ."""
    text = stdlib_source_files()[0].read_bytes() * 4
    packs = pack_documents(iter([text[:128], text[:40], text[:30], text[:90]]), seq_len=128)
    return [collate([next(packs)]) for _ in range(2)]


@needs_interpreter
def test_compiled_model_trains_fullgraph_through_flexmask():
    """torch.compile(model, fullgraph=True) raises on any graph break; the CompiledMask is built
    outside the compiled region and passed in, a different one each step."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build_model(TINY_MODEL, "flexmask", seed=0, device="cpu")
    eager = build_model(TINY_MODEL, "flexmask", seed=0, device="cpu")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = _varied_batches()
    assert batches[0].seqlens != batches[1].seqlens
    losses = []
    for batch in batches:
        mask = build_attention_mask("flexmask", batch.seqlens, "cpu")
        loss = language_model_loss(compiled(batch.inputs, mask), batch.targets)
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert torch._dynamo.utils.counters["graph_break"] == {}
    first = batches[0]
    reference = language_model_loss(
        eager(first.inputs, build_attention_mask("flexmask", first.seqlens, "cpu")), first.targets
    )
    assert losses[0] == pytest.approx(reference.item(), abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels on the GPU")
def test_compiled_model_trains_fullgraph_on_gpu():
    """The same with the default (inductor) backend and bf16 autocast: no graph break, and the
    first loss equals the eager dense-mask SDPA model's within bf16 rounding."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = ModelConfig(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=512)
    model = build_model(cfg, "flexmask", seed=0, device="cuda")
    sdpa_model = build_model(cfg, "sdpa", seed=0, device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = packed_batches(2048, 2, seed=0)
    losses = []
    for _ in range(3):
        batch = next(batches).to("cuda")
        mask = build_attention_mask("flexmask", batch.seqlens, "cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = language_model_loss(compiled(batch.inputs, mask), batch.targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert torch._dynamo.utils.counters["graph_break"] == {}
    assert all(math.isfinite(x) for x in losses)
    first = next(packed_batches(2048, 2, seed=0)).to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        dense = build_attention_mask("sdpa", first.seqlens, "cuda")
        reference = language_model_loss(sdpa_model(first.inputs, dense), first.targets).item()
    assert losses[0] == pytest.approx(reference, abs=2e-2)
