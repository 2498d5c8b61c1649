"""Disassemble the Hopper forward for sm_90 without a GPU (Triton's bundled ptxas and nvdisasm)
and count, per instruction kind, what the consumer's PARTIAL-tile masking adds: the SASS is
what says where a PARTIAL tile's extra time goes (docs/performance.md).

    python -m tools.forward_sass --head-dim 64 --out /tmp/fwd64   # writes .cubin/.sass, prints counts
"""

from __future__ import annotations

import argparse
import collections
import os
import re

from .offline_compile import _hopper_forward, sass


def disassemble(head_dim: int, out: str) -> str:
    kernel = _hopper_forward(head_dim, 2, 1)
    with open(out + ".cubin", "wb") as f:
        f.write(kernel.asm["cubin"])
    listing = sass(kernel, line_info=True)
    with open(out + ".sass", "w") as f:
        f.write(listing)
    return listing


def masking_counts(listing: str) -> collections.Counter:
    """Opcodes of the instructions attributed to the masking helpers' source lines."""
    from flexmask.kernels.forward import hopper as forward_hopper

    helpers = _helper_lines("_row_bits", "_row_words", "_apply_row_words")
    module = os.path.join(*forward_hopper.__name__.split(".")) + ".py"  # flexmask/kernels/forward/hopper.py
    counts, in_mask = collections.Counter(), False
    for line in listing.splitlines():
        source = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if source:
            # by the module's path inside the package: a kernel from Triton's cache names the
            # checkout it was first compiled in
            in_mask = source.group(1).endswith(module) and int(source.group(2)) in helpers
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and in_mask:
            counts[m.group(2)] += 1
    return counts


def _helper_lines(*names: str) -> set[int]:
    from flexmask.kernels.forward import hopper as forward_hopper

    lines, path = set(), forward_hopper.__file__
    src = open(path).read().splitlines()
    for name in names:
        start = next(i for i, s in enumerate(src) if s.startswith(f"def {name}("))
        end = next((i for i in range(start + 1, len(src)) if src[i].startswith(("def ", "@"))), len(src))
        lines.update(range(start + 1, end + 1))
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--out", default="/tmp/forward_hopper")
    args = ap.parse_args(argv)
    counts = masking_counts(disassemble(args.head_dim, f"{args.out}_d{args.head_dim}"))
    print(f"forward_hopper D={args.head_dim}: SASS instructions on the masking helpers' lines (both consumer "
          f"warpgroups, every copy of the loop): {sum(counts.values())}")
    for op, n in counts.most_common():
        print(f"  {op:28s} {n}")


if __name__ == "__main__":
    main()
