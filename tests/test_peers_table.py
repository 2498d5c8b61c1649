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


# -- the score_terms suite ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", peers.SCORE_FAMILIES)
def test_score_case_states_one_mask_and_term_for_every_provider(family):
    """flexmask's spec, FA4's window_size and FlexAttention's natural mask_mod agree; the window
    holds N keys per query (itself included); the case carries its model's term and shape."""
    from benchmarks.flex_masks import native_mask_mod

    s = 4200  # longer than the longest window
    case = peers.score_case(family, s, 1)
    dense = case.mask.to_dense(s, s)
    q, kv = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    assert torch.equal(native_mask_mod(case.mask, s, "cpu")(0, 0, q, kv), dense)
    left, right = case.fa4.get("window_size", (s, 0))
    fa4_dense = (kv <= q) & (q - kv <= left) & (kv - q <= right)
    assert case.fa4["causal"] and torch.equal(fa4_dense, dense)
    if "window" in family:
        assert int(dense[-1].sum()) == int(family.rpartition("window")[2])
    assert case.sinks == family.startswith("gpt_oss") and case.softcap == (50.0 if "softcap50" in family else 0.0)
    assert peers.score_shape(family) == ((64, (64, 8)) if family.startswith("gpt_oss") else (128, (16, 8)))


def test_score_case_rejects_unknown_family():
    with pytest.raises(ValueError, match=r"family must be one of .*gpt_oss_sinks_window128.*, got 'gemma_sinks'"):
        peers.score_case("gemma_sinks", 64, 1)


def test_flex_score_terms_match_the_reference():
    """What the flex providers run for the terms (softcap as a score_mod, sinks by the LSE rescale),
    on eager FlexAttention on the CPU with a windowed block mask and GQA: the output, and the
    sinks' gradient, against the float64 reference. (FlexAttention has no backward on the CPU; the
    sinks' gradient needs none from it: the LSE is a constant to the sinks.)"""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from benchmarks.flex_masks import native_mask_mod
    from flexmask import masks, reference

    gen = torch.Generator().manual_seed(0)
    s, hq, hkv, d = 128, 4, 2, 16
    q = torch.randn(1, hq, s, d, generator=gen)
    k, v = (torch.randn(1, hkv, s, d, generator=gen) for _ in range(2))
    sinks = (torch.randn(hq, generator=gen) * 2).requires_grad_()
    mask = masks.sliding_window(31)  # shorter than the sequence, so the block mask matters
    block_mask = create_block_mask(native_mask_mod(mask, s, "cpu"), None, None, s, s, device="cpu")
    dout = torch.randn(1, hq, s, d, generator=gen)
    for softcap, with_sinks in ((3.0, False), (0.0, True), (3.0, True)):
        kwargs = {"block_mask": block_mask, "enable_gqa": True}
        if softcap:
            kwargs["score_mod"] = peers.softcap_score_mod(softcap)
        if with_sinks:
            out = peers.flex_with_sinks(flex_attention, peers.flex_lse_request(), q, k, v, sinks, **kwargs)
        else:
            out = flex_attention(q, k, v, **kwargs)
        ref, _ = reference.attention(q, k, v, mask, softcap=softcap, sinks=sinks if with_sinks else None)
        assert (out.double() - ref).abs().max() < 1e-5, (softcap, with_sinks)
        if with_sinks:
            (got,), (want,) = (torch.autograd.grad(o, sinks, g) for o, g in ((out, dout), (ref, dout.double())))
            assert (got.double() - want).abs().max() < 1e-4 * max(1.0, float(want.abs().max())), softcap
    # the test can fail: without the rescale the output is not the sinks' output
    plain = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    ref, _ = reference.attention(q, k, v, mask, sinks=sinks)
    assert (plain.double() - ref).abs().max() > 1e-2


def test_score_terms_plan_shapes_and_providers():
    plan = list(peers.score_terms_plan((8192, 131072), ["flexmask", "flexmask_no_term", "fa4", "sdpa_cudnn"]))
    assert len(plan) == 2 * len(peers.SCORE_FAMILIES)
    for make_case, heads, head_dim, chosen in plan:
        case = make_case()
        assert (head_dim, heads) == peers.score_shape(case.family)
        assert case.batch * case.seq_len == peers.TOKENS or case.batch == 1
        assert chosen == ["flexmask", "flexmask_no_term", "fa4"]  # SDPA takes no score terms


def test_score_table_term_cost_and_blocks(tmp_path):
    """The score-terms table: the term's cost (flexmask / flexmask_no_term per direction) next to the
    peer ratios; --table over two CSVs (a peers run and a score_terms run) writes each block from
    its own rows, and a run of one suite leaves the other suite's block alone."""
    fam = "gpt_oss_sinks_causal"
    scores = [row(fam, "flexmask", "2.1", "5.2", "500", "400", d=64, hq=64, hkv=8),
              row(fam, "flexmask_no_term", "2.0", "5.0", "520", "410", d=64, hq=64, hkv=8),
              row(fam, "fa4", "2.2", "5.72", "480", "360", d=64, hq=64, hkv=8),
              row(fam, "flex", "4.2", "10.4", "250", "200", d=64, hq=64, hkv=8)]
    line = next(x for x in peers.score_table(scores).splitlines() if x.startswith(f"| {fam} |"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[1:] == ["32K", "64", "64/8", "500 / 400", "1.05, 1.04", "480 / 360", "1.05, 1.10", "-", "2.00"]
    peer_csv, score_csv = tmp_path / "peers.csv", tmp_path / "scores.csv"
    for path, rows in ((peer_csv, [row("causal", "flexmask", "2.0", "5.0", "600", "500")]), (score_csv, scores)):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=peers.COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    readme = tmp_path / "results.md"  # --full: the full peers table and the score-terms table
    readme.write_text(f"{peers.FULL_START}\nold peers\n{peers.FULL_END}\n{peers.SCORE_START}\nold scores\n{peers.SCORE_END}\n")
    assert peers.main(["--table", str(score_csv), "--full", str(readme)]) == 0
    text = readme.read_text()
    assert "old peers" in text and "old scores" not in text and "term cost" in text
    assert peers.main(["--table", str(peer_csv), str(score_csv), "--full", str(readme)]) == 0
    peer_block = readme.read_text().split(peers.FULL_END)[0]
    assert "| causal | 32K | 128 |" in peer_block and fam not in peer_block
    # --readme: the score terms' summary takes their 32K rows only
    readme_md = tmp_path / "README.md"
    readme_md.write_text(f"{peers.README_SCORE_START}\nold\n{peers.README_SCORE_END}\n")
    longer = [{**r, "seq_len": "131072"} for r in scores]
    with open(score_csv, "a", newline="") as f:
        csv.DictWriter(f, fieldnames=peers.COLUMNS).writerows(longer)
    assert peers.main(["--table", str(score_csv), "--readme", str(readme_md)]) == 0
    summary = readme_md.read_text()
    assert f"| {fam} | 32K |" in summary and "| 128K |" not in summary and "old" not in summary


def test_table_names_every_run_its_rows_come_from():
    """A configuration measured again keeps its last row, and its ratios compare rows of that run
    only (a peer measured in another run is left out); the note lists the runs of the rows shown."""
    again = {"date": "2026-02-01", "command": "python -m benchmarks.peers --suite score_terms"}
    rows = [row("causal", "flexmask", "2.0", "5.0", "600", "500"), row("causal", "fa4", "1.8", "5.5", "660", "450"),
            {**row("causal", "flexmask", "1.0", "4.0", "700", "550"), **again},
            row("full", "flexmask", "3.0", "6.0", "500", "480")]
    text = peers.table(rows)
    line = next(x for x in text.splitlines() if x.startswith("| causal | 32K | 128 |"))
    assert "| 700 / 550 | - | - |" in line  # fa4's first-run row is not compared with the new flexmask row
    notes = [x for x in text.splitlines() if x.startswith("- GPU")]
    assert notes == ["- GPU, torch 2, triton 3, 2026-01-01: `python -m benchmarks.peers`.",
                     "- GPU, torch 2, triton 3, 2026-02-01: `python -m benchmarks.peers --suite score_terms`."]
    rows.append({**row("causal", "fa4", "0.9", "4.4", "660", "450"), **again})  # fa4 in the new run too
    line = next(x for x in peers.table(rows).splitlines() if x.startswith("| causal | 32K | 128 |"))
    assert "| 700 / 550 | 660 / 450 | 0.90, 1.10 |" in line
