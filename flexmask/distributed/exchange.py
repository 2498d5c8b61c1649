"""Point-to-point traffic of the plan: K/V chunks to the ranks that need them (forward), their
dK/dV partials back to the owners (backward); one `batch_isend_irecv` each."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .plan import RankPlan


def p2p(ops: list) -> list:
    return dist.batch_isend_irecv(ops) if ops else []


def p2p_op(fn, tensor, peer: int, group, tag: int):
    return dist.P2POp(fn, tensor, group=group, group_peer=peer, tag=tag)


def halves_of(t: torch.Tensor, halves: list[int], c: int) -> torch.Tensor:
    """The given halves (contiguous in the shard when both are asked for) along dim 2."""
    if halves == [0, 1]:
        return t
    return t.narrow(2, halves[0] * c, c)


def post_kv_exchange(k, v, rp: RankPlan, group):
    """Posts this rank's K/V sends and receives; returns (received {peer: (k, v)}, works)."""
    c = rp.plan.chunk_len
    b, h, _, d = k.shape
    ops, received, keep = [], {}, []
    for peer, halves in rp.recv_halves.items():
        kr = k.new_empty(b, h, len(halves) * c, d)
        vr = v.new_empty(b, h, len(halves) * c, d)
        received[peer] = (kr, vr)
        ops += [p2p_op(dist.irecv, kr, peer, group, 0), p2p_op(dist.irecv, vr, peer, group, 1)]
    for peer, halves in rp.send_halves.items():
        ks, vs = (halves_of(t, halves, c).contiguous() for t in (k, v))
        keep += [ks, vs]  # alive until the sends complete
        ops += [p2p_op(dist.isend, ks, peer, group, 0), p2p_op(dist.isend, vs, peer, group, 1)]
    return received, (p2p(ops), keep)


def wait(works) -> None:
    for w in works[0]:
        w.wait()


def post_grad_exchange(dkv_peer: dict, k: torch.Tensor, rp: RankPlan, group, dtype: torch.dtype):
    """Posts the backward's traffic: the partial dK/dV of borrowed chunks (`dkv_peer`, {peer: (dk,
    dv)} in the layout they were received in) back to their owners, and receives the partials
    of this rank's chunks from the peers that used them. Returns ({peer: (dk, dv)}, works)."""
    c = rp.plan.chunk_len
    ops, incoming = [], {}
    for peer, halves in rp.send_halves.items():
        shape = (k.shape[0], k.shape[1], len(halves) * c, k.shape[3])
        incoming[peer] = tuple(torch.empty(shape, dtype=dtype, device=k.device) for _ in range(2))
        ops += [p2p_op(dist.irecv, incoming[peer][0], peer, group, 2), p2p_op(dist.irecv, incoming[peer][1], peer, group, 3)]
    for peer, (gk, gv) in dkv_peer.items():
        ops += [p2p_op(dist.isend, gk, peer, group, 2), p2p_op(dist.isend, gv, peer, group, 3)]
    return incoming, (p2p(ops), None)
