"""benchmarks.peers without a GPU: the peer cases state one mask for every provider (flexmask's
spec, FlexAttention's mask_mod, FlashAttention's varlen lengths), and the tables follow the rows."""

import csv

import pytest
import torch

from benchmarks import peers

ENV = {"date": "2026-01-01", "gpu": "GPU", "torch": "2", "triton": "3", "command": "python -m benchmarks.peers"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_document_split_stays_in_range_and_sums(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = peers.document_split(100, gen, (8, 24))
    assert sum(lengths) == 100 and all(8 <= n for n in lengths) and all(n <= 24 + 8 for n in lengths)


def test_document_case_is_one_mask_for_every_provider():
    """flexmask's document spec, the mask_mod FlexAttention gets and FA4's cu_seqlens agree."""
    s, batch = 64, 2
    case = peers.peer_case("causal_document", s, batch, seed=3, doc_range=(8, 24))
    dense = case.mask.to_dense(s, s)  # (B, 1, S, S) or (S, S)
    dense = dense if dense.dim() == 4 else dense.expand(batch, 1, s, s)
    mod = peers.document_mask_mod(case.doc_lengths, "cpu")
    q, kv = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    for b in range(batch):
        assert torch.equal(mod(torch.tensor(b), torch.tensor(0), q, kv), dense[b, 0])
    cu, longest = peers.cu_seqlens(case.doc_lengths, "cpu")
    assert int(cu[-1]) == s * batch and longest == max(max(r) for r in case.doc_lengths)
    assert case.fa4 == {"causal": True}


def test_window_case_matches_flashattention_window():
    case = peers.peer_case("sliding_window_1024", 2048, 1)
    dense = case.mask.to_dense(2048, 2048)
    assert int(dense[2047].sum()) == peers.WINDOW and case.fa4["window_size"] == (peers.WINDOW - 1, 0)


def row(family, provider, fwd, bwd, ftf, btf, s=32768, d=128, hq=16, hkv=16):
    return {**ENV, "family": family, "seq_len": s, "batch": 1, "heads_q": hq, "heads_kv": hkv, "head_dim": d,
            "provider": provider, "fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": ftf, "bwd_tflops": btf, "status": "ok"}


def test_table_ratios(tmp_path):
    rows = [row("causal", "flexmask", "2.0", "5.0", "600", "500"), row("causal", "fa4", "1.8", "5.5", "660", "450"),
            row("causal", "flex_flash", "3.0", "7.0", "400", "350"), row("qk_sparse", "flexmask", "1", "2", "1", "1"),
            row("causal", "flexmask", "1", "1", "1", "1", d=64)]
    line = next(x for x in peers.table(rows).splitlines() if x.startswith("| causal | 32K | 128 |"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[4:] == ["600 / 500", "660 / 450", "0.90, 1.10", "1.43", "-"]
    path = tmp_path / "peers.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=peers.COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    readme, full = tmp_path / "README.md", tmp_path / "results.md"
    readme.write_text(f"{peers.START}\nold\n{peers.END}\n")
    full.write_text(f"{peers.FULL_START}\nold\n{peers.FULL_END}\n")
    assert peers.main(["--table", str(path), "--readme", str(readme), "--full", str(full)]) == 0
    assert "qk_sparse" not in readme.read_text() and "| 64 |" not in readme.read_text()  # the summary: FA4's masks, D=128
    assert "qk_sparse" in full.read_text() and "old" not in full.read_text()
