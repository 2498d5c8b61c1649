"""Launch variants of the split-KV decode kernel, timed in CUDA-graph replays (L2 flushed before
each): K/V through TMA descriptors or pointers, kv columns per step, pipeline stages, warps,
programs per SM, the merge ("two_launch", "fused", or "none": the split kernel alone, to see
what the merge costs). Hq = 32, Hkv = 8, D = 128, bf16, a full kv_cache mask. One line per
(point, variant); writes decode_variants.csv (GPU, versions, command in every row).

    PYTHONPATH=$PWD python3 -m tools.decode_variants --out benchmarks/results \\
        --points 1:1:32768 --variants base tma=1,st=4 merge=none

A point is sq:batch:kv_len; a variant is comma-separated key=value pairs over tma, bn (block_n
and masked_block_n), st (both stage counts), mbn/mst (masked steps only), w (warps), per_sm,
splits, pdl (0/1), merge, hop (1: the Hopper kernel's plan, decode_hopper.py; 0: the Triton kernel's), nreg (the
Hopper kernel's registers per thread); "base" is the plan
flexmask.attention makes, "copy" a copy of as many bytes, "launch" a replay of one kernel on 4
bytes (what any step pays before its work).

    python -m tools.decode_variants --table benchmarks/results/decode_hopper.csv [--readme docs/decoding.md]

prints (or writes between the decode-variants markers of docs/decoding.md) where a step's time goes: the
Triton and the Hopper kernel's plans, each with and without the merge, and a copy of as many
bytes, per point.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import sys

import torch
import triton

from benchmarks.decode import _graph_timed, copy_bandwidth_gbps
from benchmarks.cuda_guard import require_cuda
from benchmarks.report import write_rows

KEYS = {"pdl", "tma", "bn", "st", "mbn", "mst", "w", "per_sm", "splits", "merge", "hop", "nreg"}


def parse_variant(text: str) -> dict:
    if text in ("base", "copy", "launch"):
        return {}
    out = {}
    for pair in text.split(","):
        key, _, value = pair.partition("=")
        if key not in KEYS:
            raise ValueError(f"variant key must be one of {sorted(KEYS)}, got {key!r} in {text!r}")
        out[key] = value if key == "merge" else int(value)
    return out


def plan_for(variant: dict, b, hq, hkv, sq, sk, d, q, cm, configs):
    original = decode_configs.DECODE_PROGRAMS_PER_SM
    try:
        if "per_sm" in variant:
            decode_configs.DECODE_PROGRAMS_PER_SM = variant["per_sm"]
        kernel = None if "hop" not in variant else ("hopper" if variant["hop"] else "triton")
        plan = decode_configs.decode_plan(b, hq, hkv, sq, sk, d, q.dtype, q.device, (cm.block_m, cm.block_n), cm.heads,
                                   force=True, kernel=kernel)
    finally:
        decode_configs.DECODE_PROGRAMS_PER_SM = original
    changes = {}
    if "pdl" in variant:
        changes["pdl"] = bool(variant["pdl"])
    if "tma" in variant:
        changes["use_tma"] = bool(variant["tma"])
    if "bn" in variant:
        changes.update(block_n=variant["bn"], masked_block_n=variant["bn"])
    if "st" in variant:
        changes.update(num_stages=variant["st"], masked_stages=variant["st"])
    if "mbn" in variant:
        changes["masked_block_n"] = variant["mbn"]
    if "mst" in variant:
        changes["masked_stages"] = variant["mst"]
    if "splits" in variant:
        changes["num_splits"] = variant["splits"]
    if "w" in variant:
        changes["num_warps"] = variant["w"]
    if "nreg" in variant:
        changes["max_registers"] = variant["nreg"]
    if variant.get("merge") in ("two_launch", "fused"):
        changes["merge"] = variant["merge"]
    if variant.get("merge") == "none":  # the partials only: the two-launch plan, its merge launch skipped
        changes["merge"] = "two_launch"
    return dataclasses.replace(plan, **changes)


class _Recorder:
    """Wraps decode._split_kv_kernel to keep the compiled kernel of the last launch (its shared
    memory and registers say how many programs an SM holds)."""

    def __init__(self, kernel):
        self.kernel, self.compiled = kernel, None

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.compiled = launch(*args, **kwargs)
            return self.compiled
        return run


def programs_per_sm(compiled, num_warps: int) -> int:
    props = torch.cuda.get_device_properties(0)
    smem = compiled.metadata.shared
    by_smem = (props.shared_memory_per_multiprocessor // smem) if smem else 32
    by_regs = 65536 // max(1, compiled.n_regs * 32 * num_warps)
    return min(by_smem, by_regs, 64 // num_warps)


class _NoMerge:
    """Stands in for decode._merge_kernel: the launch is skipped (timing the split kernel alone)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def table(rows: list[dict], flush: str = "read") -> str:
    """Markdown, one line per point: microseconds of a CUDA-graph replay of a decode step with the
    Triton split kernel's plan (two launches) and with the Hopper kernel's (decode_hopper.py, its
    default steps and stages) with each merge, each kernel also alone (variant "merge=none": the
    split kernel without its merge launch), a copy of as many bytes ("copy") and a replay of one
    kernel on 4 bytes ("launch"), with the share of the copy bandwidth each reaches. A row is
    placed by the plan it ran (its `plan` column); variants that change other launch options
    (PDL, TMA, stages, steps, splits) are left out."""
    import re

    from flexmask.kernels.decode.configs import DECODE_HOPPER_BLOCK_N, DECODE_HOPPER_STAGES

    def column(r):
        if r["variant"] in ("copy", "launch"):
            return {"copy": "copy of the bytes", "launch": "launch of one kernel"}[r["variant"]]
        plan, variant = r["plan"], r["variant"]
        if "pdl=True" in plan or "use_tma=True" in plan or any(k in variant for k in ("splits", "per_sm", "st=", "bn=", "nreg")):
            return None
        alone = variant.endswith("merge=none")
        if "kernel='hopper'" in plan:
            stages = int(re.search(r"num_stages=(\d+)", plan).group(1))
            step = int(re.search(r"block_n=(\d+)", plan).group(1))
            if stages != DECODE_HOPPER_STAGES.get(int(r.get("head_dim", 128)), stages) or step != DECODE_HOPPER_BLOCK_N:
                return None
            if alone:
                return "Hopper kernel alone"
            return "Hopper kernel, fused merge" if "merge='fused'" in plan else "Hopper kernel, two launches"
        if "merge='two_launch'" in plan:
            return "Triton kernel alone" if alone else "Triton kernel"
        return None

    order = ["Triton kernel", "Triton kernel alone", "Hopper kernel, two launches", "Hopper kernel, fused merge",
             "Hopper kernel alone", "copy of the bytes", "launch of one kernel"]
    by = {}
    for r in rows:
        if r.get("flush", "zero") == flush and r["status"] == "ok" and column(r):
            by[(int(r["q_len"]), int(r["batch"]), int(r["kv_len"]), column(r))] = r
    present = [c for c in order if any(k[3] == c for k in by)]
    points = list(dict.fromkeys(k[:3] for k in by))
    floor = "launch of one kernel"  # no bytes: its share of the copy bandwidth means nothing
    lines = ["| Sq | B | Sk | " + " | ".join(f"{c} us" + ("" if c == floor else " (% copy)") for c in present) + " |",
             "|---|---|---|" + "---|" * len(present)]
    for sq, b, sk in points:
        cells = []
        for c in present:
            r = by.get((sq, b, sk, c))
            if r is None:
                cells.append("-")
            else:
                cells.append(f"{float(r['graph_ms']) * 1e3:.1f}" + ("" if c == floor else f" ({float(r['pct_of_copy']):.0f}%)"))
        lines.append(f"| {sq} | {b} | {sk // 1024}K | " + " | ".join(cells) + " |")
    first = next(iter(by.values()))
    lines += ["", f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}; L2 emptied by a {flush} "
                  f"before each replay; `{first['command']}`"]
    return "\n".join(lines)


README_START, README_END = "<!-- decode-variants:start -->", "<!-- decode-variants:end -->"


def _table_main(args) -> None:
    with open(args.table) as f:
        text = table(list(csv.DictReader(f)))
    if not args.readme:
        print(text)
        return
    with open(args.readme) as f:
        readme = f.read()
    if README_START not in readme or README_END not in readme:
        raise SystemExit(f"{args.readme} has no {README_START} ... {README_END} block")
    head, rest = readme.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    with open(args.readme, "w") as f:
        f.write(f"{head}{README_START}\n{text}\n{README_END}{tail}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="decode_variants")
    ap.add_argument("--points", nargs="+", default=["1:1:8192", "1:1:32768", "1:1:131072", "1:8:32768", "16:8:32768"])
    ap.add_argument("--variants", nargs="+", default=["base"])
    ap.add_argument("--flush", nargs="+", default=["read"], choices=["read", "zero"],
                    help="how the L2 is emptied before each replay (benchmarks.decode._flush_l2)")
    ap.add_argument("--table", metavar="CSV", help="print the README table of a results CSV and exit")
    ap.add_argument("--readme", metavar="README", help="with --table: write it between the decode-variants markers")
    args = ap.parse_args(argv)
    if args.table:
        return _table_main(args)
    require_cuda("tools.decode_variants", "times decode steps on a GPU")
    import flexmask
    from flexmask import masks
    from flexmask.kernels.decode import configs as decode_configs
    from flexmask.kernels.decode import split_kv as decode

    stamp = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                 command="python -m tools.decode_variants " + " ".join(sys.argv[1:] if argv is None else argv),
                 date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    copy_gbps = copy_bandwidth_gbps()
    hq, hkv, d = 32, 8, 128
    rows = []
    merge_kernel, split_kernel = decode._merge_kernel, decode._split_kv_kernel
    for point in args.points:
        sq, b, sk = (int(x) for x in point.split(":"))
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cm = flexmask.compile_mask(masks.kv_cache(torch.full((b,), sk, device="cuda", dtype=torch.int32)), sq, sk,
                                   device="cuda")
        kv_bytes = 2 * k.numel() * k.element_size()
        reference = None
        for text, flush in [(t, f) for t in args.variants for f in args.flush]:
            variant = parse_variant(text)
            plan = plan_for(variant, b, hq, hkv, sq, sk, d, q, cm, configs)
            recorder = decode._split_kv_kernel = _Recorder(split_kernel)
            fn = lambda: decode.attention_decode(q, k, v, cm, d ** -0.5, plan=plan)[0]  # noqa: E731
            if text == "copy":  # a device copy of half the K/V bytes: as many bytes moved as the step reads
                src = torch.empty(kv_bytes // 2, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                fn = lambda: dst.copy_(src)  # noqa: E731
                variant = {"merge": "none"}  # nothing to compare
            if text == "launch":  # one kernel on 4 bytes: what a replay costs with (almost) no work
                tiny = torch.zeros(1, device="cuda")
                fn = lambda: tiny.add_(1.0)  # noqa: E731
                variant = {"merge": "none"}
            try:
                if variant.get("merge") == "none":
                    decode._merge_kernel = _NoMerge()
                    err = float("nan")
                else:
                    out = fn().float()
                    reference = out if reference is None else reference
                    err = (out - reference).abs().max().item()
                ms = _graph_timed(fn, flush=flush)[0]
                status = "ok"
            except Exception as exc:  # a variant that does not compile (shared memory) is reported
                ms, err, status = float("nan"), float("nan"), f"{type(exc).__name__}: {str(exc)[:80]}"
            finally:
                decode._merge_kernel = merge_kernel
                decode._split_kv_kernel = split_kernel
            smem = regs = resident = None
            if recorder.compiled is not None:
                smem, regs = recorder.compiled.metadata.shared, recorder.compiled.n_regs
                resident = programs_per_sm(recorder.compiled, plan.num_warps)
            programs = plan.num_splits * -(-sq // plan.block_q) * b * hkv * -(-(hq // hkv) // plan.block_h)
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            rows.append(dict(q_len=sq, batch=b, kv_len=sk, variant=text, flush=flush, plan=str(plan), status=status,
                             graph_ms=round(ms, 5), gbps=round(gbps, 1), pct_of_copy=round(100 * gbps / copy_gbps, 1),
                             max_diff_vs_first=err, shared_bytes=smem, registers=regs, programs=programs,
                             programs_per_sm=resident, **stamp))
            print(f"Sq={sq:2d} B={b} Sk={sk:7d} {text:32s} {flush} splits={plan.num_splits:3d} {ms * 1e3:8.1f} us "
                  f"{gbps:6.0f} GB/s ({100 * gbps / copy_gbps:3.0f}% of copy) diff {err:.2e} {status} "
                  f"smem {smem} regs {regs} programs {programs} per SM {resident}", flush=True)
        del q, k, v, cm
        torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s")
    print(f"wrote {write_rows(args.out, args.name + '.csv', rows)}")


if __name__ == "__main__":
    main()
