"""Context parallelism (`flexmask.distributed`) against the dense reference.

The CPU cases run in ONE fork of four gloo processes (spawning costs seconds per process
under the interpreter): the world-size-4 cases use the default group, the world-size-3 and 2
cases the subgroups of ranks {0, 1, 2} and {0, 1} (so the `group` argument is exercised too); a few
cases shard by another `fmd.Layout` (the mask's balanced one, or a given pairing). Rank 0 of each case
gathers the unsharded output, LSE and gradients and saves them; the tests here compare them
with autograd through `flexmask.reference` by the DESIGN.md section 4 rule. Bad input is
checked inside the same processes and reported back the same way.

The GPU tests run the same worker with NCCL on two and on four CUDA devices (each skipped
where fewer are present), in bf16 at a few thousand tokens.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flexmask import distributed as fmd
from flexmask import masks, reference

from conftest import (
    assert_close_to_reference,
    case_id,
    default_floor,
    make_mask,
    make_qkv,
    reference_grads,
)

FP32, BF16 = torch.float32, torch.bfloat16


@dataclass(frozen=True)
class Case:
    world: int
    family: str
    s: int
    b: int = 1
    hq: int = 2
    hkv: int = 1
    d: int = 32
    dtype: torch.dtype = FP32
    with_dlse: bool = False
    layout: str = "bhsd"  # "bshd": q/k/v are .transpose(1, 2) views, sharded along dim 1 of (B, S, H, D)
    terms: bool | str = False  # softcap and sinks (score terms, DESIGN.md section 1), "alibi" with ALiBi: case_terms
    chunks: str | tuple | None = None  # fmd layout: None (default), "balanced" (the mask's), or its chunks

    @property
    def name(self) -> str:
        extra = f"W{self.world}" + ("-dlse" if self.with_dlse else "") + ("-bshd" if self.layout == "bshd" else "")
        extra += ("-softcap-sinks" + ("-alibi" if self.terms == "alibi" else "")) if self.terms else ""
        if self.chunks is not None:
            extra += "-" + (self.chunks if isinstance(self.chunks, str) else "".join(f"{a}{b}" for a, b in self.chunks))
        return case_id(self.b, self.hq, self.hkv, self.s, None, self.d, self.dtype, self.family, extra)


def case_layout(case: Case) -> fmd.Layout | None:
    if case.chunks is None:
        return None
    if case.chunks == "balanced":
        return fmd.balanced_layout(case_mask(case), case.s, case.world)
    return fmd.Layout(case.world, case.chunks)


def case_mask(case: Case) -> masks.Mask:
    s = case.s
    if case.family == "document_crossing":  # documents that straddle the chunk boundaries
        c = s // (2 * case.world)
        seqlens = [c - 8, c + 22, c - 10, s - 3 * c - 4]
        return masks.document(seqlens, causal=True)
    if case.family == "document_uneven":  # a long document, then short ones: the default layout is uneven
        if (case.world, s) in ((2, 96), (4, 192)):
            seqlens = [72, 8, 8, 8] if case.world == 2 else [130, 10, 12, 10, 30]
        else:  # 5/8 of the sequence, then documents of S/32
            first, piece = 5 * s // 8 + 10, s // 32
            seqlens = [first] + [piece] * ((s - first) // piece) + ([(s - first) % piece] if (s - first) % piece else [])
        return masks.document(seqlens, causal=True)
    if case.family == "narrow_window":  # far chunk pairs are empty: skipped, never received
        return masks.sliding_window(s // (2 * case.world) - 18)
    if case.family == "global_tokens_window":  # k runs per column: a window and two global tokens
        return masks.sliding_window(5, 2) | masks.global_tokens([s // 5, s // 2 + 3])
    if case.family == "empty_rows":  # the first query chunk (and a bit more) attends nothing
        return masks.column_intervals(torch.zeros(s, dtype=torch.int64), torch.full((s,), s // 3))
    return make_mask(case.family, s, s, batch=case.b, heads=case.hq)


def case_terms(case: Case, device="cpu") -> dict:
    """Soft-capping inside every chunk call, and sinks added once per row after the merge; with
    "alibi" ALiBi slopes too ((B, Hq) where B > 1), large enough that a wrong distance shows."""
    if not case.terms:
        return {}
    sinks = torch.randn(case.hq, generator=torch.Generator().manual_seed(3)).to(device)
    terms = {"softcap": 2.0, "sinks": sinks}
    if case.terms == "alibi":
        shape = (case.b, case.hq) if case.b > 1 else (case.hq,)
        terms["alibi_slopes"] = (0.05 + 0.2 * torch.rand(shape, generator=torch.Generator().manual_seed(4))).to(device)
    return terms


def case_inputs(case: Case, device="cpu"):
    q, k, v = make_qkv(case.b, case.hq, case.hkv, case.s, case.s, case.d, case.dtype, seed=case.s + case.world)
    gen = torch.Generator().manual_seed(7 + case.world)
    do = torch.randn(q.shape, generator=gen).to(case.dtype)
    dlse = torch.randn(q.shape[:3], generator=gen) if case.with_dlse else None
    move = (lambda t: None if t is None else t.to(device))
    return tuple(move(t) for t in (q, k, v, do, dlse))


CPU_CASES = [
    # W=2 at S=96 and W=3 at S=144: chunks of 24 tokens, so every call is one tile of the interpreter
    Case(2, "causal", 96, with_dlse=True),
    Case(2, "document_crossing", 96),
    Case(2, "narrow_window", 96),
    Case(2, "full", 96),
    Case(2, "startend_bidir", 96),  # random per-head column intervals, two per column
    Case(2, "empty_rows", 96, with_dlse=True),
    Case(2, "causal", 96, dtype=BF16),
    Case(2, "sliding_window_bidir", 96, layout="bshd"),
    Case(2, "document_uneven", 96, chunks="balanced"),  # rank 0 holds [0 | 1], rank 1 [2 | 3]
    Case(2, "causal", 96, chunks=((3, 1), (0, 2))),  # chunks out of sequence order inside a shard
    Case(3, "causal", 144, with_dlse=True),
    Case(3, "document_crossing", 144),
    Case(3, "document_per_batch", 144, b=2),
    Case(2, "empty_rows", 96, with_dlse=True, terms=True),  # rows that see nothing: output 0, LSE = the sink
    Case(3, "causal", 144, terms=True),
    # ALiBi: distances between global positions, one call per key chunk (a rank's two are apart)
    Case(2, "sliding_window_bidir", 96, terms="alibi", with_dlse=True),
    Case(3, "document_per_batch", 144, b=2, terms="alibi"),
    Case(2, "global_tokens_window", 96),  # more than two masked runs in a column: the k-run tables
    # W=4 at S=192: chunks of 24 again; one spawn, so only the two cases that matter most
    Case(4, "causal", 192, with_dlse=True),
    Case(4, "document_crossing", 192),
    Case(4, "document_uneven", 192, chunks="balanced", with_dlse=True),  # [0|3] [1|5] [2|7] [4|6]
]
CPU_WORLD = max(c.world for c in CPU_CASES)


# --- the worker: runs in every spawned process ----------------------------------------------


def _run_case(case: Case, group, device) -> dict | None:
    """fmd.attention on the shards, forward and backward; rank 0 returns the unsharded results."""
    mask = case_mask(case)
    lay = case_layout(case)
    q, k, v, do, dlse = case_inputs(case, device)
    if case.layout == "bshd":  # shard the (B, S, H, D) tensors along S and hand over (B, H, S, D) views
        ql, kl, vl = (fmd.shard(t.transpose(1, 2), group, seq_dim=1, layout=lay).detach().requires_grad_(True)
                      .transpose(1, 2) for t in (q, k, v))
        ql.retain_grad(), kl.retain_grad(), vl.retain_grad()
    else:
        ql, kl, vl = (fmd.shard(t, group, layout=lay).detach().requires_grad_(True) for t in (q, k, v))
    terms = case_terms(case, device)
    if "sinks" in terms:
        terms["sinks"].requires_grad_(True)
    out, lse = fmd.attention(ql, kl, vl, mask, group, return_lse=True, layout=lay, **terms)
    loss = (out * fmd.shard(do, group, layout=lay)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * fmd.shard(dlse, group, layout=lay)).sum()
    loss.backward()
    got = [fmd.unshard(t.detach(), group, layout=lay) for t in (out, lse, ql.grad, kl.grad, vl.grad)]
    if "sinks" in terms:  # each rank's gradient covers its rows: summed as for any replicated parameter
        dsinks = terms["sinks"].grad.clone()
        dist.all_reduce(dsinks, group=group)
        got.append(dsinks)
    return {"got": [t.cpu() for t in got], "plan": fmd.context_plan(mask, case.s, case.world).pairs}


def _expect_error(results: dict, name: str, fn) -> None:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as err:
        results[name] = (type(err).__name__, str(err))
    else:
        results[name] = ("no error", "")


def _bad_input(group, device) -> dict:
    """Each bad call, with the exception it raised; called on every rank of `group` (W=2)."""
    res: dict = {}
    x = torch.randn(1, 2, 90, 8, device=device)  # 90 is not a multiple of 2W = 4
    _expect_error(res, "shard_length", lambda: fmd.shard(x, group))
    _expect_error(res, "shard_seq_dim", lambda: fmd.shard(x, group, seq_dim=4))
    _expect_error(res, "unshard_odd", lambda: fmd.unshard(x[:, :, :45], group))
    q = torch.randn(1, 2, 48, 8, device=device)
    _expect_error(res, "odd_local", lambda: fmd.attention(q[:, :, :47], q[:, :, :47], q[:, :, :47], None, group))
    _expect_error(res, "q_k_lengths", lambda: fmd.attention(q, q[:, :, :46], q[:, :, :46], None, group))
    _expect_error(res, "mask_type", lambda: fmd.attention(q, q, q, torch.ones(96, 96, dtype=torch.bool), group))
    _expect_error(res, "mask_length", lambda: fmd.attention(q, q, q, masks.document([50, 50]), group))
    _expect_error(res, "rank_3d", lambda: fmd.attention(q[0], q[0], q[0], None, group))
    _expect_error(res, "alibi", lambda: fmd.attention(q, q, q, None, group, alibi_slopes=torch.ones(3, device=device)))
    _expect_error(res, "sinks_shape", lambda: fmd.attention(q, q, q, None, group, sinks=torch.ones(3)))
    # without autograd (inference) the same calls give the same output, bit for bit
    causal = masks.causal()
    qs, ks, vs = (torch.randn(1, 2, 48, 8, device=device, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.no_grad():
        plain = fmd.attention(qs, ks, vs, causal, group)
    traced = fmd.attention(qs.requires_grad_(True), ks, vs, causal, group)
    res["no_grad_equal"] = bool(torch.equal(plain, traced.detach()))
    # every rank passes a different mask: caught by the plan check, on every rank, no hang
    differ = masks.causal() if dist.get_rank(group) == 0 else masks.sliding_window(10)
    _expect_error(res, "ranks_disagree", lambda: fmd.attention(q, q, q, differ, group))
    # layouts: one for another world size, something else than a Layout, and a different one per rank
    three = fmd.Layout.default(3)
    _expect_error(res, "layout_world_shard", lambda: fmd.shard(q, group, layout=three))
    _expect_error(res, "layout_world_unshard", lambda: fmd.unshard(q, group, layout=three))
    _expect_error(res, "layout_world_attention", lambda: fmd.attention(q, q, q, causal, group, layout=three))
    _expect_error(res, "layout_type", lambda: fmd.attention(q, q, q, causal, group, layout=((0, 3), (1, 2))))
    # (a new mask object: a plan one rank has cached is not checked again, so that rank would not
    # join the check)
    mine = fmd.Layout(2, ((0, 3), (1, 2)) if dist.get_rank(group) == 0 else ((0, 1), (2, 3)))
    _expect_error(res, "layouts_disagree", lambda: fmd.attention(q, q, q, masks.causal(), group, layout=mine))
    # shard -> unshard is the identity, and unshard's gradient sums the ranks' gradients
    y = torch.randn(2, 96, 3, device=device).requires_grad_(True)
    dist.broadcast(y.data, src=dist.get_global_rank(group, 0), group=group)
    back = fmd.unshard(fmd.shard(y, group, seq_dim=1), group, seq_dim=1)
    (back * torch.arange(96, device=device).view(1, 96, 1)).sum().backward()
    res["roundtrip"] = bool(torch.equal(back.detach(), y.detach()))
    # both ranks' losses weigh position j by j: the shard's positions get 2 j, the others 0
    held = fmd.shard(torch.arange(96, device=device), group, seq_dim=0)
    want = torch.zeros_like(y)
    want[:, held] = 2 * held.view(1, -1, 1).float()
    res["unshard_grad"] = bool(torch.equal(y.grad, want))
    res["roundtrip_layouts"] = _roundtrip_layouts(group, device)
    return res


def random_layouts(world: int, n: int, seed: int) -> list[fmd.Layout]:
    """`n` random pairings of the 2W chunks (the same on every rank: a seeded generator)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        perm = torch.randperm(2 * world, generator=gen).tolist()
        out.append(fmd.Layout(world, tuple(zip(perm[:world], perm[world:]))))
    return out


def _roundtrip_layouts(group, device) -> bool:
    """unshard(shard(y)) == y, and a shard holds the positions of its layout's chunks, for
    random layouts of the group's size."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    s = 8 * world
    c = s // (2 * world)
    y = torch.arange(2 * s * 3, device=device, dtype=torch.float32).view(2, s, 3)
    ok = True
    for lay in random_layouts(world, 4, seed=world):
        part = fmd.shard(y, group, seq_dim=1, layout=lay)
        want = torch.cat([torch.arange(ch * c, (ch + 1) * c) for ch in lay.rank_chunks(rank)])
        ok &= bool(torch.equal(part[0, :, 0].long().cpu(), 3 * want))
        ok &= bool(torch.equal(fmd.unshard(part, group, seq_dim=1, layout=lay), y))
    return ok


def _worker(rank: int, world: int, init_file: str, out_file: str, cases: list, backend: str, bad_input: bool):
    torch.set_num_threads(1)
    if backend == "gloo":  # a hang prints every rank's Python stack and ends before the gloo timeout
        faulthandler.dump_traceback_later(170, exit=True)
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    try:
        groups = {world: None}
        for w in range(2, world):
            groups[w] = dist.new_group(list(range(w)))  # every rank must create every group
        results = {}
        for case in cases:  # an exception ends this process, and mp ends the others with its traceback
            if rank < case.world:
                results[case.name] = _run_case(case, groups[case.world], device)
        if bad_input and rank < 2:
            results["bad_input"] = _bad_input(groups[2], device)
        if bad_input:
            results[f"roundtrip_layouts_W{world}"] = _roundtrip_layouts(groups[world], device)
        if rank == 0:
            torch.save(results, out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(tmp_dir, world: int, cases: list, backend: str, bad_input: bool) -> dict:
    init_file = os.path.join(tmp_dir, f"init-{backend}")
    out_file = os.path.join(tmp_dir, f"results-{backend}.pt")
    # fork on CPU: the children inherit the imported torch/Triton (spawning re-imports them, ~4 s a
    # process on a busy CPU); CUDA cannot be forked, so NCCL runs spawn
    start = "spawn" if backend == "nccl" else "fork"
    mp.start_processes(_worker, args=(world, init_file, out_file, cases, backend, bad_input), nprocs=world,
                       join=True, start_method=start)
    return torch.load(out_file)


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    return _spawn(str(tmp_path_factory.mktemp("cp")), CPU_WORLD, CPU_CASES, "gloo", bad_input=True)


# --- checks -------------------------------------------------------------------------------


def reference_with_terms(q, k, v, mask, do, dlse, terms: dict, dtype):
    """(out, lse, dq, dk, dv, dsinks) by autograd through reference.attention with the score terms."""
    qr, kr, vr = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    sinks = terms["sinks"].detach().to(dtype).requires_grad_(True)
    out, lse = reference.attention(qr, kr, vr, mask, dtype=dtype, softcap=terms["softcap"], sinks=sinks,
                                   alibi_slopes=terms.get("alibi_slopes"))
    loss = (out * do.to(dtype)).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.to(dtype)).sum()
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, (qr, kr, vr, sinks)))


def check_case(case: Case, result: dict, device="cpu") -> None:
    mask = case_mask(case)
    q, k, v, do, dlse = case_inputs(case, device)
    if case.terms:
        terms = case_terms(case, device)
        ref64 = reference_with_terms(q, k, v, mask, do, dlse, terms, torch.float64)
        lowp = reference_with_terms(q, k, v, mask, do, dlse, terms, case.dtype)
    else:
        ref64 = reference_grads(q, k, v, mask, do, dlse=dlse)
        lowp = reference_grads(q, k, v, mask, do, dtype=case.dtype, dlse=dlse)
    floor = default_floor(case.dtype)
    for name, g, r, lp in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), result["got"], ref64, lowp):
        assert g.dtype == (torch.float32 if name in ("lse", "dsinks") else case.dtype), f"{name}: dtype {g.dtype}"
        assert_close_to_reference(g.to(device), r, lp, default_floor(case.dtype, gradient=True) if name == "dsinks"
                                  else floor, name=name)


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.name for c in CPU_CASES])
def test_matches_reference(cpu_results, case):
    check_case(case, cpu_results[case.name])


def test_empty_pairs_are_skipped(cpu_results):
    """The narrow window needs only chunk pairs (i, i) and (i, i-1); the causal plan is the
    lower triangle; both as the ranks saw them."""
    n = 4
    window = cpu_results[Case(2, "narrow_window", 96).name]["plan"]
    ones = torch.ones(n, n, dtype=torch.bool)
    assert torch.equal(window, ones.tril() & ~ones.tril(-2))
    causal = cpu_results[Case(2, "causal", 96, with_dlse=True).name]["plan"]
    assert torch.equal(causal, torch.ones(n, n, dtype=torch.bool).tril())


BAD_INPUT = {
    "shard_length": ("ValueError", "multiple of 4"),
    "shard_seq_dim": ("ValueError", "seq_dim"),
    "unshard_odd": ("ValueError", "must be even"),
    "odd_local": ("ValueError", "even"),
    "q_k_lengths": ("ValueError", "q=48, k=46"),
    "mask_type": ("TypeError", "Tensor"),
    "mask_length": ("ValueError", "96"),
    "rank_3d": ("ValueError", "4-D"),
    "ranks_disagree": ("ValueError", "disagree on mask"),
    "layout_world_shard": ("ValueError", "layout is for 3 ranks"),
    "layout_world_unshard": ("ValueError", "layout is for 3 ranks"),
    "layout_world_attention": ("ValueError", "layout is for 3 ranks"),
    "layout_type": ("TypeError", "layout must be"),
    "layouts_disagree": ("ValueError", "disagree on layout"),
    "alibi": ("ValueError", "alibi_slopes must have shape (2,) or (1, 2)"),
    "sinks_shape": ("ValueError", "sinks must have shape (2,)"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUT))
def test_bad_input(cpu_results, name):
    kind, text = BAD_INPUT[name]
    got_kind, message = cpu_results["bad_input"][name]
    assert got_kind == kind and text in message, f"{name}: {got_kind}: {message}"


def test_shard_unshard(cpu_results):
    assert cpu_results["bad_input"]["roundtrip"]
    assert cpu_results["bad_input"]["unshard_grad"]


def test_shard_unshard_random_layouts(cpu_results):
    """Random layouts at W = 2 (the subgroup) and W = 4: a shard holds its chunks, and unshard
    puts them back."""
    assert cpu_results["bad_input"]["roundtrip_layouts"]
    assert cpu_results[f"roundtrip_layouts_W{CPU_WORLD}"]


def test_inference_path(cpu_results):
    """Under torch.no_grad fmd.attention keeps no graph; its output equals the autograd path's."""
    assert cpu_results["bad_input"]["no_grad_equal"]


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        fmd.shard(torch.zeros(1, 1, 8, 4))


# --- the plan, without processes -----------------------------------------------------------


@pytest.mark.parametrize("family", ["document", "sliding_window_bidir", "startend_bidir", "random_eviction"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_plan_is_exact(family, world):
    """pairs[i, j] is True iff some (batch, head, query of chunk i, key of chunk j) attends,
    from the dense mask written out here."""
    s = 120
    mask = make_mask(family, s, s, batch=2, heads=2)
    dense = mask.to_dense(s, s)
    dense = dense.reshape(-1, s, s) if dense.dim() == 4 else dense.unsqueeze(0)
    n, c = 2 * world, s // (2 * world)
    want = dense.reshape(-1, n, c, n, c).any(dim=(0, 2, 4))
    assert torch.equal(fmd.context_plan(mask, s, world).pairs, want)


def test_layout_checks_its_chunks():
    assert fmd.Layout(2, [[0, 3], [1, 2]]) == fmd.Layout.default(2)  # lists are taken, stored as tuples
    assert fmd.Layout.default(3).chunk_owner(4) == (1, 1)
    for world, chunks, text in ((2, ((0, 3),), "2 pairs"), (2, ((0, 3), (1, 1)), "each held once"),
                                (2, ((0, 3), (1, 4)), "each held once"), (2, ((0, 1, 2), (3,)), "2 pairs"),
                                (0, (), "positive"), (2, "0312", "2 pairs"), (2, None, "pairs of chunk")):
        with pytest.raises(ValueError, match=text):
            fmd.Layout(world, chunks)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_balanced_layout_of_causal_is_the_default(world):
    """Causal work grows with the chunk: heaviest with lightest is (r, 2W-1-r), today's layout."""
    s = 48 * world
    assert fmd.balanced_layout(masks.causal(), s, world) == fmd.Layout.default(world)
    assert fmd.balanced_layout(None, s, world).world == world  # full attention: any pairing is balanced


def test_chunk_work_counts_attending_pairs():
    s, world = 120, 3
    mask = make_mask("startend_bidir", s, s, batch=2, heads=2)
    dense = mask.to_dense(s, s)
    want = dense.reshape(-1, 2 * world, s // (2 * world), s).sum(dim=(0, 2, 3)).tolist()
    assert fmd.chunk_work(mask, s, world) == want


def _random_documents(s: int, gen: torch.Generator) -> masks.Mask:
    cuts = sorted(torch.randperm(s - 1, generator=gen)[: int(torch.randint(1, 8, (), generator=gen))].add(1).tolist())
    seqlens = [b - a for a, b in zip([0] + cuts, cuts + [s])]
    return masks.document(seqlens, causal=bool(torch.randint(0, 4, (), generator=gen)))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_balanced_layout_is_no_worse_and_optimal(world):
    """On random document masks the balanced layout's busiest rank never has more work than the
    default layout's; at W <= 3 it equals the best of every pairing (enumerated here)."""
    import itertools

    gen = torch.Generator().manual_seed(world)
    s = 24 * world
    better = 0
    for _ in range(30):
        mask = _random_documents(s, gen)
        work = fmd.chunk_work(mask, s, world)
        got = max(fmd.rank_work(work, fmd.balanced_layout(mask, s, world)))
        default = max(fmd.rank_work(work, fmd.Layout.default(world)))
        assert got <= default
        better += got < default
        if world <= 3:
            best = min(max(work[p[2 * i]] + work[p[2 * i + 1]] for i in range(world))
                       for p in itertools.permutations(range(2 * world)))
            assert got == best
    assert better > 0  # the documents do fall unevenly on the default chunks at times


def test_plan_traffic_follows_the_layout():
    """Causal over 2 ranks holding [0 | 1] and [2 | 3]: rank 1's queries need both of rank 0's
    chunks, rank 0's need none of rank 1's."""
    plan = fmd.context_plan(masks.causal(), 64, 2, layout=fmd.Layout(2, ((0, 1), (2, 3))))
    assert plan.transfers() == [(0, 1, 0), (0, 1, 1)]
    with pytest.raises(ValueError, match="layout is for 2 ranks"):
        fmd.context_plan(masks.causal(), 64, 4, layout=plan.layout)


def test_bytes_moved_counts_only_needed_chunks():
    """Causal over 2 ranks: rank 0 ([0 | 3]) needs chunks 1 and 2 of rank 1, rank 1 ([1 | 2])
    needs only chunk 0: three of the four chunks an all-gather would move."""
    plan = fmd.context_plan(masks.causal(), 64, 2)
    assert sorted(plan.transfers()) == [(0, 1, 0), (1, 0, 0), (1, 0, 1)]
    moved = plan.bytes_moved(batch=1, kv_heads=2, head_dim=8, dtype=BF16)
    chunk_bytes = 1 * 2 * 16 * 8 * 2
    assert moved["forward_bytes"] == 3 * 2 * chunk_bytes  # K and V
    assert moved["all_gather_forward_bytes"] == 4 * 2 * chunk_bytes


# --- GPU: NCCL on two and four devices ----------------------------------------------------


def gpu_cases(world: int) -> list[Case]:
    """One head dim (128, as in the benchmark, whose run then finds these kernels compiled)."""
    return [
        Case(world, "causal", 4096, hq=4, hkv=2, d=128, dtype=BF16, with_dlse=True),
        Case(world, "document_crossing", 4096, hq=4, hkv=2, d=128, dtype=BF16),
        Case(world, "narrow_window", 4096, hq=4, hkv=2, d=128, dtype=BF16),
        Case(world, "startend_bidir", 2048, b=2, hq=4, hkv=2, d=128, dtype=BF16),
        Case(world, "document_uneven", 4096, hq=4, hkv=2, d=128, dtype=BF16, chunks="balanced"),
        Case(world, "causal", 4096, hq=4, hkv=2, d=128, dtype=BF16, terms="alibi"),  # the Hopper kernels' ALiBi shift
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_nccl(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices, found {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cases = gpu_cases(world)
    results = _spawn(str(tmp_path), world, cases, "nccl", bad_input=False)
    failures = []
    for case in cases:
        try:
            check_case(case, results[case.name], device="cuda:0")
        except AssertionError as err:
            failures.append(f"{case.name}: {err}")
    assert not failures, "\n".join(failures)
