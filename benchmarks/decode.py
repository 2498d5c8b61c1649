"""Decoding benchmark: achieved memory bandwidth of a decode step against a KV cache.

    python -m benchmarks.decode --out benchmarks/results            # the sweep (GPU)
    python -m benchmarks.decode --providers flexmask,flexmask_fused,flex --name decode_fused
    python -m benchmarks.decode --table benchmarks/results/decode.csv   # print the table
    python -m benchmarks.decode --table benchmarks/results/decode.csv --readme docs/decoding.md

Per point (batch B, cache length Sk, Sq queries; Hq=32, Hkv=8, D=128, bf16; every cache full,
so every provider reads all of K/V): flexmask.attention with a precompiled `masks.kv_cache`
mask (it takes the split-KV path, with the merge decode_configs.decode_merge picks), `flexmask_fused`
(the same split-KV plan with the fused merge: the last split program of each row group merges,
no second launch), flexmask's q-block kernel on the same mask (the path a
decode step took before), FlexAttention (`torch.compile(flex_attention)` with a BlockMask,
its decode kernel for small Sq), SDPA (default backend choice, enable_gqa) and `copy`: a
device-to-device copy of half the K/V bytes (so it moves as many bytes as a decode step reads),
timed the same way: what one streaming kernel reaches at this size, launch and ramp included,
the measured ceiling the decode rows sit under (not in the default). Bandwidth =
bytes of K and V read / median time (triton.testing.do_bench: the L2 cache is flushed before
each call). The GPU's copy bandwidth is measured in the same process (a device-to-device copy
of COPY_BYTES; bytes read + written / time) and each bandwidth is also given as a % of it.
Rows: CSV with GPU, versions and the command in every row, a PNG next to it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .report import environment, write_marked_block

COLUMNS = ("date", "gpu", "torch", "triton", "command", "provider", "batch", "q_len", "kv_len", "heads",
           "kv_heads", "head_dim", "dtype", "status", "kv_bytes", "copy_gbps",
           # CUDA graph replay: device time (the decode setting)
           "graph_ms", "graph_p20_ms", "graph_p80_ms", "graph_bandwidth_gbps", "graph_pct_of_copy", "graph_vs_flex",
           "graph_status",
           # eager calls: host overhead included where it exceeds the L2 flush before each call
           "ms", "p20_ms", "p80_ms", "bandwidth_gbps", "pct_of_copy", "vs_flex",
           "mask_build_ms", "path", "num_splits", "rel_err_vs_flex", "l2_flush")
PROVIDERS = ("flexmask", "flexmask_fused", "flexmask_qblock", "flex", "sdpa", "copy")
COPY_BYTES = 4 << 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results", help="folder for the CSV and the PNG")
    p.add_argument("--name", default="decode", help="their file name: NAME.csv and NAME.png")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--seqlens", default="8192,32768,131072,524288")
    p.add_argument("--q-lens", default="1", help="query lengths of the full sweep")
    p.add_argument("--extra-q-len", type=int, default=16, help="one more query length (0: none) ...")
    p.add_argument("--extra-q-batches", default="8", help="... at these batch sizes")
    p.add_argument("--providers", default=",".join(p for p in PROVIDERS if p != "copy"))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--memory-fraction", type=float, default=0.6,
                   help="skip points whose K/V exceed this fraction of the GPU memory")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; later points are SKIP rows")
    p.add_argument("--flush", choices=FLUSHES, default="read",
                   help="how the L2 is emptied before each graph replay (see _flush_l2); recorded in every row")
    p.add_argument("--append", action="store_true")
    p.add_argument("--table", metavar="CSV", help="print the README table of a results CSV and exit")
    p.add_argument("--readme", metavar="README", help="with --table: write it between the decode markers there")
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy: (bytes read + bytes written) / time, in GB/s."""
    import triton

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


def _flex_block_mask(lengths: torch.Tensor, batch: int, sq: int, sk: int):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):  # kv_cache(lengths, causal=True)
        length = lengths[b]
        return (kv_idx < length) & (kv_idx <= length - sq + q_idx)

    return create_block_mask(mask_mod, batch, None, sq, sk, device="cuda")


def _sdpa_call(q, k, v, sq: int, sk: int):
    import torch.nn.functional as F

    if sq == 1:  # a full cache: no mask at all
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(sq, sk)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)


def _timed(fn):
    import triton

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])


FLUSH_BYTES = 256 << 20  # as triton.testing.do_bench: larger than the L2 cache
FLUSHES = ("read", "zero")


def _flush_l2(flush: torch.Tensor, how: str) -> None:
    """Evict the L2 cache before a timed replay. "zero" writes the buffer, as
    triton.testing.do_bench does: the L2 is then full of dirty lines, and the next kernel pays
    for writing them back before its own reads stream (a decode step at B = 1 or 8 and 32K keys
    measured 8-9 us longer than with "read", docs/performance.md). "read"
    reads the buffer: the L2 is left holding clean lines, as after the weight reads that precede
    attention in a decode step."""
    if how == "zero":
        flush.zero_()
    else:
        flush.view(torch.int32).amax()


def _graph_timed(fn, reps: int = 100, flush: str = "read"):
    """(median, p20, p80) ms of one CUDA-graph replay of fn, the L2 cache flushed before each
    replay (_flush_l2; the flush also covers the replay's own launch, so this is device time)."""
    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {FLUSHES}, got {flush!r}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    buffer = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i in range(reps + 10):
        _flush_l2(buffer, flush)
        if i < 10:  # warm-up replays
            graph.replay()
            continue
        start, end = events[i - 10]
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    del graph
    return times[len(times) // 2], times[len(times) // 5], times[(4 * len(times)) // 5]


def run_point(batch: int, sq: int, sk: int, args, providers, flex, env: dict, copy_gbps: float) -> list[dict]:
    import flexmask
    from flexmask import masks
    from flexmask.kernels.decode import configs as decode_configs
    from flexmask.kernels.decode.split_kv import attention_decode
    from flexmask.kernels.dispatch import attention_forward

    hq, hkv, d, dtype = args.heads, args.kv_heads, args.head_dim, torch.bfloat16
    kv_bytes = 2 * batch * hkv * sk * d * dtype.itemsize
    base = dict(env, batch=batch, q_len=sq, kv_len=sk, heads=hq, kv_heads=hkv, head_dim=d, dtype="bfloat16",
                kv_bytes=kv_bytes, copy_gbps=copy_gbps, l2_flush=args.flush)
    rows = {p: dict(base, provider=p) for p in providers}
    if kv_bytes > args.memory_fraction * torch.cuda.get_device_properties(0).total_memory:
        for row in rows.values():
            row["status"] = f"SKIP: K/V take {kv_bytes / 1e9:.0f} GB"
        return list(rows.values())
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + sk)
    q = torch.randn(batch, hq, sq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, hkv, sk, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, hkv, sk, d, device="cuda", dtype=dtype, generator=gen)
    lengths = torch.full((batch,), sk, device="cuda", dtype=torch.int32)
    outputs = {}
    for name, row in rows.items():
        try:
            t0 = time.perf_counter()
            if name in ("flexmask", "flexmask_fused", "flexmask_qblock"):
                cm = flexmask.compile_mask(masks.kv_cache(lengths), sq, sk, device="cuda")
                torch.cuda.synchronize()
                row["mask_build_ms"] = (time.perf_counter() - t0) * 1e3
                if name == "flexmask":
                    fn = lambda: flexmask.attention(q, k, v, cm)  # noqa: E731
                    plan = decode_configs.decode_plan(batch, hq, hkv, sq, sk, d, dtype, q.device, (cm.block_m, cm.block_n),
                                               cm.heads)
                    row["path"] = f"split-kv {plan.merge}" if plan is not None else "q-block"
                    row["num_splits"] = plan.num_splits if plan is not None else None
                elif name == "flexmask_fused":  # the split-KV plan of this point, merged in the same launch
                    plan = decode_configs.decode_plan(batch, hq, hkv, sq, sk, d, dtype, q.device, (cm.block_m, cm.block_n),
                                               cm.heads, force=True)
                    fn = lambda: attention_decode(q, k, v, cm, d ** -0.5, merge="fused")[0]  # noqa: E731
                    row["path"] = "split-kv fused" if plan.num_splits > 1 else "split-kv direct"
                    row["num_splits"] = plan.num_splits
                else:
                    fn = lambda: attention_forward(q, k, v, cm, d ** -0.5)[0]  # noqa: E731
                    row["path"] = "q-block"
            elif name == "flex":
                bm = _flex_block_mask(lengths, batch, sq, sk)
                torch.cuda.synchronize()
                row["mask_build_ms"] = (time.perf_counter() - t0) * 1e3
                fn = lambda: flex(q, k, v, block_mask=bm, enable_gqa=True)  # noqa: E731
            elif name == "copy":
                src = torch.empty(kv_bytes // 2, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                fn = lambda: dst.copy_(src)  # noqa: E731
                row["path"] = "copy"
            else:
                fn = _sdpa_call(q, k, v, sq, sk)
            if name != "copy":
                outputs[name] = fn().float()
            ms, p20, p80 = _timed(fn)
            row.update(status="ok", ms=ms, p20_ms=p20, p80_ms=p80, bandwidth_gbps=kv_bytes / (ms * 1e-3) / 1e9)
            row["pct_of_copy"] = 100 * row["bandwidth_gbps"] / copy_gbps
            try:
                ms, p20, p80 = _graph_timed(fn, flush=args.flush)
                row.update(graph_status="ok", graph_ms=ms, graph_p20_ms=p20, graph_p80_ms=p80,
                           graph_bandwidth_gbps=kv_bytes / (ms * 1e-3) / 1e9)
                row["graph_pct_of_copy"] = 100 * row["graph_bandwidth_gbps"] / copy_gbps
            except Exception as err:  # noqa: BLE001 (a provider that cannot be captured)
                row["graph_status"] = f"ERROR: {type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:120]}"
        except Exception as err:  # noqa: BLE001 (OOM, or a provider that cannot run this point)
            first = (str(err).strip().splitlines() or [""])[0][:160]
            row["status"] = "OOM" if isinstance(err, torch.OutOfMemoryError) else f"ERROR: {type(err).__name__}: {first}"
        torch.cuda.empty_cache()
    flex_row = rows.get("flex", {})
    for name, row in rows.items():
        if name == "copy":
            continue
        if row.get("ms") and flex_row.get("ms"):
            row["vs_flex"] = flex_row["ms"] / row["ms"]
        if row.get("graph_ms") and flex_row.get("graph_ms"):
            row["graph_vs_flex"] = flex_row["graph_ms"] / row["graph_ms"]
        if name in outputs and "flex" in outputs and name != "flex":
            want = outputs["flex"]
            row["rel_err_vs_flex"] = float((outputs[name] - want).norm() / want.norm())
    return list(rows.values())


def write_csv(path: str, rows: list[dict], append: bool) -> None:
    import csv

    exists = append and os.path.exists(path) and os.path.getsize(path) > 0
    with open(path, "a" if exists else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if not exists:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def read_csv(path: str) -> list[dict]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _size(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def table(rows: list[dict]) -> str:
    """Markdown: one line per (Sq, B, Sk); CUDA-graph bandwidth (GB/s and % of copy) per
    provider, flexmask's speedup over FlexAttention in graphs and in eager calls."""
    names = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    points = list(dict.fromkeys((int(r["q_len"]), int(r["batch"]), int(r["kv_len"])) for r in rows))
    by = {(int(r["q_len"]), int(r["batch"]), int(r["kv_len"]), r["provider"]): r for r in rows}
    fused = "flexmask_fused" in names  # then also its speedup over FlexAttention in graphs
    head = ("| Sq | B | Sk | " + " | ".join(f"{n} GB/s (% copy)" for n in names)
            + " | flexmask vs flex (graph) | flexmask vs flex (eager) |" + (" fused vs flex (graph) |" if fused else ""))
    lines = [head, "|" + "---|" * (len(names) + 5 + fused)]
    for sq, b, sk in points:
        cells = []
        for n in names:
            r = by.get((sq, b, sk, n), {})
            if r.get("graph_status") == "ok":
                cells.append(f"{float(r['graph_bandwidth_gbps']):.0f} ({float(r['graph_pct_of_copy']):.0f}%)")
            else:
                cells.append((r.get("graph_status") or r.get("status") or "–").split(":")[0])
        mine = by.get((sq, b, sk, "flexmask"), {})
        for col in ("graph_vs_flex", "vs_flex"):
            cells.append(f"{float(mine[col]):.2f}x" if mine.get(col) else "–")
        if fused:
            mine = by.get((sq, b, sk, "flexmask_fused"), {})
            cells.append(f"{float(mine['graph_vs_flex']):.2f}x" if mine.get("graph_vs_flex") else "–")
        lines.append(f"| {sq} | {b} | {_size(sk)} | " + " | ".join(cells) + " |")
    first = rows[0]
    copy = sorted({f"{float(r['copy_gbps']):.0f}" for r in rows if r.get("copy_gbps")})
    lines.append("")
    flush = first.get("l2_flush") or "zero"  # CSVs written before the column flushed by zeroing
    lines.append(f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}; copy bandwidth "
                 f"{', '.join(copy)} GB/s; L2 emptied before each replay by a {flush} of 256 MB; "
                 f"`{first['command']}`")
    return "\n".join(lines)


README_START, README_END = "<!-- decode:start -->", "<!-- decode:end -->"


def write_readme(path: str, text: str) -> None:
    """Replace the text between the decode markers of `path` with `text`."""
    write_marked_block(path, text, README_START, README_END)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("graph_status") == "ok"]
    groups = sorted({(int(r["q_len"]), int(r["batch"])) for r in ok})
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, (sq, b) in zip(axes[0], groups):
        for name in PROVIDERS:
            pts = sorted((int(r["kv_len"]), float(r["graph_bandwidth_gbps"])) for r in ok
                         if r["provider"] == name and int(r["q_len"]) == sq and int(r["batch"]) == b)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        copy = max(float(r["copy_gbps"]) for r in ok)
        ax.axhline(copy, color="gray", ls="--", lw=1, label="copy (4 GiB)")
        ax.axhline(0.8 * copy, color="gray", ls=":", lw=1, label="80% of copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"Sq={sq}, B={b}")
        ax.set_xlabel("kv_len")
        ax.set_ylabel("GB/s of K/V read (CUDA graph)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{ok[0]['gpu']}: decode, Hq=32 Hkv=8 D=128 bf16", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table:
        text = table(read_csv(args.table))
        if args.readme:
            write_readme(args.readme, text)
        else:
            print(text)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks.decode: no CUDA device; this benchmark runs on a GPU only")
        return 2
    os.makedirs(args.out, exist_ok=True)
    env = environment("gpu", argv)
    env["command"] = "python -m benchmarks.decode " + " ".join(sys.argv[1:] if argv is None else argv)
    providers = [p for p in args.providers.split(",") if p]
    flex = None
    if "flex" in providers:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        import torch._dynamo.config as dynamo_config

        dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 256)
        if hasattr(dynamo_config, "recompile_limit"):
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
    copy = copy_bandwidth_gbps()
    print(f"copy bandwidth: {copy:.0f} GB/s", flush=True)
    points = [(sq, b, sk) for sq in _ints(args.q_lens) for b in _ints(args.batches) for sk in _ints(args.seqlens)]
    if args.extra_q_len:
        points += [(args.extra_q_len, b, sk) for b in _ints(args.extra_q_batches) for sk in _ints(args.seqlens)]
    csv_path = os.path.join(args.out, f"{args.name}.csv")
    start, append = time.monotonic(), args.append
    all_rows = []
    for sq, b, sk in points:
        if args.time_budget is not None and time.monotonic() - start > args.time_budget:
            rows = [dict(env, provider=p, batch=b, q_len=sq, kv_len=sk, heads=args.heads, kv_heads=args.kv_heads,
                         head_dim=args.head_dim, dtype="bfloat16", status="SKIP: time budget") for p in providers]
        else:
            rows = run_point(b, sq, sk, args, providers, flex, env, copy)
        write_csv(csv_path, rows, append)
        append = True
        all_rows += rows
        for r in rows:
            bw = f"eager {r['bandwidth_gbps']:.0f} GB/s ({r['pct_of_copy']:.0f}%)" if r.get("bandwidth_gbps") else ""
            if r.get("graph_bandwidth_gbps"):
                bw += f", graph {r['graph_bandwidth_gbps']:.0f} GB/s ({r['graph_pct_of_copy']:.0f}%)"
            elif r.get("graph_status"):
                bw += f", graph {r['graph_status']}"
            print(f"Sq={sq} B={b} Sk={sk} {r['provider']}: {r['status']} {bw} "
                  f"{'vs flex %.2fx (graph %.2fx)' % (r['vs_flex'], r.get('graph_vs_flex') or 0) if r.get('vs_flex') else ''} "
                  f"{'splits=%s' % r['num_splits'] if r.get('num_splits') else ''}", flush=True)
    plot(read_csv(csv_path), os.path.join(args.out, f"{args.name}.png"))
    print(table(read_csv(csv_path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
