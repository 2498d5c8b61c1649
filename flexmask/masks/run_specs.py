"""Builders of masks whose key columns need more than FlashMask's two masked intervals (k runs per
column, DESIGN.md 2.1): 2-D / 3-D neighbourhood attention, sliding tile attention, global tokens
anywhere in the sequence, dilated windows per head (attention-gym's mask examples). Their runs are computed from the
parameters in O(runs x kv_len) by `run_builders.py`; the kernels read them in partial tiles only.

Pictures: rows are queries, columns are keys, ``#`` attends, ``.`` is masked.
"""

from __future__ import annotations

from .run_bounds import MAX_RUNS_LIMIT, dilated_steps, global_groups
from .specs import Mask, _check_int, _check_one_list, _Simple

__all__ = ["natten", "sliding_tile", "global_tokens", "dilated_sliding_window"]

GLOBAL_GROUPS_BUILT = 4 * MAX_RUNS_LIMIT  # global_tokens' most runs a column, before a composition cuts them


def _pair(name: str, value) -> list:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be an int or a pair (rows, columns), got {value!r}")
        return [_check_int(f"{name}[0]", value[0], 1), _check_int(f"{name}[1]", value[1], 1)]
    v = _check_int(name, value, 1)
    return [v, v]


def natten(height: int, width: int, kernel, dilation=1, *, frames: int = 1, time_kernel: int = 1,
           time_dilation: int = 1) -> Mask:
    """Neighbourhood attention (NATTEN) over an image of height x width tokens in row-major order
    (token = row * width + column), or a video of ``frames`` such images (token = (frame * height
    + row) * width + column): query (f, r, c) attends the ``time_kernel x kernel x kernel`` keys
    around it. As in NATTEN, the window is clamped at the borders (a query near an edge keeps a
    whole window, shifted inwards) and ``dilation`` d spaces its keys d apart (the axis splits
    into d interleaved grids, each with its own clamped windows). ``kernel`` and ``dilation`` may
    be pairs (rows, columns); ``kernel x dilation`` must fit each axis, as in NATTEN. Within a
    sub-grid of m coordinates the window of coordinate b starts at clamp(b - kernel // 2, 0,
    m - kernel) (NATTEN's rule for odd kernels; an even kernel reaches one further back).
    kv_len must be frames x height x width; with q_len < kv_len the queries are the last tokens.
    ::
        natten(4, 4, kernel=3): 16 tokens; query (0, 0) = token 0 sees rows 0-2, columns 0-2
        ###.###.###.....
        ###.###.###.....
        .###.###.###....
        .###.###.###....
        ###.###.###.....
        ###.###.###.....
        .###.###.###....
        .###.###.###....
        ....###.###.###.
        ....###.###.###.
        .....###.###.###
        .....###.###.###
        ....###.###.###.
        ....###.###.###.
        .....###.###.###
        .....###.###.###

    Runs: key (f, r, c) is attended by a run of query tokens per attending frame and row, and per
    attending column too when the columns are dilated, so its column masks one run more; along an
    axis a key is held by up to kernel + kernel // 2 windows (all of a sub-grid of at most 2 kernel
    - 1 coordinates). A column holds at most 16 masked runs: a 2-D kernel up to 10 without
    dilation fits an image of at most 15 or at least 2 x kernel rows (kernel 9 on 16 or 17 rows
    needs 18). Past that an undilated natten is compiled as two pieces, the query rows up to the
    key's image row and past it (masks/natten_pieces.py: a 2-D kernel up to 15 fits any image),
    which flexmask.attention runs and merges by their LSEs; video windows of several frames fit
    only small grids (a ValueError names the column). A dilated natten in self-attention is compiled in its sub-image order
    (masks/natten_order.py: the tokens of each interleaved sub-image together, plain NATTEN on
    each), where it needs the runs of the same kernel undilated; where its own order needs more
    than 16 (each attending column of dilated columns is a run of its own: a 3 x 3 kernel with
    dilation (1, 2) needs 17 on a 30 x 30 image), that order is its only one: flexmask.attention
    takes it, without ALiBi (to_dense and show draw its own runs, as many as they are).
    """
    h = _check_int("height", height, 1)
    w = _check_int("width", width, 1)
    k, d = _pair("kernel", kernel), _pair("dilation", dilation)
    t = _check_int("frames", frames, 1)
    tk = _check_int("time_kernel", time_kernel, 1)
    td = _check_int("time_dilation", time_dilation, 1)
    for axis, n, kk, dd in (("height", h, k[0], d[0]), ("width", w, k[1], d[1]), ("frames", t, tk, td)):
        if kk * dd > n:
            raise ValueError(f"natten: kernel x dilation = {kk} x {dd} does not fit {axis}={n}")
    return _Simple("natten", height=h, width=w, kernel=k, dilation=d, frames=t, time_kernel=tk, time_dilation=td)


def _shape(name: str, value, rank: int | None = None) -> list:
    """A (height, width) or (frames, height, width) tuple of positive ints."""
    if not isinstance(value, (tuple, list)) or len(value) not in (2, 3) or (rank is not None and len(value) != rank):
        want = f"{rank} positive ints" if rank else "(height, width) or (frames, height, width)"
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return [_check_int(f"{name}[{i}]", v, 1) for i, v in enumerate(value)]


def sliding_tile(canvas, kernel, tile, *, text_tokens: int = 0) -> Mask:
    """Sliding tile attention (STA, as FastVideo runs video diffusion models; attention-gym's
    `sta` masks): the tokens of an image ``canvas = (height, width)`` or a video ``(frames, height,
    width)`` come in tile-major order, ``tile`` tokens per tile (each axis of the canvas a multiple of
    its tile; token = tile index x tile size + its place in the tile, tiles in row-major order), and
    every query tile attends the box of ``kernel // tile`` tiles per axis around it, clamped at the
    borders as NATTEN clamps a window (a tile near an edge keeps a whole box, shifted inwards; an even
    box reaches one tile further back). ``kernel`` is in tokens, a multiple of the tile and at most
    the canvas on each axis. The ``text_tokens`` after the vision tokens are attended by every query
    and attend every vision and text key, as do the queries past them; keys past both (padding) are
    attended by none. kv_len must
    be at least the vision tokens plus ``text_tokens``; with q_len < kv_len the queries are the last
    tokens (DESIGN.md 2.3).
    ::
        sliding_tile((1, 8), kernel=(1, 4), tile=(1, 2), text_tokens=2): four tiles of two tokens in a
        row, boxes of two tiles (tile 0's box shifted inwards to tiles 0-1, tile 2's reaching back
        to tiles 1-2), the last two tokens text
        ####....##
        ####....##
        ####....##
        ####....##
        ..####..##
        ..####..##
        ....######
        ....######
        ##########
        ##########

    Runs: a vision key is attended by up to min(n, k + k // 2) tile rows of each of the frame and
    height axes (k the box in tiles, n the canvas in tiles), each a run of tiles along the width,
    and by the text rows: its column masks up to that product plus one runs. A column holds at most
    16: 2-D boxes of up to 9 tile rows fit any canvas; video boxes of 3 x 3 tiles and more fit only
    where the canvas is few tiles deep (a ValueError names the column).
    """
    c = _shape("canvas", canvas)
    k, t = _shape("kernel", kernel, len(c)), _shape("tile", tile, len(c))
    text = _check_int("text_tokens", text_tokens, 0)
    for axis, (n, kk, tt) in enumerate(zip(c, k, t)):
        if n % tt or kk % tt:
            raise ValueError(f"sliding_tile: axis {axis} needs canvas and kernel multiples of the tile, got canvas "
                             f"{n}, kernel {kk}, tile {tt}")
        if kk > n:
            raise ValueError(f"sliding_tile: the kernel ({kk}) must fit the canvas ({n}) on axis {axis}")
    if len(c) == 2:  # an image: a video of one frame
        c, k, t = [1] + c, [1] + k, [1] + t
    return _Simple("sliding_tile", canvas=c, kernel=k, tile=t, text_tokens=text)


def global_tokens(positions) -> Mask:
    """Global tokens anywhere in the sequence (Longformer, BigBird): the tokens at ``positions``
    attend every key and are attended by every query; the others attend only the global keys.
    Compose it with a local pattern by ``|``: ``sliding_window(w, w) | global_tokens([...])``.
    Positions are absolute (DESIGN.md 2.3: query row i sits at i + kv_len - q_len), each < kv_len.
    ::
        sliding_window(1, 1) | global_tokens([3]), q_len = kv_len = 7
        ##.#...
        ####...
        .###...
        #######
        ...###.
        ...####
        ...#.##

    Runs: a key column that is not global is masked on every row but those of the global tokens
    (and, composed, its window), so it needs one masked run more than there are groups of
    consecutive global tokens around it: up to 15 groups (14 beside a window) fit a column's 16
    runs, however many tokens each holds (32 sink tokens at the front are one group). As for any
    composition, only the final mask must fit: one that needs more raises naming the column.
    """
    pos = _check_one_list("positions", positions, 0)
    pos = sorted(set(pos))
    groups = len(global_groups(pos)[0])
    # a composition may cut a column's runs, so more than 16 are built; past this many the final mask
    # cannot fit beside a local pattern, and its runs would take (groups + 1) x kv_len memory first
    if groups + 1 > GLOBAL_GROUPS_BUILT:
        raise ValueError(f"global_tokens: {len(pos)} global tokens in {groups} groups of consecutive positions need "
                         f"{groups + 1} masked runs in a key column, more than the {GLOBAL_GROUPS_BUILT} built (a mask "
                         f"holds max_runs={MAX_RUNS_LIMIT} in the end)")
    return _Simple("global_tokens", positions=pos)


def dilated_sliding_window(left: int, dilation) -> Mask:
    """A causal window of ``left`` positions that keeps every d-th key (attention-gym's dilated
    sliding window): the query at position p attends key j iff ``0 <= p - j <= left`` and
    ``(p - j) % d == 0``. ``dilation`` is one int, or a list with one d per head (a strided
    pattern per head: H must then be Hq or Hkv at the call).
    ::
        left=4, dilation=2                      dilation=[1, 3] (two heads)
        #.....                                  head 0    head 1
        .#....                                  #.....    #.....
        #.#...                                  ##....    .#....
        .#.#..                                  ###...    ..#...
        #.#.#.                                  ####..    #..#..
        .#.#.#                                  #####.    .#..#.
                                                .#####    ..#..#

    Runs: a key column is attended by left // d + 1 rows, so it masks up to left // d + 2 runs
    (at most 16: left // d <= 14); a dilation of 1 is a plain window, two runs whatever ``left``.
    """
    left = _check_int("left", left, 0)
    if isinstance(dilation, (list, tuple)):
        d = [_check_int(f"dilation[{h}]", v, 1) for h, v in enumerate(dilation)]
        if not d:
            raise ValueError("dilation must be an int or a non-empty list of ints, one per head")
    else:
        d = _check_int("dilation", dilation, 1)
    most = max(dilated_steps(left, v) for v in (d if isinstance(d, list) else [d])) + 1
    if most > MAX_RUNS_LIMIT:
        raise ValueError(f"dilated_sliding_window(left={left}, dilation={dilation}) needs up to {most} masked runs in a "
                         f"key column, more than max_runs={MAX_RUNS_LIMIT}: keep left // dilation <= {MAX_RUNS_LIMIT - 2}")
    return _Simple("dilated_sliding_window", left=left, dilation=d)
