"""Per-call cost as training and eager decoding see it: the wall clock over a loop of calls with
one synchronize at the end, host and GPU pipelined (DESIGN.md 4, "per call").

    python -m benchmarks.per_call [--out benchmarks/results] [--calls 50] [--readme README.md]
                                  [--cases training,decode]
    python -m benchmarks.per_call --table benchmarks/results/per_call.csv [--readme README.md]

The tables take each case from the last run that measured it on the card of the CSV's last run
(`--cases decode` reruns the decode steps alone), and name each run they take.

Cases (bf16, D = 128):
  fwd_bwd, fwd            causal, B x S = 16K tokens, S = 512 ... 8K, heads 16/16 and 32/8:
                          flexmask (a CompiledMask), flexmask_inline (`mask=masks.causal()` written
                          in the call), sdpa_cudnn (SDPA's cuDNN backend, is_causal), flex
                          (compiled FlexAttention, block mask built once)
  fwd_bwd_document,       the same shapes with packed documents of S/4 tokens: flexmask (compiled),
  fwd_document            flexmask_inline (`masks.document([...])` from a Python list in the call),
                          flex (block mask built once)
  decode                  one query against a cache of Sk = 8K or 32K keys, batch 1 and 8, GQA 32/8,
                          eager, no gradient: flexmask, sdpa (default backend choice), flex
                          (compiled)
A second table, per_call_host.csv, counts the CUDA launches of one call (torch.profiler) and
the host time of one call when the GPU is not the bottleneck (the issue time of a loop at the
smallest shape, no synchronize inside), for fwd, fwd_bwd and a decode step (B = 1, 8K cache, GQA
32/8); each flexmask row is followed by a `<provider>_python` row: the same loop with flexmask's
kernel launches replaced by a no-op (common/launcher.FastLaunch and BoundLaunch), its Python and torch's own
operations alone (their launches counted), so that the table tells launching from the rest.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .report import environment, error_status, write_marked_block

COLUMNS = ("date", "gpu", "torch", "triton", "command", "case", "seq_len", "batch", "heads_q", "heads_kv",
           "head_dim", "provider", "ms")
HOST_COLUMNS = ("date", "gpu", "torch", "triton", "command", "case", "provider", "launches", "host_us")
TOKENS = 16384
SEQ_LENS = (512, 1024, 2048, 4096, 8192)
HEADS = ((16, 16), (32, 8))
DECODE = ((1, 8192), (1, 32768), (8, 8192), (8, 32768))  # (batch, cache length)
START, END = "<!-- per-call:start -->", "<!-- per-call:end -->"  # README: the summary
FULL_START, FULL_END = "<!-- per-call-full:start -->", "<!-- per-call-full:end -->"  # docs/results.md: every case


def _round_ms(fn: Callable, calls: int, sync: Callable) -> float:
    """Wall time of `calls` calls with one synchronize at the end, ms a call."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e3


def wall_ms(fn: Callable, calls: int, rounds: int = 3) -> float:
    """Median over rounds of (wall time of `calls` calls, one synchronize at the end) / calls."""
    fn()
    torch.cuda.synchronize()
    return statistics.median(_round_ms(fn, calls, torch.cuda.synchronize) for _ in range(rounds))


def interleaved_wall_ms(steps: dict, calls: int, rounds: int = 3, sync: Callable = None) -> dict:
    """`wall_ms` of several steps, name -> (step, with gradients), their rounds taken in turn: round
    r times every step once, in order, so that a drift of the host's speed (it moves step to step
    on these machines: docs/performance.md, section 7) reaches every provider of a row alike rather
    than the ones timed in its slow minutes. name -> ms, or the error status of a step that raised
    (its row says so; the others go on). `sync`: torch.cuda.synchronize unless given."""
    sync = torch.cuda.synchronize if sync is None else sync
    out, times = {}, {}
    for name, (fn, grad) in steps.items():  # warm-up, and the steps that cannot run at all
        try:
            with torch.set_grad_enabled(grad):
                fn()
            sync()
            times[name] = []
        except Exception as err:  # a provider that cannot run this shape: say so in the row
            out[name] = error_status(err, 120)
    for _ in range(rounds):
        for name in [n for n in times if n not in out]:
            fn, grad = steps[name]
            try:
                with torch.set_grad_enabled(grad):
                    times[name].append(_round_ms(fn, calls, sync))
            except Exception as err:
                out[name] = error_status(err, 120)
    for name, samples in times.items():
        out.setdefault(name, statistics.median(samples))
    return {name: out[name] for name in steps}


def _causal_mask_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _document_mask_mod(doc_len: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx // doc_len == kv_idx // doc_len) & (kv_idx <= q_idx)

    return mask_mod


def training_providers(seq_len: int, batch: int, hq: int, hkv: int, d: int, document: bool) -> dict[str, Callable]:
    """name -> attention(q, k, v) for the causal (or the causal-document) mask at this shape."""
    import flexmask
    from flexmask import masks

    doc = seq_len // 4
    lengths = [doc] * 4
    spec = masks.document(lengths) if document else masks.causal()
    cm = flexmask.compile_mask(spec, seq_len, seq_len, device="cuda")
    providers = {
        "flexmask": lambda q, k, v: flexmask.attention(q, k, v, mask=cm),
        "flexmask_inline": ((lambda q, k, v: flexmask.attention(q, k, v, mask=masks.document([doc] * 4)))
                            if document else (lambda q, k, v: flexmask.attention(q, k, v, mask=masks.causal()))),
    }
    if not document:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)

        providers["sdpa_cudnn"] = sdpa
    from .providers import build_block_mask, compiled_flex_attention

    mask_mod = _document_mask_mod(doc) if document else _causal_mask_mod
    block_mask = build_block_mask(mask_mod, None, None, seq_len, "cuda")
    flex = compiled_flex_attention()
    providers["flex"] = lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=hq != hkv)
    return providers


def decode_providers(batch: int, sk: int, hq: int, hkv: int) -> dict[str, Callable]:
    import flexmask

    from .providers import compiled_flex_attention

    flex = compiled_flex_attention()
    return {
        "flexmask": lambda q, k, v: flexmask.attention(q, k, v),
        "sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "flex": lambda q, k, v: flex(q, k, v, enable_gqa=True),
    }


def training_inputs(batch: int, hq: int, hkv: int, seq_len: int, d: int, dtype=torch.bfloat16) -> tuple:
    """(q, k, v, do) on the GPU: random (B, H, S, D) inputs that need gradients, and dO."""
    q = torch.randn(batch, hq, seq_len, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, hkv, seq_len, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn_like(q)


def _step(attn: Callable, q, k, v, do, backward: bool) -> Callable:
    if not backward:
        return lambda: attn(q, k, v)

    def fwd_bwd():
        out = attn(q, k, v)
        out.backward(do)

    return fwd_bwd


CASE_GROUPS = ("training", "decode")  # --cases: the fwd / fwd_bwd (causal and document) cases, the decode steps


def measure(calls: int, seq_lens: Sequence[int], env: dict, log=print,
            cases: Sequence[str] = CASE_GROUPS) -> list[dict]:
    from .gpu import _raise_recompile_limits

    _raise_recompile_limits()  # compiled FlexAttention meets a new shape in every configuration
    rows = []
    d, dtype = 128, torch.bfloat16

    def add(case, seq_len, batch, hq, hkv, steps):
        """One row a provider of `steps` (name -> (step, with gradients)), timed in turn."""
        for provider, ms in interleaved_wall_ms(steps, calls).items():
            ms = ms if isinstance(ms, str) else f"{ms:.4f}"
            rows.append({**env, "case": case, "seq_len": seq_len, "batch": batch, "heads_q": hq, "heads_kv": hkv,
                         "head_dim": d, "provider": provider, "ms": ms})
            log(f"{case:18s} S={seq_len:6d} B={batch:3d} H={hq}/{hkv} {provider:18s} {ms}")

    for document in (False, True) if "training" in cases else ():
        for hq, hkv in HEADS:
            for seq_len in seq_lens:
                batch = max(1, TOKENS // seq_len)
                q, k, v, do = training_inputs(batch, hq, hkv, seq_len, d, dtype)
                suffix = "_document" if document else ""
                providers = training_providers(seq_len, batch, hq, hkv, d, document)
                for case, backward in (("fwd_bwd", True), ("fwd", False)):
                    add(case + suffix, seq_len, batch, hq, hkv,
                        {name: (_step(attn, q, k, v, do, backward), backward) for name, attn in providers.items()})
    hq, hkv = 32, 8
    for batch, sk in DECODE if "decode" in cases else ():
        q = torch.randn(batch, hq, 1, d, device="cuda", dtype=dtype)
        k = torch.randn(batch, hkv, sk, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        add("decode", sk, batch, hq, hkv,
            {name: (_step(attn, q, k, v, None, False), False) for name, attn in decode_providers(batch, sk, hq, hkv).items()})
    return rows


class _LaunchesStubbed:
    """Within it, flexmask's kernel launches (FastLaunch, and the decode steps' BoundLaunch) do
    nothing: the host work around them alone."""

    def __enter__(self):
        from flexmask.kernels.common import launcher

        self._launcher = launcher
        self._calls = launcher.FastLaunch.__call__, launcher.BoundLaunch.__call__
        launcher.FastLaunch.__call__ = lambda self, grid, *args, **kwargs: None
        launcher.BoundLaunch.__call__ = lambda self, *tensors: None
        return self

    def __exit__(self, *exc):
        self._launcher.FastLaunch.__call__, self._launcher.BoundLaunch.__call__ = self._calls
        return False


def _launches(fn) -> int:
    """CUDA launches of one call (torch.profiler), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def issue_time_us(fn, calls: int) -> float:
    """Median over five loops of the host microseconds per call (no synchronize inside a loop)."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def host_profile(env: dict, calls: int = 200, log=print) -> list[dict]:
    """Launches per call and host microseconds per call, at a shape too small to keep the GPU
    busy (B=1, H=16, S=512, D=128), for flexmask's fwd and fwd+bwd with a compiled mask and written
    inline, and a decode step (B=1, GQA 32/8, 8K cache); each also with its launches stubbed."""
    import flexmask
    from flexmask import masks

    seq_len, d = 512, 128
    q = torch.randn(1, 16, seq_len, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn_like(q, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    cm = flexmask.compile_mask(masks.causal(), seq_len, seq_len, device="cuda")
    cases = {
        ("fwd", "flexmask"): lambda: flexmask.attention(q.detach(), k.detach(), v.detach(), mask=cm),
        ("fwd_bwd", "flexmask"): _step(lambda a, b, c: flexmask.attention(a, b, c, mask=cm), q, k, v, do, True),
        ("fwd", "flexmask_inline"): lambda: flexmask.attention(q.detach(), k.detach(), v.detach(), mask=masks.causal()),
        ("fwd_bwd", "flexmask_inline"): _step(lambda a, b, c: flexmask.attention(a, b, c, mask=masks.causal()),
                                              q, k, v, do, True),
    }
    qd = torch.randn(1, 32, 1, d, device="cuda", dtype=torch.bfloat16)
    kd, vd = (torch.randn(1, 8, 8192, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def decode_step():
        with torch.no_grad():
            flexmask.attention(qd, kd, vd)

    cases[("decode", "flexmask")] = decode_step
    # every case timed before any launch is counted: torch.profiler, which counts them, can leave CUPTI
    # attached to the process (pytorch/pytorch#144455), and launches after it cost more host time
    host = {}
    for key, fn in cases.items():
        fn()  # warm-up
        real = issue_time_us(fn, calls)
        with _LaunchesStubbed():
            fn()
            host[key] = real, issue_time_us(fn, calls)
    rows = []
    for (case, provider), fn in cases.items():
        launches = _launches(fn)
        with _LaunchesStubbed():
            python_launches = _launches(fn)
        host_us, python_us = host[case, provider]
        for name, count, us in ((provider, launches, host_us), (provider + "_python", python_launches, python_us)):
            rows.append({**env, "case": case, "provider": name, "launches": count, "host_us": f"{us:.1f}"})
            log(f"host {case:8s} {name:23s} {count:3d} launches {us:8.1f} us")
    return rows


def _write(path: str, columns, rows) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def _ms(row) -> float | None:
    try:
        return float(row["ms"])
    except ValueError:
        return None


def table(rows: Sequence[dict]) -> str:
    """Markdown: per case and shape, each provider's ms per call and flexmask's ratio to the peer
    the issue names (sdpa_cudnn for training, sdpa for decode); inline against compiled."""
    if not rows:
        return "(no rows)"
    lines = [f"<!-- generated by `python -m benchmarks.per_call --table` from per_call.csv; do not edit by hand -->",
             "bf16, D = 128; ms per call, wall clock over a loop with one synchronize. Runs: "
             f"{_runs_text(rows)}.", ""]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    by_key: dict = {}
    for r in rows:
        by_key.setdefault((r["case"], int(r["seq_len"]), int(r["batch"]), r["heads_q"], r["heads_kv"]), {})[r["provider"]] = r
    for case in dict.fromkeys(r["case"] for r in rows):
        keys = [key for key in by_key if key[0] == case]
        names = [p for p in providers if any(p in by_key[key] for key in keys)]
        peer = "sdpa" if case == "decode" else "sdpa_cudnn" if "sdpa_cudnn" in names else "flex"
        ratio_cols = [f"flexmask / {peer}"] + (["inline / compiled"] if "flexmask_inline" in names else [])
        lines += [f"**{case}**", "", "| S | B | heads | " + " | ".join(names) + " | " + " | ".join(ratio_cols) + " |",
                  "|---" * (3 + len(names) + len(ratio_cols)) + "|"]
        for key in keys:
            cells = by_key[key]
            vals = [(_ms(cells[p]) if p in cells else None) for p in names]
            fm = _ms(cells["flexmask"]) if "flexmask" in cells else None
            ratios = []
            pv = _ms(cells[peer]) if peer in cells else None
            ratios.append(f"{fm / pv:.2f}" if fm and pv else "-")
            if "flexmask_inline" in names:
                iv = _ms(cells["flexmask_inline"]) if "flexmask_inline" in cells else None
                ratios.append(f"{iv / fm:.2f}" if iv and fm else "-")
            lines.append(f"| {key[1]} | {key[2]} | {key[3]}/{key[4]} | "
                         + " | ".join(f"{x:.3f}" if x is not None else "-" for x in vals) + " | " + " | ".join(ratios) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def summary(rows: Sequence[dict]) -> str:
    """Markdown for the README: fwd+bwd (causal) per S against sdpa_cudnn and the mask written in
    the call against a compiled one, for both head layouts; and the decode steps against sdpa."""
    if not rows:
        return "(no rows)"
    ms = {(r["case"], int(r["seq_len"]), int(r["batch"]), int(r["heads_q"]), r["provider"]): _ms(r) for r in rows}
    lines = ["<!-- generated by `python -m benchmarks.per_call --table` from per_call.csv; do not edit by hand -->",
             "| S | B | fwd+bwd 16/16: flexmask / sdpa_cudnn (ms) | x | fwd+bwd 32/8: flexmask / sdpa_cudnn (ms) | x "
             "| inline / compiled 16/16, 32/8 |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for s in sorted({int(r["seq_len"]) for r in rows if r["case"] == "fwd_bwd"}):
        b = max(1, TOKENS // s)
        cells, inline = [], []
        for hq in (16, 32):
            f, p = ms.get(("fwd_bwd", s, b, hq, "flexmask")), ms.get(("fwd_bwd", s, b, hq, "sdpa_cudnn"))
            i = ms.get(("fwd_bwd", s, b, hq, "flexmask_inline"))
            cells += [f"{f:.3f} / {p:.3f}" if f and p else "-", f"{f / p:.2f}" if f and p else "-"]
            inline.append(f"{i / f:.2f}" if i and f else "-")
        lines.append(f"| {s} | {b} | " + " | ".join(cells) + f" | {', '.join(inline)} |")
    lines += ["", "| decode: B | Sk | flexmask (ms) | sdpa (ms) | flex (ms) | flexmask / sdpa |", "|---:|---:|---:|---:|---:|---:|"]
    for b, sk in DECODE:
        f, p, x = (ms.get(("decode", sk, b, 32, n)) for n in ("flexmask", "sdpa", "flex"))
        lines.append(f"| {b} | {sk} | " + " | ".join(f"{v:.3f}" if v else "-" for v in (f, p, x))
                     + f" | {f'{f / p:.2f}' if f and p else '-'} |")
    lines += ["", "bf16, D = 128, causal, B x S = 16K; ms per call, wall clock over a loop with one synchronize. "
              f"Runs: {_runs_text(rows)}. Every case and provider: [docs/results.md](docs/results.md)."]
    return "\n".join(lines)


def plot(rows: Sequence[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in dict.fromkeys(r["case"] for r in rows) if c != "decode"]
    fig, axes = plt.subplots(len(HEADS), len(cases), figsize=(4 * len(cases), 3.2 * len(HEADS)), squeeze=False)
    for i, (hq, hkv) in enumerate(HEADS):
        for j, case in enumerate(cases):
            ax = axes[i][j]
            for provider in dict.fromkeys(r["provider"] for r in rows):
                pts = [(int(r["seq_len"]), _ms(r)) for r in rows if r["case"] == case and r["provider"] == provider
                       and int(r["heads_q"]) == hq and int(r["heads_kv"]) == hkv and _ms(r) is not None]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", label=provider)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{case}, heads {hq}/{hkv}", fontsize=9)
            ax.set_xlabel("S (B x S = 16K)")
            ax.set_ylabel("ms per call")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results", help="folder for per_call.csv, per_call_host.csv, per_call.png")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    p.add_argument("--cases", default=",".join(CASE_GROUPS),
                   help="comma-separated groups to measure: training (fwd, fwd_bwd, with and without documents), "
                        "decode; the tables take each case from the last run that measured it")
    p.add_argument("--readme", help="write the summary between the per-call markers of this file (README.md)")
    p.add_argument("--full", help="write every case's table between the per-call-full markers of this file "
                                  "(docs/results.md)")
    p.add_argument("--table", metavar="CSV",
                   help="measure nothing: print (or --readme) the table of this CSV's last run")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table, newline="") as f:
            rows = last_run(list(csv.DictReader(f)))
        _write_tables(rows, args)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.per_call measures wall-clock time per call on a GPU; no CUDA device here")
    import sys

    env = {k: v for k, v in environment("gpu", argv).items() if k in COLUMNS}
    env["command"] = "python -m benchmarks.per_call " + " ".join(sys.argv[1:] if argv is None else argv)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASE_GROUPS]
    if unknown:
        raise SystemExit(f"--cases must name some of {','.join(CASE_GROUPS)}, got {','.join(unknown)}")
    rows = measure(args.calls, [int(s) for s in args.seq_lens.split(",")], env, cases=cases)
    _write(os.path.join(args.out, "per_call.csv"), COLUMNS, rows)
    host = host_profile(env)
    _write(os.path.join(args.out, "per_call_host.csv"), HOST_COLUMNS, host)
    if "training" in cases:
        plot(rows, os.path.join(args.out, "per_call.png"))
    _write_tables(rows, args)
    return 0


def _run(r: dict) -> tuple:
    return r["date"], r["gpu"], r["command"]


def last_run(rows: Sequence[dict]) -> list[dict]:
    """Per case, the rows of the last run that measured it on the card of the CSV's last run (its
    date, card and command): the file keeps every run (`--cases` reruns some), and a table mixing
    cards would put one machine's figures under another's name. Every provider of a case comes
    from one run, one process."""
    if not rows:
        return []
    gpu = rows[-1]["gpu"]
    latest = {}  # case -> its last run on that card
    for r in rows:
        if r["gpu"] == gpu:
            latest[r["case"]] = _run(r)
    return [r for r in rows if r["gpu"] == gpu and latest.get(r["case"]) == _run(r)]


def _runs_text(rows: Sequence[dict]) -> str:
    """The runs a table's rows come from, each with its cases: card, versions, date, command."""
    runs: dict = {}
    for r in rows:
        runs.setdefault(_run(r), (r, []))[1].append(r["case"])
    return "; ".join(f"{', '.join(dict.fromkeys(cases))}: {r['gpu']}, torch {r['torch']}, triton {r['triton']}, "
                     f"{r['date'][:16]}, `{r['command']}`" for r, cases in runs.values())


def _write_tables(rows, args) -> None:
    if args.readme:
        write_marked_block(args.readme, summary(rows), START, END)
    if args.full:
        write_marked_block(args.full, table(rows), FULL_START, FULL_END)
    print(table(rows))


if __name__ == "__main__":
    raise SystemExit(main())
