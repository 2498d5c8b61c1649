"""Merging partial attention results (each over a subset of the keys) by their log-sum-exp,
and its gradient: context parallel's chunks (distributed/), a mask computed in pieces (api)."""

from __future__ import annotations

import torch


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]):
    """(out, lse, weights) of the union of key sets from per-set (out_i, lse_i): lse =
    logsumexp_i lse_i, out = sum_i w_i out_i with w_i = exp(lse_i - lse). Rows that see nothing
    (every lse_i = -inf) give out 0, lse -inf, weights 0."""
    if len(outs) == 1:
        return outs[0], lses[0], None
    stack = torch.stack(lses)  # [n, B, H, C]
    lse = torch.logsumexp(stack, dim=0)
    weights = torch.exp(stack - torch.where(torch.isfinite(lse), lse, 0.0))  # 0 where lse_i = -inf
    # summed in the partials' memory order, so that out keeps their layout (a (B, S, H, D) view's)
    order = sorted(range(outs[0].dim()), key=lambda i: -outs[0].stride(i))
    out = sum(o.permute(order).float() * w.unsqueeze(-1).permute(order) for w, o in zip(weights, outs))
    return out.permute([order.index(i) for i in range(len(order))]).to(outs[0].dtype), lse, weights


def merge_backward(dout, dlse, outs, weights, dtype):
    """Per partial (d out_i, d lse_i) from (d out, d lse): out_i gets w_i * dout, and
    lse_i gets w_i * (dout . (out_i - out) + dlse). d lse_i uses the rounded w_i * dout the
    partial's backward will see, so its D = rowsum(dout_i * out_i) - dlse_i is exactly
    w_i * (dout . out - dlse)."""
    if weights is None:
        return [(dout, dlse)]
    merged = sum(w.unsqueeze(-1) * o.float() for w, o in zip(weights, outs))
    common = (dout.float() * merged).sum(-1) if dout is not None else 0.0
    if dlse is not None:
        common = common - dlse
    grads = []
    for w, o in zip(weights, outs):
        if dout is None:
            do_i = torch.zeros_like(o)
            dl_i = -w * common
        else:
            do_i = (w.unsqueeze(-1) * dout.float()).to(dtype)
            dl_i = (do_i.float() * o.float()).sum(-1) - w * common
        grads.append((do_i, dl_i))
    return grads


class MergeByLse(torch.autograd.Function):
    """`merge` of n partial (out_i, lse_i) as an autograd function, (out, lse), whose backward is
    `merge_backward`: each partial's own op then takes its (d out_i, d lse_i)."""

    @staticmethod
    def forward(ctx, *parts):
        n = len(parts) // 2
        outs, lses = list(parts[:n]), list(parts[n:])
        out, lse, weights = merge(outs, lses)
        ctx.save_for_backward(*outs, weights)
        ctx.dtype = outs[0].dtype
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        *outs, weights = ctx.saved_tensors
        grads = merge_backward(dout, dlse, outs, weights, ctx.dtype)
        return (*(g[0] for g in grads), *(g[1] for g in grads))
