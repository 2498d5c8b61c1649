"""Dilated NATTEN (DiNAT) in its sub-image order: the token order in which `natten(..., dilation)`
is block-diagonal plain NATTEN.

A dilation d on an axis splits it into d interleaved sub-grids, and a query attends keys of its
own sub-grid only (run_specs.natten). In row-major order a key is then attended by a run of
queries per attending row and, with the columns dilated, per attending column: a 7 x 7 kernel
dilated (2, 2) gives a key up to 10 x 10 runs, past the 16 a column holds (DESIGN.md 2.1). Taken
sub-image by sub-image (the tokens of one residue (frame % td, row % dr, column % dc) together, in
row-major order of their sub-grid coordinates), each sub-image is plain NATTEN of the same kernel
on its smaller grid, and a key's column masks every row outside its sub-image: one run more than
plain NATTEN's, the same bound as an undilated natten. NATTEN itself runs dilation the same way.

`compile_mask` builds these tables for a self-attention dilated natten: as its only tables where
the tokens' own order needs more runs than a column holds, else beside the natural ones where
they visit fewer tiles (from token_order.MIN_TOKENS tokens, as for global tokens);
`flexmask.attention` gathers q, k and v into the order and the output, LSE and gradients back.

    natten(4, 6, 3, dilation=(1, 2)), 24 tokens    in the sub-image order: the even columns'
                                                    tokens 0 2 4 ... 22 first (a 4 x 3 image),
        #.#.#.#.#.#.#.#.#.......                    then the odd ones', each plain 3 x 3 NATTEN
        .#.#.#.#.#.#.#.#.#......                    #########...............
        (rows 2-11 as rows 0-1)                     (rows 1-5 as row 0)
        ......#.#.#.#.#.#.#.#.#.                    ...#########............
        .......#.#.#.#.#.#.#.#.#                    (rows 7-11 as row 6)
        (rows 14-23 as rows 12-13)                  ............#########...
                                                    (rows 13-17 as row 12)
                                                    ...............#########
                                                    (rows 19-23 as row 18)
"""

from __future__ import annotations

import numpy as np
import torch

from . import specs
from .geometry import _Geometry, to_device
from .run_bounds import MAX_RUNS_LIMIT, max_runs
from .run_builders import is_dilated_natten, natten_runs, natten_tokens

__all__ = ["is_dilated_natten", "natural_may_not_fit", "subimage_order", "reordered"]


def natural_may_not_fit(mask) -> bool:
    """Whether the natten's runs in the tokens' own order may pass the most a column holds (its
    bound from the parameters; where it does, the count decides)."""
    return max_runs(mask) > MAX_RUNS_LIMIT


def _axes(p: dict) -> list[tuple[int, int]]:
    """(length, dilation) of the (time, row, column) axes."""
    return [(p["frames"], p["time_dilation"]), (p["height"], p["dilation"][0]), (p["width"], p["dilation"][1])]


def _sub_grid_sizes(n: int, d: int) -> np.ndarray:
    """The lengths [d] of the d interleaved sub-grids of an axis of n (residue r: y = r, r + d, ...)."""
    r = np.arange(d)
    return (n - r + d - 1) // d


def _groups(p: dict) -> tuple[np.ndarray, np.ndarray]:
    """The sub-images in their order (residues (rt, rr, rc) lexicographic): their sub-grid shapes
    [G, 3] and first reordered index [G]."""
    sizes = [_sub_grid_sizes(n, d) for n, d in _axes(p)]
    shapes = np.stack(np.meshgrid(*sizes, indexing="ij"), -1).reshape(-1, 3)
    tokens = shapes.prod(1)
    first = np.concatenate([[0], np.cumsum(tokens)[:-1]])
    return shapes, first


def subimage_order(p: dict, device, groups: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse), int64 [tokens] on `device`: order[i] is the token at reordered index i;
    inverse[order[i]] = i. Made on the host (numpy, O(tokens)) and uploaded once (`groups`:
    `_groups(p)`, where made already)."""
    (t, td), (h, dr), (w, dc) = _axes(p)
    shapes, first = _groups(p) if groups is None else groups
    ft, fr, fc = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    group = ((ft % td) * dr + fr % dr) * dc + fc % dc
    grid_h, grid_w = shapes[group, 1], shapes[group, 2]
    inverse = first[group] + ((ft // td) * grid_h + fr // dr) * grid_w + fc // dc
    inverse = inverse.reshape(-1).astype(np.int64)
    order = np.empty_like(inverse)
    order[inverse] = np.arange(inverse.size)
    order, inverse = to_device(np.concatenate([order, inverse]), torch.device(device)).split(inverse.size)
    return order, inverse


def reordered(mask, seq_len: int, device) -> tuple[specs.Mask, torch.Tensor, torch.Tensor]:
    """(the dilated natten `mask` in its sub-image order as column runs, order, inverse) for
    self-attention over its tokens (`seq_len` of them). Each key's column masks the rows before
    and after its sub-image and plain NATTEN's runs inside it; the sub-images of one shape share
    those runs (at most 2 x 2 x 2 shapes), computed once."""
    p = mask.params()
    natten_tokens(p, seq_len)
    device = torch.device(device)
    shapes, first = _groups(p)
    distinct, shape_of = np.unique(shapes, axis=0, return_inverse=True)
    shape_of = shape_of.reshape(-1)
    tables, table_first = [], []  # per distinct shape: plain NATTEN's runs [tokens, K, 2], sub-image local
    at = 0
    for ft, fh, fw in distinct.tolist():
        plain = dict(p, frames=ft, height=fh, width=fw, dilation=[1, 1], time_dilation=1)
        size = ft * fh * fw
        tables.append(natten_runs(plain, _Geometry(size, size, device))[0, 0])
        table_first.append(at)
        at += size
    most = max(t.shape[1] for t in tables)
    table = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, most - t.shape[1])) for t in tables])  # (0, 0): empty
    # per reordered column: its row of `table`, its sub-image's first index and length (host, uploaded once)
    sizes = shapes.prod(1)
    group = np.repeat(np.arange(len(shapes)), sizes)
    local = np.arange(seq_len) - first[group]
    row = np.asarray(table_first)[shape_of[group]] + local
    row, start, length = to_device(np.concatenate([row, first[group], sizes[group]]), device).split(seq_len)
    runs = table[row]  # [seq_len, K, 2] local rows
    start, length = start[:, None], length[:, None]
    # local row 0 opens the rows before the sub-image, its end closes the rows after it; both are masked
    s = torch.where(runs[..., 0] == 0, 0, runs[..., 0] + start)
    e = torch.where(runs[..., 1] == length, seq_len, runs[..., 1] + start)
    return (specs.column_runs(s[None, None], e[None, None]), *subimage_order(p, device, (shapes, first)))
