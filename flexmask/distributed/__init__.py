"""Context parallelism over `torch.distributed`: masked attention over a sequence sharded on
several ranks (GPUs with NCCL, CPU processes with gloo).

Layout (load-balanced, as in DESIGN.md section 1): with W ranks the sequence is cut into 2W
chunks of C = S / (2W) tokens, and rank r holds chunks r and 2W-1-r, one after the other::

    W = 2, chunks 0 1 2 3:   rank 0 holds [0 | 3], rank 1 holds [1 | 2]

so that causal-like masks, whose work grows with the query position, give every rank the same
work. `shard` cuts a global tensor into this layout, `unshard` gathers it back. Other pairings
of the 2W chunks are a `Layout` (rank r holds chunks[r]); `balanced_layout(mask, S, W)` pairs
them by the work the mask gives each chunk (documents that fall unevenly on the chunks), and
`shard`, `attention` and `unshard` take it as ``layout=`` (the same on every call and rank).

`attention` runs the plan of a mask, built once per (mask, S, W, rank, device, layout) and cached on
the mask object:
  - the (query chunk, key chunk) pairs that the mask leaves empty are found from its column
    intervals (a column empties the rectangle when one masked interval covers all its rows)
    and are never computed, and a rank receives only the key/value chunks that its queries need;
  - each rank posts one batch of point-to-point sends/receives (``batch_isend_irecv``) for the
    K/V chunks its peers need, computes with its own keys while they travel, then with each
    received block. Each call is `flexmask.attention` on one local query chunk and the key
    chunks of one owner, with the exact sub-mask (the global column intervals restricted to
    those rows and columns, passed as explicit `masks.column_intervals`);
  - the partial results of a query chunk are merged by their log-sum-exp (rows that see
    nothing give 0 and LSE -inf).
Backward: the merge is differentiated by hand, each partial call by autograd (its op takes the
gradient of the LSE too); dQ stays local, and the dK/dV of received chunks are computed first
and sent back to their owners while the local backward runs.

Modules: layout (Layout, shard/unshard), balance (balanced_layout), plan (pairs, sub-masks, cache),
exchange (point-to-point traffic), merge (LSE merge and its gradient), context_attention (forward/backward, the public call).
"""

from __future__ import annotations

from .balance import balanced_layout, chunk_work, rank_work
from .context_attention import attention
from .layout import Layout, chunk_owner, rank_chunks, shard, unshard
from .plan import ContextPlan, context_plan

__all__ = ["shard", "unshard", "attention", "Layout", "balanced_layout", "chunk_work", "rank_work",
           "ContextPlan", "context_plan", "chunk_owner", "rank_chunks"]
