"""tools.targets on the issues' CSVs: each check pairs rows as the benchmark's own table does (one
run, the last card), flags what misses with its figure, and counts what has no figure."""

import csv

import pytest

from benchmarks import mask_mod, peers, per_call
from tools import targets


def write(path, columns, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    return str(path)


def peer_row(family, provider, fwd, bwd, s=8192, d=128, heads=(16, 16), gpu="H200", command="run 1"):
    return {"date": "2026-01-01", "gpu": gpu, "torch": "2", "triton": "3", "command": command, "family": family,
            "seq_len": s, "batch": 4, "heads_q": heads[0], "heads_kv": heads[1], "head_dim": d,
            "provider": provider, "fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": "", "bwd_tflops": "", "status": "ok"}


def test_peers_ratios_per_direction_and_per_family(tmp_path):
    rows = [peer_row("causal", "flexmask", 1.0, 2.0), peer_row("causal", "fa4", 0.9, 2.2),
            peer_row("causal", "flex_flash", 1.1, 2.1), peer_row("causal", "flex", 1.5, 3.0),
            peer_row("document", "flexmask", 1.0, 1.0), peer_row("document", "flex_flash", 1.0, 1.0),
            peer_row("document", "flex", 1.5, 1.5)]
    out = targets.check(write(tmp_path / "peers.csv", peers.COLUMNS, rows), "38")
    assert "causal 8K D=128 16/16: flexmask / fa4 fwd 0.90" in out  # fa4's time over ours: ours slower
    assert "flexmask / fa4 bwd: 1 of 1 met, 1.10-1.10" in out
    assert "document 8K D=128 16/16: flexmask / flex_flash fwd+bwd 1.00" in out
    assert "flexmask / flex_flash fwd+bwd: 1 of 2 met, 1.00-1.07" in out
    assert "document 8K D=128 16/16: flexmask / flex fwd+bwd 1.50" not in out
    assert "flexmask / flex fwd+bwd: 2 of 2 met, 1.50-1.50" in out
    # every configuration of the suite without rows is counted, not taken as met
    missing = next(line for line in out if line.startswith("flexmask / fa4 fwd: no figure for"))
    assert f"no figure for {len(peers.PEER_FAMILIES) * 12 - 1}:" in missing


def test_peers_pairs_rows_of_one_run_on_the_last_card(tmp_path):
    rows = [peer_row("causal", "fa4", 0.5, 0.5, command="run 1"),  # another run than flexmask's last row
            peer_row("causal", "flexmask", 1.0, 1.0, command="run 2"),
            peer_row("full", "flexmask", 1.0, 1.0, gpu="H100"), peer_row("full", "fa4", 0.5, 0.5, gpu="H100"),
            peer_row("sliding_window_1024", "flexmask", 1.0, 1.0), peer_row("sliding_window_1024", "fa4", 1.2, 1.2)]
    out = targets.check(write(tmp_path / "peers.csv", peers.COLUMNS, rows), "38")
    assert "flexmask / fa4 fwd: 1 of 1 met, 1.20-1.20" in out
    assert not any("0.50" in line for line in out)


def per_call_row(case, s, provider, ms, batch=32, hq=16, hkv=16, gpu="H200", date="2026-01-01T00:00"):
    return {"date": date, "gpu": gpu, "torch": "2", "triton": "3", "command": "python -m benchmarks.per_call",
            "case": case, "seq_len": s, "batch": batch, "heads_q": hq, "heads_kv": hkv, "head_dim": 128,
            "provider": provider, "ms": ms}


def test_per_call_bounds(tmp_path):
    rows = [per_call_row("fwd_bwd", 512, "flexmask", 0.9), per_call_row("fwd_bwd", 512, "sdpa_cudnn", 0.6),
            per_call_row("fwd_bwd", 512, "flexmask_inline", 0.92),
            per_call_row("fwd_bwd", 8192, "flexmask", 4.0, batch=2), per_call_row("fwd_bwd", 8192, "sdpa_cudnn", 4.4, batch=2),
            per_call_row("fwd_bwd", 8192, "flexmask_inline", 4.6, batch=2),
            per_call_row("decode", 8192, "flexmask", 0.03, batch=1, hq=32, hkv=8),
            per_call_row("decode", 8192, "sdpa", 0.04, batch=1, hq=32, hkv=8)]
    out = targets.check(write(tmp_path / "per_call.csv", per_call.COLUMNS, rows), "39")
    assert "fwd_bwd S=512 B=32 16/16: fwd_bwd flexmask / sdpa_cudnn 1.50" in out
    assert "fwd_bwd S=8192 B=2 16/16: inline / compiled 1.15" in out
    assert "fwd_bwd flexmask / sdpa_cudnn: 1 of 2 met, 0.91-1.50" in out
    assert "inline / compiled: 1 of 2 met, 1.02-1.15" in out
    assert "decode flexmask / sdpa: 1 of 1 met, 0.75-0.75" in out


def mask_row(family, provider, s, fwd="", bwd="", compile_ms="", status="ok", command="run 1"):
    return {"date": "2026-01-01", "gpu": "H200", "torch": "2", "triton": "3", "command": command,
            "family": family, "seq_len": s, "batch": 1, "heads_q": 16, "heads_kv": 16, "head_dim": 128,
            "provider": provider, "fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": "", "bwd_tflops": "",
            "compile_ms": compile_ms, "mask_bytes": "", "status": status}


def test_mask_mod_speed_compile_and_status_rows(tmp_path):
    rows = [mask_row("natten2d_k9", "flexmask", 16384, 1, 1, 2.0),
            mask_row("natten2d_k9", "flexmask_mod", 16384, 1, 1, 3.0),
            mask_row("natten2d_k9", "flex", 16384, 1.5, 1.5, 2.0),
            mask_row("natten2d_k9", "flex_flash", 16384, status="error: CuteDSL template failed"),
            mask_row("natten2d_k13", "flexmask", 16384, status="needs 20 runs > 16"),
            mask_row("natten2d_k13", "flex", 16384, 1, 1, 4.0),
            mask_row("dinat2d_k7_d2", "flexmask", 16384, 1, 1, 2.0),
            mask_row("dinat2d_k7_d2", "flexmask_mod", 16384,
                     status="error: ValueError: masks.from_mask_mod(f): key column 1 has 17 masked runs"),
            mask_row("dinat2d_k7_d2", "flex", 16384, 2, 2, 3.0)]
    out = targets.check(write(tmp_path / "mask_mod.csv", mask_mod.COLUMNS, rows), "41")
    assert "natten2d_k9 16K: compile from_mask_mod / create_block_mask 1.50" in out
    assert "flexmask / flex fwd+bwd: 2 of 2 met, 1.50-2.00" in out
    assert ("compile from_mask_mod / create_block_mask: no figure for 1: dinat2d_k7_d2 16K (from_mask_mod: key "
            "column 1 has 17 masked runs)") in out
    assert "flexmask: no figure for 1: natten2d_k13 16K (needs 20 runs > 16)" in out
    assert "flexmask / flex_flash fwd+bwd: no figure for 1: natten2d_k9 16K" in out


@pytest.mark.parametrize("issue", ["38", "39", "41"])
def test_committed_csvs_read(issue, capsys):
    """The committed CSVs parse and give a count line per target."""
    targets.main(["--issue", issue])
    assert " met, " in capsys.readouterr().out
