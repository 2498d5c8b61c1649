"""benchmarks.per_call's table and README block, from rows (no GPU needed): every case gets its
table, flexmask's ratio to the named peer and the inline/compiled ratio are computed from the
rows, and a provider that failed keeps its row with a dash."""

import csv

from benchmarks import per_call

ENV = {"date": "2026-01-01", "gpu": "GPU", "torch": "2", "triton": "3", "command": "python -m benchmarks.per_call"}


def row(case, s, provider, ms, batch=32, hq=16, hkv=16):
    return {**ENV, "case": case, "seq_len": s, "batch": batch, "heads_q": hq, "heads_kv": hkv, "head_dim": 128,
            "provider": provider, "ms": ms}


def test_table_ratios_and_failures():
    rows = [row("fwd_bwd", 512, "flexmask", "1.0"), row("fwd_bwd", 512, "flexmask_inline", "1.1"),
            row("fwd_bwd", 512, "sdpa_cudnn", "2.0"), row("fwd_bwd", 512, "flex", "error: boom"),
            row("decode", 8192, "flexmask", "0.05", batch=1, hq=32, hkv=8),
            row("decode", 8192, "sdpa", "0.1", batch=1, hq=32, hkv=8)]
    text = per_call.table(rows)
    assert "**fwd_bwd**" in text and "**decode**" in text
    fwd_bwd = next(line for line in text.splitlines() if line.startswith("| 512 |"))
    assert fwd_bwd.split("|")[-3].strip() == "0.50" and fwd_bwd.split("|")[-2].strip() == "1.10"
    assert "| - |" in fwd_bwd  # flex failed: a dash, not a number
    decode = next(line for line in text.splitlines() if line.startswith("| 8192 |"))
    assert decode.split("|")[-2].strip() == "0.50"


def test_table_command_writes_the_readme_block(tmp_path):
    path = tmp_path / "per_call.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=per_call.COLUMNS)
        writer.writeheader()
        writer.writerows([row("fwd", 1024, "flexmask", "0.3"), row("fwd", 1024, "sdpa_cudnn", "0.2")])
    readme, full = tmp_path / "README.md", tmp_path / "results.md"
    readme.write_text(f"intro\n{per_call.START}\nold\n{per_call.END}\ntail\n")
    full.write_text(f"{per_call.FULL_START}\nold\n{per_call.FULL_END}\n")
    assert per_call.main(["--table", str(path), "--readme", str(readme), "--full", str(full)]) == 0
    assert "old" not in full.read_text() and "| 1024 | 32 | 16/16 | 0.300 | 0.200 | 1.50 |" in full.read_text()
    text = readme.read_text()
    assert "old" not in text and text.endswith("tail\n") and "| decode: B |" in text


def test_summary_ratios():
    rows = [row("fwd_bwd", 512, "flexmask", "1.2"), row("fwd_bwd", 512, "sdpa_cudnn", "0.6"),
            row("fwd_bwd", 512, "flexmask_inline", "1.32"),
            row("fwd_bwd", 512, "flexmask", "1.5", hq=32, hkv=8), row("fwd_bwd", 512, "sdpa_cudnn", "1.0", hq=32, hkv=8)]
    line = next(x for x in per_call.summary(rows).splitlines() if x.startswith("| 512 |"))
    assert line == "| 512 | 32 | 1.200 / 0.600 | 2.00 | 1.500 / 1.000 | 1.50 | 1.10, - |"


def test_launches_stubbed_restores_the_launcher():
    """per_call's `_python` rows stub flexmask's launches for the loop and put them back after,
    an exception included."""
    from benchmarks.per_call import _LaunchesStubbed
    from flexmask.kernels.common import launcher

    real, bound = launcher.FastLaunch.__call__, launcher.BoundLaunch.__call__
    with _LaunchesStubbed():
        assert launcher.FastLaunch.__call__ is not real and launcher.BoundLaunch.__call__ is not bound
        assert launcher.FastLaunch.__call__(object(), (1,), 1, 2, num_warps=4) is None
        assert launcher.BoundLaunch.__call__(object(), 1, 2) is None
    assert launcher.FastLaunch.__call__ is real and launcher.BoundLaunch.__call__ is bound
    try:
        with _LaunchesStubbed():
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert launcher.FastLaunch.__call__ is real and launcher.BoundLaunch.__call__ is bound


def test_table_command_shows_the_last_run_only(tmp_path):
    """per_call.csv keeps every run; --table shows the last one, under its own card's name."""
    old = {**row("fwd", 1024, "flexmask", "0.9"), "gpu": "OLD GPU", "date": "2025-01-01"}
    path = tmp_path / "per_call.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=per_call.COLUMNS)
        writer.writeheader()
        writer.writerows([old, {**old, "provider": "sdpa_cudnn", "ms": "0.1"},
                          row("fwd", 1024, "flexmask", "0.3")])
    full = tmp_path / "results.md"
    full.write_text(f"{per_call.FULL_START}\nold\n{per_call.FULL_END}\n")
    assert per_call.main(["--table", str(path), "--full", str(full)]) == 0
    text = full.read_text()
    assert "OLD GPU" not in text and "0.900" not in text and "| 1024 | 32 | 16/16 | 0.300 |" in text
    assert per_call.last_run([]) == []


def test_table_takes_each_case_from_its_last_run(tmp_path):
    """A run of some cases (`--cases decode`) replaces those cases only; another card's rows never
    mix in; each run taken is named with its cases."""
    train = {**row("fwd", 1024, "flexmask", "0.3"), "date": "2026-01-01T00:00", "command": "full run"}
    old_decode = {**row("decode", 8192, "flexmask", "0.9"), "date": "2026-01-01T00:00", "command": "full run"}
    new_decode = {**row("decode", 8192, "flexmask", "0.05"), "date": "2026-01-02T00:00", "command": "decode run"}
    other_card = {**row("fwd", 2048, "flexmask", "7.0"), "gpu": "OTHER GPU", "date": "2025-12-01T00:00"}
    rows = per_call.last_run([other_card, train, old_decode, new_decode])
    assert rows == [train, new_decode]
    text = per_call.table(rows)
    assert "0.300" in text and "0.050" in text and "0.900" not in text and "OTHER GPU" not in text
    assert "fwd: " in text and "`full run`" in text and "decode: " in text and "`decode run`" in text


def test_interleaved_rounds_take_the_providers_in_turn(monkeypatch):
    """interleaved_wall_ms times round r of every step before round r + 1 of any (a drift of the
    host's speed reaches all providers of a row alike), runs each under its own grad mode, keeps a
    step that raises as its error status while the others go on, and gives each step's median
    round in ms a call (a fake clock: one second per call of step "b")."""
    import torch

    order, grad_modes, clock = [], {}, [0.0]
    monkeypatch.setattr(per_call.time, "perf_counter", lambda: clock[0])

    def step(name, seconds):
        def fn():
            order.append(name)
            grad_modes[name] = torch.is_grad_enabled()
            clock[0] += seconds
        return fn

    def broken():
        raise RuntimeError("no kernel for this shape")

    steps = {"a": (step("a", 0.002), True), "bad": (broken, True), "b": (step("b", 1.0), False)}
    out = per_call.interleaved_wall_ms(steps, calls=2, rounds=3, sync=lambda: None)
    assert list(out) == ["a", "bad", "b"]
    assert out["bad"].startswith("error: RuntimeError: no kernel")
    assert abs(out["a"] - 2.0) < 1e-9 and abs(out["b"] - 1000.0) < 1e-9
    # warm-ups a, b; then rounds of two calls each, a before b in every round
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert grad_modes == {"a": True, "b": False}
