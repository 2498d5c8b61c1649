"""benchmarks.mask_mod without a GPU: each family's one mask_mod (FlexAttention's and
from_mask_mod's) is the builder's mask, the shapes fit a column's 16 runs where they should (and
kernel 13 says by how much it does not), and the table follows the rows."""

import csv
import re

import pytest
import torch

from benchmarks import mask_mod as bench
from flexmask import masks

ENV = {"date": "2026-01-01", "gpu": "GPU", "torch": "2", "triton": "3", "command": "python -m benchmarks.mask_mod"}


def dense_of_mod(fn, s: int, heads: int | None) -> torch.Tensor:
    """Boolean [H|1, s, s]: the mask_mod on the whole grid, head by head."""
    q, kv = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    b = torch.tensor(0)
    return torch.stack([fn(b, torch.tensor(h), q, kv).expand(s, s) for h in range(heads or 1)])


def builder_dense(mask, s: int) -> torch.Tensor:
    dense = mask.to_dense(s, s)
    return dense.view(-1, s, s) if dense.dim() == 4 else dense[None]


# small shapes of each family: a NATTEN family at (frames, height, width) of a few hundred tokens,
# the others at a length that is not a tile multiple
SMALL = [
    pytest.param(lambda: bench.natten_case("natten2d_k9", 1, 20, 23), id="natten2d_k9-20x23"),
    pytest.param(lambda: bench.natten_case("natten2d_k13", 1, 14, 17), id="natten2d_k13-14x17"),
    pytest.param(lambda: bench.natten_case("natten3d_t2_k3", 4, 6, 7), id="natten3d_t2_k3-4x6x7"),
    pytest.param(lambda: bench.sta_case(6, 24, 32), id="sta3d_t2_k3-6x24x32"),
    pytest.param(lambda: bench.make_case("global14_window1024", "32K", seq_len=2900), id="global14_window1024-S2900"),
    pytest.param(lambda: bench.make_case("dilated_per_head", "32K", seq_len=1100), id="dilated_per_head-S1100"),
]


@pytest.mark.parametrize("make", SMALL)
def test_mask_mod_is_the_builders_mask(make):
    """The one mask_mod every peer takes equals the builder's dense mask, through from_mask_mod
    and through FlexAttention's create_mask too, and the FLOP count's attending pairs are the
    dense mask's."""
    case = make()
    s = case.seq_len
    want = builder_dense(case.build(), s)
    fn = case.mask_mod("cpu")
    got = dense_of_mod(fn, s, case.heads)
    assert torch.equal(got, want.expand_as(got))
    via = builder_dense(masks.from_mask_mod(fn, heads=case.heads, max_runs=bench.MAX_RUNS), s)
    assert torch.equal(via, got)
    assert case.pairs("cpu") == int(got.sum()) * (bench.HEADS // got.shape[0])
    from torch.nn.attention.flex_attention import create_mask  # FlexAttention's own (vmap) evaluation

    assert torch.equal(create_mask(fn, 1, case.heads or 1, s, s, device="cpu")[0], got)


def test_dinat_mask_mod_is_the_builders_mask():
    """DiNAT's mask_mod (odd sizes: sub-grids of two lengths) equals the builder's dense mask (drawn
    through its sub-image order: more than 16 runs a column in its own) and create_mask's; as a
    from_mask_mod it needs more runs than a column holds, the ValueError the benchmark records."""
    case = bench.dinat_case(1, 21, 23)
    s = case.seq_len
    fn = case.mask_mod("cpu")
    got = dense_of_mod(fn, s, None)
    assert torch.equal(got, builder_dense(case.build(), s))
    assert case.pairs("cpu") == int(got.sum()) * bench.HEADS
    from torch.nn.attention.flex_attention import create_mask

    assert torch.equal(create_mask(fn, 1, 1, s, s, device="cpu")[0], got)
    with pytest.raises(ValueError, match="masked runs"):
        masks.from_mask_mod(fn, max_runs=bench.MAX_RUNS).intervals(s, s)


def test_family_shapes_fit_sixteen_runs_and_kernel_13_does_not():
    """At the benchmark's own shapes: kernel 9 and the 2 x 3 x 3 video window fit a column's 16
    runs; kernel 13 needs 20 (k + k // 2 = 19 attending rows near a border), the 3 x 3 x 3 video
    window 17; the status rows say so."""
    for family in ("natten2d_k9", "natten3d_t2_k3", "natten2d_k13"):
        for size in bench.SIZES:
            frames, h, w = bench.NATTEN_SHAPES[family.split("_")[0]][size]
            assert frames * h * w == bench.make_case(family, size).seq_len
    assert bench.natten_runs_needed(128, 128, 9) <= bench.MAX_RUNS
    assert bench.natten_runs_needed(256, 512, 9) <= bench.MAX_RUNS
    assert bench.natten_runs_needed(64, 64, 3, frames=8, time_kernel=2) <= bench.MAX_RUNS
    assert bench.natten_runs_needed(128, 128, 13) == 20
    assert bench.natten_runs_needed(64, 64, 3, frames=8, time_kernel=3) == 17
    with pytest.raises(ValueError, match="more than max_runs=16"):
        masks.natten(128, 128, 13).intervals(128 * 128, 128 * 128)
    for size in bench.SIZES:  # the STA video: 3 x 4 runs of query tiles, 13 masked runs
        case = bench.make_case("sta3d_t2_k3", size)
        frames, h, w = bench.STA_SHAPES[size]
        assert case.seq_len == frames * h * w and case.runs() == 13
    assert bench.global_positions(32768) == [i * 32768 // 15 for i in range(1, 15)]
    assert bench.head_dilations()[:5] == [64, 128, 192, 256, 64]


def test_global_and_dilated_fit_at_full_size():
    """The builders of the non-NATTEN families compile to at most 16 runs at 32K (on the CPU)."""
    for family in ("global14_window1024", "dilated_per_head"):
        case = bench.make_case(family, "32K")
        assert case.build().intervals(case.seq_len, case.seq_len, "cpu").shape[-1] <= 2 * bench.MAX_RUNS


def test_plan_measures_kernel_13_last():
    order = list(bench.plan(bench.FAMILIES, bench.SIZES))
    fitting = [(f, "32K") for f in bench.FAMILIES if f != "natten2d_k13"]
    assert order[:len(fitting)] == fitting
    assert order[-2:] == [("natten2d_k13", "32K"), ("natten2d_k13", "128K")]


def row(family, provider, s, fwd="", bwd="", ftf="", btf="", compile_ms="", mask_bytes="", status="ok"):
    return {**ENV, "family": family, "seq_len": s, "batch": 1, "heads_q": 16, "heads_kv": 16, "head_dim": 128,
            "provider": provider, "fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": ftf, "bwd_tflops": btf,
            "compile_ms": compile_ms, "mask_bytes": mask_bytes, "status": status}


ROWS = [
    row("natten2d_k9", "flexmask", 16384, "1.0", "3.0", "100", "90", "0.25", 2**20),
    row("natten2d_k9", "flexmask_mod", 16384, "1.0", "3.2", "100", "85", "12.5", 2**20),
    row("natten2d_k9", "flex_flash", 16384, "2.0", "4.0", "50", "60", "3.5", 2**21),
    row("natten2d_k9", "flex", 16384, "3.0", "5.0", "33", "50", "3.5", 2**21),
    row("natten2d_k13", "flexmask", 16384, status="needs 20 runs > 16"),
    row("natten2d_k13", "flexmask_mod", 16384, status="needs 20 runs > 16"),
    row("natten2d_k13", "flex_flash", 16384, "2.0", "4.0", "80", "90", "3.6", 2**21),
]


def test_table_from_rows():
    lines = bench.table(ROWS).splitlines()
    k9 = next(x for x in lines if x.startswith("| NATTEN 128x128 image, 9x9 |"))
    cells = [c.strip() for c in k9.split("|")[1:-1]]
    assert cells[1:] == ["16K", "100 / 90", "1.50", "2.00", "1.05", "0.25, 12.5, 3.5", "1, 2"]
    k13 = next(x for x in lines if x.startswith("| NATTEN 128x128 image, 13x13 |"))
    cells = [c.strip() for c in k13.split("|")[1:-1]]
    assert cells[2:6] == ["needs 20 runs > 16", "-", "-", "-"]
    assert "`python -m benchmarks.mask_mod`" in lines[-1] and "20 masked runs" in lines[-2]
    assert all("| GPU |" not in x for x in lines)  # one card: no card column
    other = [{**r, "gpu": "NVIDIA H100", "command": "python -m benchmarks.mask_mod --sizes 32K"} for r in ROWS]
    lines = bench.table(ROWS + other).splitlines()
    k9 = [x for x in lines if x.startswith("| NATTEN 128x128 image, 9x9 |")]
    assert [c.strip() for c in k9[1].split("|")[1:-1]][2] == "H100"  # a line per card: ratios within a run
    assert len(k9) == 2 and lines[-1].endswith("`python -m benchmarks.mask_mod --sizes 32K`.")
    assert bench.table([]) == "(no rows)"


def test_table_compares_rows_of_one_run():
    """A later run without flex_flash keeps the earlier run's flex_flash ratio, taken against that
    run's own flexmask; its compile times come from the latest run that built from_mask_mod, with
    that run's create_block_mask (flex), not the earlier run's flex_flash figure."""
    later = [{**r, "command": "python -m benchmarks.mask_mod --providers flexmask,flexmask_mod,flex"}
             for r in ROWS if r["provider"] != "flex_flash"]
    later[0] = {**later[0], "fwd_ms": "2.0", "bwd_ms": "6.0", "fwd_tflops": "50", "compile_ms": "0.5"}  # flexmask
    later[2] = {**later[2], "compile_ms": "7.5"}  # flex's create_block_mask
    lines = bench.table(ROWS + later).splitlines()
    k9 = next(x for x in lines if x.startswith("| NATTEN 128x128 image, 9x9 |"))
    cells = [c.strip() for c in k9.split("|")[1:-1]]
    # flex_flash 6 ms over the first run's flexmask 4; flex 8 over the later run's 8; from_mask_mod 4.2 over 8
    assert cells[1:] == ["16K", "50 / 90", "1.50", "1.00", "0.53", "0.5, 12.5, 7.5", "1, 2"]
    assert sum(x.startswith("- GPU,") for x in lines) == 2  # both runs named


def test_table_mode_writes_the_marked_block(tmp_path):
    path = tmp_path / "mask_mod.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=bench.COLUMNS)
        writer.writeheader()
        writer.writerows(ROWS)
    full = tmp_path / "results.md"
    full.write_text(f"# Results\n\n{bench.START}\nstale rows\n{bench.END}\nafter\n")
    assert bench.main(["--table", str(path), "--full", str(full)]) == 0
    text = full.read_text()
    assert "stale rows" not in text and text.endswith(f"{bench.END}\nafter\n")
    assert "| NATTEN 128x128 image, 9x9 | 16K | 100 / 90 |" in text
    assert text.index(bench.START) < text.index("generated by `python -m benchmarks.mask_mod --table`")


def test_measuring_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench.main(["--sizes", "32K"])
    with pytest.raises(SystemExit, match="--family must be among"):
        bench.main(["--families", "natten2d_k7"])


def test_results_doc_holds_the_markers_and_the_readme_links_there():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "results.md").read_text(encoding="utf-8")
    assert 0 <= doc.index(bench.START) < doc.index(bench.END)
    assert "## Masks beyond two intervals" in doc
    assert "docs/results.md#masks-beyond-two-intervals" in (root / "README.md").read_text(encoding="utf-8")


def test_compile_time_tool_builders_are_its_mask_mods(capsys):
    """tools.mask_mod_compile_time --builders times each mask_mod's builder twin: the same dense
    mask, and one timing line for each."""
    from tools import mask_mod_compile_time as tool

    s = 1156  # a 34 x 34 image
    mods = tool.mask_mods(s, "cpu")
    for name, make in tool.builders(s).items():
        fn, heads = mods[name]
        got = dense_of_mod(fn, s, heads)
        assert torch.equal(builder_dense(make(), s).expand_as(got), got), name
    assert tool.main(["--seq-len", "256", "--masks", "causal,natten_k9", "--builders", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines if " builder: " in line] == ["causal", "natten_k9"]


def test_compile_time_tool_has_sta_at_its_video_lengths(monkeypatch):
    """At the length of the benchmark's STA video the tool times STA too, its builder the same mask;
    at other lengths it has none."""
    from tools import mask_mod_compile_time as tool

    monkeypatch.setattr(bench, "STA_SHAPES", {"32K": (4, 40, 40)})  # 2 x 5 x 5 tiles of 2 x 8 x 8
    s = 4 * 40 * 40
    fn, heads = tool.mask_mods(s, "cpu")["sta3d_t2_k3"]
    got = dense_of_mod(fn, s, heads)
    assert torch.equal(builder_dense(tool.builders(s)["sta3d_t2_k3"](), s).expand_as(got), got)
    assert not bool(got.all()) and bool(got.any())
    assert "sta3d_t2_k3" not in tool.mask_mods(s + 1, "cpu") and "sta3d_t2_k3" not in tool.builders(s + 1)


def test_compile_time_tool_skips_natten_builder_off_an_image(capsys):
    """At a length that is no image's height x width (1160: a 34 x 34 image and 4 tokens past it)
    the tool says natten has no builder there and times the rest, where masks.natten would raise."""
    from tools import mask_mod_compile_time as tool

    assert tool.main(["--seq-len", "1160", "--masks", "natten_k9,causal", "--builders", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("natten_k9") and "no builder" in line for line in lines), lines
    assert [line.split()[0] for line in lines if " builder: " in line] == ["causal"]


def test_compile_time_tool_times_the_steps_of_compile_mask(capsys):
    """tools.mask_mod_compile_time --phases times compile_mask's four steps apart for the global
    tokens, written as a mask_mod and with the builders."""
    from tools import mask_mod_compile_time as tool

    assert tool.main(["--seq-len", "2048", "--masks", "global14_window1024", "--phases", "--builders",
                      "--repeats", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "steps of compile_mask" in line]
    assert [line.split("steps of compile_mask, ")[1].split(":")[0] for line in lines] == ["from_mask_mod", "builder"]
    for line in lines:
        steps = [part.rsplit(" ", 1) for part in line.split(": ", 1)[1].removesuffix(" ms").split(", ")]
        assert [name for name, _ in steps] == ["natural tables", "order", "reordered tables", "fewer_tiles"], line
        assert all(float(ms) > 0 for _, ms in steps), line


def test_compile_time_tool_times_the_order_both_ways(capsys, monkeypatch):
    """tools.mask_mod_compile_time --order-ab times compile_mask with the global tokens found by the
    kernels (here under the interpreter: the rule that picks them patched on) and by torch ops, for
    the mask_mod and the builder, and leaves the rule as it found it."""
    from flexmask import api
    from tools import mask_mod_compile_time as tool

    def on(intervals):
        return True
    monkeypatch.setattr(api, "_order_on_device", on)
    assert tool.main(["--seq-len", "2048", "--masks", "global14_window1024", "--order-ab", "--builders",
                      "--compile-mask", "--repeats", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " compile_mask, " in line]
    assert [line.split("compile_mask, ")[1].split(":")[0] for line in lines] == ["from_mask_mod", "builder"]
    for line in lines:
        ways = [part.rsplit(" ", 1) for part in line.split(": ", 1)[1].removesuffix(" ms (median)").split(", ")]
        assert [way for way, _ in ways] == ["kernels", "torch ops"] and all(float(ms) > 0 for _, ms in ways), line
    assert api._order_on_device is on


def test_compile_time_tool_counts_the_gpu_paths_operators(capsys):
    """tools.mask_mod_compile_time --count-ops counts each step's operators and Triton launches along
    the GPU's path: causal's builder is its two compile kernels and a few views, the global tokens
    add the order and the reordered tables."""
    from tools import mask_mod_compile_time as tool

    assert tool.main(["--seq-len", "2048", "--masks", "causal,global14_window1024", "--count-ops", "--builders",
                      "--repeats", "1"]) == 0
    lines = {(line.split()[0], line.split("compile_mask, ")[1].split(":")[0]): line.split(": ", 1)[1]
             for line in capsys.readouterr().out.splitlines() if "operators of compile_mask" in line}
    assert set(lines) == {(m, s) for m in ("causal", "global14_window1024") for s in ("from_mask_mod", "builder")}
    steps = {key: {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(r"([a-z_]+(?: \(\w+\))?) (\d+) ops \+ (\d+) launches", text)}
             for key, text in lines.items()}
    ops, launches = steps[("causal", "builder")]["tables (natural)"]
    assert launches == 2 and ops < 20
    assert set(steps[("global14_window1024", "builder")]) == {"tables (natural)", "order", "tables (reordered)",
                                                              "fewer_tiles"}
    assert steps[("global14_window1024", "from_mask_mod")]["order"][0] > 0
    # a mask_mod's runs are placed by change_runs' kernels, as on a GPU: launches beyond the tables' two
    assert steps[("causal", "from_mask_mod")]["tables (natural)"][1] > 2


def test_timed_build_leaves_the_warming_call_out(monkeypatch):
    """The first build compiles kernels (seconds on a cold cache, now that builders launch Triton
    kernels too): it only warms, and the figure is the median of the calls after it."""
    import itertools

    elapsed = itertools.chain([6000.0, 2.0], itertools.cycle([3.0, 1.0, 2.0]))

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def elapsed_time(self, end):
            return next(elapsed)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    built = []
    result, ms = bench.timed_build(lambda: len(built), lambda obj: built.append(obj) or obj)
    assert ms == 2.0 and result == 0
    assert len(built) == 2 + 10  # the warming call, the probe, then ten timed calls (the probe's 2 ms: 10 fit)
