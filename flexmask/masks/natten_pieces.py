"""NATTEN past the runs a column holds, as two pieces: the query rows up to the key's image row,
and those past it.

In row-major order a key of a 2-D NATTEN is attended by one run of query tokens per attending
row: up to kernel + kernel // 2 rows on a large image (all of them on one of at most 2 kernel - 1
rows), so a 13 x 13 kernel on a 128 x 128 image needs 20 masked runs a column, past the 16 a
column holds (DESIGN.md 2.1). Cut each column at its key's image row: queries in rows up to the
key's (in any frame) form one piece, those in rows past it the other. Each is the same natten with
part of its attending rows, within the runs a column holds (13 x 13: 14 and 13, at the borders),
and the two are disjoint and cover the mask, so the attention over the mask is the two attentions
merged by their log-sum-exps (`flexmask.lse_merge`), as context parallel merges its chunks:

    natten(8, 1, (5, 1)), 8 tokens        piece "up_to_key"      piece "past_key"
    #####...                              #####...               ........
    #####...                              .####...               #.......
    #####...                              ..###...               ##......
    .#####..                              ...###..               .##.....
    ..#####.                              ....###.               ..##....
    ...#####                              .....###               ...##...
    ...#####                              ......##               ...###..
    ...#####                              .......#               ...####.

On an image whose width is a multiple of a tile's query rows, the pieces share no tile: the work is
the mask's own. A video's pieces keep all the attending frames: one whose frames times rows pass
the runs in a piece too raises TooManyRuns. `compile_mask` compiles both for a natten whose bound
passes the most runs a column holds; `flexmask.attention` runs each and merges them.
"""

from __future__ import annotations

from .run_bounds import MAX_RUNS_LIMIT, max_runs
from .run_builders import is_dilated_natten
from .specs import Mask, _Simple

SIDES = ("up_to_key", "past_key")  # query rows up to the key's image row, and past it


def needs_pieces(mask) -> bool:
    """Whether `mask` is one undilated natten whose columns may need more runs than a column holds
    (by the bound from its parameters: no runs built to count them)."""
    if getattr(mask, "kind", None) != "natten" or is_dilated_natten(mask):
        return False
    return "query_rows" not in mask.params() and max_runs(mask) > MAX_RUNS_LIMIT


def pieces(mask: Mask) -> tuple[Mask, Mask] | None:
    """The two natten specs whose union is `mask`, or None where it needs none (`needs_pieces`):
    the answer kept on the spec, so that every call finds the same two (and their compiled
    tables) without asking the bound again."""
    found = mask.__dict__.get("_pieces")
    if found is None:
        found = (tuple(_Simple("natten", **mask.params(), query_rows=side) for side in SIDES)
                 if needs_pieces(mask) else ())
        mask.__dict__["_pieces"] = found
    return found or None
