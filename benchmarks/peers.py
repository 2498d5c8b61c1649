"""flexmask against FlashAttention-4 and FlexAttention's FLASH backend, in one process on one GPU.

    python -m benchmarks.peers [--out benchmarks/results] [--readme README.md --full docs/results.md]
    python -m benchmarks.peers --table benchmarks/results/peers.csv [--readme README.md --full docs/results.md]

Families FA4 expresses (causal, full, sliding_window_1024, causal_document: documents of 2K-8K
tokens, one seeded split per batch row, the same for every provider) for flexmask, fa4
(`flash_attn.cute.flash_attn_func` with `causal` / `window_size`; `flash_attn_varlen_func` on the
packed documents), flex_flash (compiled FlexAttention with `kernel_options={"BACKEND": "FLASH"}`),
flex (compiled FlexAttention, Triton) and sdpa_cudnn (full and causal); then every family of
benchmarks/families.py for flexmask, flex_flash and flex. 8K, 32K, 128K tokens (32K tokens per
batch), D = 128 and 64, heads 16/16 and 32/8, bf16. Forward and backward are timed apart by
`triton.testing.do_bench` (median); TFLOP/s count the mask's attending pairs only. A provider
that is not importable is left out with a one-line note; one that fails on a configuration gets
its row with the error as status. Rows are written as they are measured.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .report import environment, write_marked_block

COLUMNS = ("date", "gpu", "torch", "triton", "command", "family", "seq_len", "batch", "heads_q", "heads_kv",
           "head_dim", "provider", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "status")
PEER_FAMILIES = ("causal", "full", "sliding_window_1024", "causal_document")
PROVIDERS = ("flexmask", "fa4", "flex_flash", "flex", "sdpa_cudnn")
SEQ_LENS = (8192, 32768, 131072)
HEAD_DIMS = (128, 64)
HEADS = ((16, 16), (32, 8))
TOKENS = 32768
DOC_RANGE = (2048, 8192)
WINDOW = 1024  # keys each query sees under sliding_window_1024, itself included
START, END = "<!-- peers:start -->", "<!-- peers:end -->"
FULL_START, FULL_END = "<!-- peers-full:start -->", "<!-- peers-full:end -->"


@dataclass
class PeerCase:
    """One mask at one shape, as every provider states it."""

    family: str
    seq_len: int
    batch: int
    mask: object  # flexmask.masks.Mask
    doc_lengths: list | None = None  # per batch row (causal_document)
    fa4: dict | None = None  # flash_attn_func keywords; None where FA4 cannot express the mask
    sdpa_causal: bool | None = None  # SDPA's is_causal; None where SDPA has no native mask


def document_split(seq_len: int, gen: torch.Generator, doc_range: tuple[int, int] = DOC_RANGE) -> list[int]:
    """Document lengths in [doc_range] summing to seq_len (the last one takes the remainder, and
    a remainder shorter than the range's low end joins the document before it)."""
    lo, hi = doc_range
    out, left = [], seq_len
    while left > 0:
        n = min(left, int(torch.randint(lo, hi + 1, (1,), generator=gen)))
        out.append(n)
        left -= n
    if len(out) > 1 and out[-1] < lo:
        short = out.pop()
        out[-1] += short
    return out


def peer_case(family: str, seq_len: int, batch: int, seed: int = 0, doc_range=DOC_RANGE) -> PeerCase:
    from flexmask import masks

    if family == "causal":
        return PeerCase(family, seq_len, batch, masks.causal(), fa4={"causal": True}, sdpa_causal=True)
    if family == "full":
        return PeerCase(family, seq_len, batch, masks.full(), fa4={"causal": False}, sdpa_causal=False)
    if family == "sliding_window_1024":
        return PeerCase(family, seq_len, batch, masks.sliding_window(WINDOW - 1),
                        fa4={"causal": True, "window_size": (WINDOW - 1, 0)})
    if family == "causal_document":
        gen = torch.Generator().manual_seed(seed)
        lengths = [document_split(seq_len, gen, doc_range) for _ in range(batch)]
        return PeerCase(family, seq_len, batch, masks.document(lengths, causal=True), doc_lengths=lengths,
                        fa4={"causal": True})
    raise ValueError(f"family must be one of {PEER_FAMILIES}, got {family!r}")


def family_case(family: str, seq_len: int, batch: int, heads: int, seed: int = 0) -> PeerCase:
    """A family of benchmarks/families.py: flexmask, flex_flash and flex only."""
    from . import families

    return PeerCase(family, seq_len, batch, families.build(family, seq_len, batch, heads, seed).make())


def cu_seqlens(doc_lengths: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, int]:
    """int32 cumulative lengths of the documents of every batch row, packed row after row, and
    the longest document (FlashAttention's varlen arguments)."""
    flat = [n for row in doc_lengths for n in row]
    cu = torch.tensor([0] + flat, dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu.to(device), max(flat)


def document_mask_mod(doc_lengths: Sequence[Sequence[int]], device) -> Callable:
    doc = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in doc_lengths])
    doc = doc.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


def missing(provider: str) -> str | None:
    """None where the provider can run here, else why not (one line)."""
    try:
        if provider == "fa4":
            import flash_attn.cute  # noqa: F401
        elif provider in ("flex", "flex_flash"):
            import torch.nn.attention.flex_attention  # noqa: F401
        elif provider == "sdpa_cudnn":
            from torch.nn.attention import SDPBackend
            getattr(SDPBackend, "CUDNN_ATTENTION")
    except (ImportError, AttributeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def make_attn(provider: str, case: PeerCase, heads: tuple[int, int]) -> tuple[Callable | None, str, str]:
    """(attn taking and returning the provider's own layout, its layout "bhsd" / "bshd" / "packed",
    status): attn None where the provider cannot express the mask."""
    import flexmask

    hq, hkv = heads
    device = torch.device("cuda")
    if provider == "flexmask":
        cm = flexmask.compile_mask(case.mask, case.seq_len, case.seq_len, device=device)
        return (lambda q, k, v: flexmask.attention(q, k, v, mask=cm)), "bhsd", "ok"
    if provider == "sdpa_cudnn":
        if case.sdpa_causal is None:
            return None, "", "not expressible"
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.sdpa_causal,
                                                                        enable_gqa=hq != hkv)
        return sdpa, "bhsd", "ok"
    if provider == "fa4":
        if case.fa4 is None:
            return None, "", "not expressible"
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        if case.doc_lengths is not None:
            cu, longest = cu_seqlens(case.doc_lengths, device)
            return (lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                           max_seqlen_q=longest, max_seqlen_k=longest,
                                                           **case.fa4)[0]), "packed", "ok"
        return (lambda q, k, v: flash_attn_func(q, k, v, **case.fa4)[0]), "bshd", "ok"
    if provider in ("flex", "flex_flash"):
        from .providers import build_block_mask, compiled_flex_attention, intervals_mask_mod

        if case.family == "full":
            block_mask, batch = None, None
        else:
            if case.doc_lengths is not None:
                mask_mod, batch = document_mask_mod(case.doc_lengths, device), case.batch
            else:
                iv = case.mask.intervals(case.seq_len, case.seq_len, device)
                mask_mod, batch = intervals_mask_mod(iv, hq)[0], (None if iv.shape[0] == 1 else case.batch)
            block_mask = build_block_mask(mask_mod, batch, None, case.seq_len, device)
        flex = compiled_flex_attention()
        options = {"kernel_options": {"BACKEND": "FLASH"}} if provider == "flex_flash" else {}
        return (lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=hq != hkv, **options)), "bhsd", "ok"
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A (B, H, S, D) tensor in a provider's layout, contiguous, as a new leaf."""
    if layout == "bshd":
        t = t.transpose(1, 2)
    elif layout == "packed":
        t = t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])
    return t.contiguous().detach().requires_grad_(True)


def from_layout(t: torch.Tensor, layout: str, shape) -> torch.Tensor:
    if layout == "bshd":
        return t.transpose(1, 2)
    if layout == "packed":
        b, h, s, d = shape
        return t.view(b, s, h, d).transpose(1, 2)
    return t


def measure_case(case: PeerCase, heads, head_dim: int, providers: Sequence[str], env: dict, write, log,
                 warmup: int = 25, rep: int = 100) -> None:
    from . import flops, timing

    hq, hkv = heads
    gen = torch.Generator("cuda").manual_seed(0)
    shape_q, shape_kv = (case.batch, hq, case.seq_len, head_dim), (case.batch, hkv, case.seq_len, head_dim)
    q, do = (torch.randn(shape_q, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(shape_kv, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pairs = flops.attending_pairs(case.mask.intervals(case.seq_len, case.seq_len, "cuda"), case.seq_len,
                                  case.batch, hq)
    work = flops.attention_flops(pairs, head_dim)
    want = None
    for provider in providers:
        row = {**env, "family": case.family, "seq_len": case.seq_len, "batch": case.batch, "heads_q": hq,
               "heads_kv": hkv, "head_dim": head_dim, "provider": provider}
        try:
            attn, layout, status = make_attn(provider, case, heads)
            if attn is None:
                continue  # the provider cannot state this mask: no row
            args = [to_layout(t, layout) for t in (q, k, v)]
            dout = to_layout(do, layout).detach()
            out = from_layout(attn(*args), layout, shape_q).float()
            if want is None:
                want = out.detach()  # flexmask runs first: the others are checked against it
            else:
                status = f"max |out - flexmask| {float((out - want).abs().max()):.1e}"
            times = timing.bench_gpu(attn, *args, dout, ("fwd", "bwd"), warmup, rep)
            row.update(fwd_ms=f"{times['fwd'].median:.4f}", bwd_ms=f"{times['bwd'].median:.4f}",
                       fwd_tflops=f"{flops.tflops(work['fwd'], times['fwd'].median):.1f}",
                       bwd_tflops=f"{flops.tflops(work['bwd'], times['bwd'].median):.1f}", status=status)
        except Exception as err:  # a provider that fails here keeps its row, with the error
            row["status"] = f"error: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        write(row)
        log(f"{case.family:22s} S={case.seq_len:6d} D={head_dim} H={hq}/{hkv} {provider:10s} "
            f"fwd {row.get('fwd_tflops', '-'):>6} bwd {row.get('bwd_tflops', '-'):>6} TFLOP/s  {row['status']}")
        torch.cuda.empty_cache()


def _num(row, key) -> float | None:
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return None


def table(rows: Sequence[dict], families: Sequence[str] | None = None, head_dims=None, heads=None) -> str:
    """Markdown: per configuration, flexmask's TFLOP/s fwd / bwd, its ratio to fa4 per direction
    and its fwd+bwd time ratio to flex_flash and flex."""
    if not rows:
        return "(no rows)"
    by_key: dict = {}
    for r in rows:
        key = (r["family"], int(r["seq_len"]), int(r["head_dim"]), f"{r['heads_q']}/{r['heads_kv']}")
        by_key.setdefault(key, {})[r["provider"]] = r
    first = rows[0]
    lines = ["<!-- generated by `python -m benchmarks.peers --table` from peers.csv; do not edit by hand -->",
             "| family | S | D | heads | flexmask fwd / bwd TFLOP/s | fa4 fwd / bwd | flexmask / fa4 fwd, bwd "
             "| flexmask / flex_flash fwd+bwd | flexmask / flex fwd+bwd |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]

    def total(r):
        f, b = _num(r, "fwd_ms"), _num(r, "bwd_ms")
        return f + b if f and b else None

    for key, cells in by_key.items():
        family, s, d, h = key
        if (families and family not in families) or (head_dims and d not in head_dims) or (heads and h not in heads):
            continue
        fm, fa = cells.get("flexmask", {}), cells.get("fa4")
        tf = f"{_num(fm, 'fwd_tflops') or 0:.0f} / {_num(fm, 'bwd_tflops') or 0:.0f}" if fm.get("fwd_ms") else "-"
        ta = f"{_num(fa, 'fwd_tflops') or 0:.0f} / {_num(fa, 'bwd_tflops') or 0:.0f}" if fa and fa.get("fwd_ms") else "-"
        ratio_fa = "-"
        if fa and fa.get("fwd_ms") and fm.get("fwd_ms"):
            ratio_fa = f"{_num(fa, 'fwd_ms') / _num(fm, 'fwd_ms'):.2f}, {_num(fa, 'bwd_ms') / _num(fm, 'bwd_ms'):.2f}"
        peers = []
        for peer in ("flex_flash", "flex"):
            p = cells.get(peer)
            peers.append(f"{total(p) / total(fm):.2f}" if p and total(p) and fm and total(fm) else "-")
        lines.append(f"| {family} | {s // 1024}K | {d} | {h} | {tf} | {ta} | {ratio_fa} | {peers[0]} | {peers[1]} |")
    lines += ["", f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}, bf16, 32K tokens per batch; "
              "ratios are speedups (the peer's time / flexmask's), so > 1 means flexmask is faster; "
              f"`{first['command']}`."]
    return "\n".join(lines)


def write_tables(rows, readme: str | None, full: str | None) -> None:
    if readme:  # the README: what FA4 expresses, D = 128, 16/16 heads
        write_marked_block(readme, table(rows, PEER_FAMILIES, (128,), ("16/16",)), START, END)
    if full:
        write_marked_block(full, table(rows), FULL_START, FULL_END)
    print(table(rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results", help="folder for peers.csv")
    p.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    p.add_argument("--heads", default=",".join(f"{a}/{b}" for a, b in HEADS))
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--families", default="peers,all", help="'peers' (what FA4 expresses), 'all' (families.py), "
                                                            "or names")
    p.add_argument("--time-budget-s", type=float, default=None, help="start no configuration after this")
    p.add_argument("--readme", help="write the summary between the peers markers of this file (README.md)")
    p.add_argument("--full", help="write the full table between the peers-full markers of this file")
    p.add_argument("--table", metavar="CSV", help="measure nothing: the tables of this CSV")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table, newline="") as f:
            write_tables(list(csv.DictReader(f)), args.readme, args.full)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.peers times kernels on a GPU; no CUDA device here")
    import sys

    from . import families
    from .gpu import _raise_recompile_limits

    _raise_recompile_limits()
    env = {k: v for k, v in environment("gpu", argv).items() if k in COLUMNS}
    env["command"] = "python -m benchmarks.peers " + " ".join(sys.argv[1:] if argv is None else argv)
    providers = []
    for name in args.providers.split(","):
        why = missing(name)
        if why:
            print(f"note: {name} left out: {why}")
        else:
            providers.append(name)
    names = []
    for item in args.families.split(","):
        names += list(PEER_FAMILIES) if item == "peers" else list(families.FAMILIES) if item == "all" else [item]
    path = os.path.join(args.out, "peers.csv")
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict] = []
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()

        def write(row):
            writer.writerow(row)
            f.flush()
            rows.append(row)

        t0 = time.time()
        for head_dim in (int(x) for x in args.head_dims.split(",")):
            for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
                for seq_len in (int(x) for x in args.seq_lens.split(",")):
                    batch = max(1, TOKENS // seq_len)
                    done = set()
                    for family in names:
                        if family in done:
                            continue
                        done.add(family)
                        if args.time_budget_s is not None and time.time() - t0 > args.time_budget_s:
                            print(f"time budget of {args.time_budget_s} s spent: stopping")
                            write_tables(rows, args.readme, args.full)
                            return 0
                        is_peer = family in PEER_FAMILIES
                        case = peer_case(family, seq_len, batch) if is_peer else family_case(family, seq_len, batch, hq)
                        chosen = providers if is_peer else [x for x in providers if x in ("flexmask", "flex_flash", "flex")]
                        measure_case(case, (hq, hkv), head_dim, chosen, env, write, print)
    write_tables(rows, args.readme, args.full)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
