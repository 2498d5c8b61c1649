"""Compile the mask compiler's kernels for sm_90 as `build_tables_device` launches them, on a
machine without a GPU (Triton's bundled ptxas; see tools.offline_compile): the classify kernel
with its fused scan (META given) for a loaded and for computed families and for k runs per column
(4, 8, 16), composed pairs of
families (`a & b`, `a | b`, the kv_cache shift of either operand), the emit kernel and the
document-bounds kernel. Prints one line per kernel: registers, spills, shared memory.

    python -m tools.compile_variants_offline
"""

from __future__ import annotations

import torch

from .offline_compile import compile_offline, report


def _classify(family: int, pair: dict | None = None, runs: int = 2):
    from flexmask.masks import compiler_kernels as ck

    t32, t64 = torch.empty(16, dtype=torch.int32), torch.empty(16, dtype=torch.int64)
    args = dict(IV=t32, PLANAR=t32, GRID=torch.empty(16, dtype=torch.uint8), COUNTS=t32, DIFFS=t32, DOCS=t32,
                PREFIXES=t32, Sq=1000, Sk=1000, NQB=100, NKB=100, G_ROW=32, offset=0, P0=5, P1=6, P2=7,
                DOC_STRIDE=9, DOC_ITERS=3, RAGGED_N=7, META=t32)
    constexprs = dict(FAMILY=family, TILE_M=128, TILE_N=128, CHUNK=ck.CHUNK_M, RUNS=runs)
    if pair is not None:
        b_docs = t64 if pair["B_FAMILY"] == ck.KV_CACHE else t32
        args.update(B_DOCS=b_docs, B_PREFIXES=t32, B_P0=3, B_P1=4, B_P2=5, B_DOC_STRIDE=9, B_DOC_ITERS=3)
        if family == ck.KV_CACHE:
            args["DOCS"] = t64
        constexprs.update(pair)
    return compile_offline(ck._classify_kernel, args, constexprs, dict(num_warps=ck.classify_warps(runs)))


def _emit():
    from flexmask.masks import compiler_kernels as ck

    t32 = torch.empty(16, dtype=torch.int32)
    args = dict(GRID=torch.empty(16, dtype=torch.uint8), BWD_OFFSETS=t32, BWD_NUM_FULL=t32, BWD_BLOCKS=t32,
                BWD_EXACT=torch.empty(16, dtype=torch.int8), FWD_OFFSETS=t32, FWD_NUM_FULL=t32, FWD_BLOCKS=t32,
                capacity=1000, NQB=100, NKB=100, G_ROW=32, N_BWD=100, NQC=4, RAGGED_N=7)
    return compile_offline(ck._emit_kernel, args, dict(CHUNK=ck.CHUNK_M, BLOCK_QM=ck.FWD_M, BLOCK_QN=ck.FWD_N),
                           dict(num_warps=4))


def _document_bounds():
    from flexmask.masks import compiler_kernels as ck

    args = dict(LENGTHS=torch.empty(16, dtype=torch.int64), BOUNDS=torch.empty(16, dtype=torch.int32), n_docs=9,
                stride_row=9)
    return compile_offline(ck._document_bounds_kernel, args, dict(BLOCK=ck.COMPOSE_BLOCK), dict(num_warps=4))


def variants() -> list:
    """(name, kernel factory) of every variant compiled here."""
    from flexmask.masks import compiler_kernels as ck

    def pair(b, is_and=True, bcast_a=False, bcast_b=False, shift=0):
        return dict(B_FAMILY=b, AND=is_and, A_BCAST=bcast_a, B_BCAST=bcast_b, SHIFT=shift)

    out = [(f"classify+scan {name}", lambda c=getattr(ck, name): _classify(c))
           for name in ("LOAD", "CAUSAL", "DOCUMENT", "PREFIX_LM_DOCUMENT", "KV_CACHE")]
    out += [(f"classify+scan {runs} runs", lambda r=runs: _classify(ck.LOAD, runs=r)) for runs in (4, 8, 16)]
    out += [
        ("classify causal&sliding_window", lambda: _classify(ck.CAUSAL, pair(ck.SLIDING_WINDOW))),
        ("classify document|sliding_window", lambda: _classify(ck.DOCUMENT, pair(ck.SLIDING_WINDOW, False, False, True))),
        ("classify kv_cache&sliding_window", lambda: _classify(ck.KV_CACHE, pair(ck.SLIDING_WINDOW, True, False, True, 2))),
        ("classify document&kv_cache", lambda: _classify(ck.DOCUMENT, pair(ck.KV_CACHE, True, True, False, 1))),
        ("emit", _emit),
        ("document_bounds", _document_bounds),
    ]
    return out


def main(argv=None) -> None:
    import argparse

    argparse.ArgumentParser(prog="python -m tools.compile_variants_offline", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    for name, make in variants():
        print(report(name, make()), flush=True)


if __name__ == "__main__":
    main()
