"""Context parallelism (`flexmask.distributed`) against the dense reference.

The CPU cases run in ONE spawn of three gloo processes (spawning costs seconds per process
under the interpreter): the world-size-3 cases use the default group, the world-size-2 cases
a subgroup of ranks {0, 1} (so the `group` argument is exercised too). Rank 0 of each case
gathers the unsharded output, LSE and gradients and saves them; the tests here compare them
with autograd through `flexmask.reference` by the DESIGN.md section 4 rule. Bad input is
checked inside the same processes and reported back the same way.

The GPU test runs the same worker with NCCL on two CUDA devices (`nvidia-h200-x2`), in bf16
at a few thousand tokens.
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
    terms: bool = False  # softcap and sinks (score terms, DESIGN.md section 1): case_terms

    @property
    def name(self) -> str:
        extra = f"W{self.world}" + ("-dlse" if self.with_dlse else "") + ("-bshd" if self.layout == "bshd" else "")
        extra += "-softcap-sinks" if self.terms else ""
        return case_id(self.b, self.hq, self.hkv, self.s, None, self.d, self.dtype, self.family, extra)


def case_mask(case: Case) -> masks.Mask:
    s = case.s
    if case.family == "document_crossing":  # documents that straddle the chunk boundaries
        c = s // (2 * case.world)
        seqlens = [c - 8, c + 22, c - 10, s - 3 * c - 4]
        return masks.document(seqlens, causal=True)
    if case.family == "narrow_window":  # far chunk pairs are empty: skipped, never received
        return masks.sliding_window(s // (2 * case.world) - 18)
    if case.family == "empty_rows":  # the first query chunk (and a bit more) attends nothing
        return masks.column_intervals(torch.zeros(s, dtype=torch.int64), torch.full((s,), s // 3))
    return make_mask(case.family, s, s, batch=case.b, heads=case.hq)


def case_terms(case: Case, device="cpu") -> dict:
    """Soft-capping inside every chunk call, and sinks added once per row after the merge."""
    if not case.terms:
        return {}
    sinks = torch.randn(case.hq, generator=torch.Generator().manual_seed(3)).to(device)
    return {"softcap": 2.0, "sinks": sinks}


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
    Case(3, "causal", 144, with_dlse=True),
    Case(3, "document_crossing", 144),
    Case(3, "document_per_batch", 144, b=2),
    Case(2, "empty_rows", 96, with_dlse=True, terms=True),  # rows that see nothing: output 0, LSE = the sink
    Case(3, "causal", 144, terms=True),
]


# --- the worker: runs in every spawned process ----------------------------------------------


def _run_case(case: Case, group, device) -> dict | None:
    """fmd.attention on the shards, forward and backward; rank 0 returns the unsharded results."""
    mask = case_mask(case)
    q, k, v, do, dlse = case_inputs(case, device)
    if case.layout == "bshd":  # shard the (B, S, H, D) tensors along S and hand over (B, H, S, D) views
        ql, kl, vl = (fmd.shard(t.transpose(1, 2), group, seq_dim=1).detach().requires_grad_(True).transpose(1, 2)
                      for t in (q, k, v))
        ql.retain_grad(), kl.retain_grad(), vl.retain_grad()
    else:
        ql, kl, vl = (fmd.shard(t, group).detach().requires_grad_(True) for t in (q, k, v))
    terms = case_terms(case, device)
    if "sinks" in terms:
        terms["sinks"].requires_grad_(True)
    out, lse = fmd.attention(ql, kl, vl, mask, group, return_lse=True, **terms)
    loss = (out * fmd.shard(do, group)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * fmd.shard(dlse, group)).sum()
    loss.backward()
    got = [fmd.unshard(t.detach(), group) for t in (out, lse, ql.grad, kl.grad, vl.grad)]
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
    _expect_error(res, "alibi", lambda: fmd.attention(q, q, q, None, group, alibi_slopes=torch.ones(2)))
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
    return res


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
        if world > 2:
            groups[2] = dist.new_group([0, 1])  # every rank must create it
        results = {}
        for case in cases:  # an exception ends this process, and mp ends the others with its traceback
            if rank < case.world:
                results[case.name] = _run_case(case, groups[case.world], device)
        if bad_input and rank < 2:
            results["bad_input"] = _bad_input(groups[2], device)
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
    return _spawn(str(tmp_path_factory.mktemp("cp")), 3, CPU_CASES, "gloo", bad_input=True)


# --- checks -------------------------------------------------------------------------------


def reference_with_terms(q, k, v, mask, do, dlse, terms: dict, dtype):
    """(out, lse, dq, dk, dv, dsinks) by autograd through reference.attention with the score terms."""
    qr, kr, vr = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    sinks = terms["sinks"].detach().to(dtype).requires_grad_(True)
    out, lse = reference.attention(qr, kr, vr, mask, dtype=dtype, softcap=terms["softcap"], sinks=sinks)
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
    "ranks_disagree": ("ValueError", "disagree"),
    "alibi": ("ValueError", "alibi_slopes is not supported by flexmask.distributed.attention"),
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


def test_inference_path(cpu_results):
    """Under torch.no_grad fmd.attention keeps no graph; its output equals the autograd path's."""
    assert cpu_results["bad_input"]["no_grad_equal"]


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        fmd.shard(torch.zeros(1, 1, 8, 4))


# --- the plan, without processes -----------------------------------------------------------


@pytest.mark.parametrize("family", ["document", "sliding_window_bidir", "startend_bidir", "random_eviction"])
@pytest.mark.parametrize("world", [2, 3])
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


def test_bytes_moved_counts_only_needed_chunks():
    """Causal over 2 ranks: rank 0 ([0 | 3]) needs chunks 1 and 2 of rank 1, rank 1 ([1 | 2])
    needs only chunk 0: three of the four chunks an all-gather would move."""
    plan = fmd.context_plan(masks.causal(), 64, 2)
    assert sorted(plan.transfers()) == [(0, 1, 0), (1, 0, 0), (1, 0, 1)]
    moved = plan.bytes_moved(batch=1, kv_heads=2, head_dim=8, dtype=BF16)
    chunk_bytes = 1 * 2 * 16 * 8 * 2
    assert moved["forward_bytes"] == 3 * 2 * chunk_bytes  # K and V
    assert moved["all_gather_forward_bytes"] == 4 * 2 * chunk_bytes


# --- GPU: NCCL on two devices -------------------------------------------------------------

# one head dim (128, as in the benchmark, whose run then finds these kernels compiled)
GPU_CASES = [
    Case(2, "causal", 4096, hq=4, hkv=2, d=128, dtype=BF16, with_dlse=True),
    Case(2, "document_crossing", 4096, hq=4, hkv=2, d=128, dtype=BF16),
    Case(2, "narrow_window", 4096, hq=4, hkv=2, d=128, dtype=BF16),
    Case(2, "startend_bidir", 2048, b=2, hq=4, hkv=2, d=128, dtype=BF16),
]


@pytest.mark.gpu
def test_nccl_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    results = _spawn(str(tmp_path), 2, GPU_CASES, "nccl", bad_input=False)
    failures = []
    for case in GPU_CASES:
        try:
            check_case(case, results[case.name], device="cuda:0")
        except AssertionError as err:
            failures.append(f"{case.name}: {err}")
    assert not failures, "\n".join(failures)
