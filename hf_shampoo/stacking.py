"""Which blocks share a stack: the same calls everywhere (docs/design.md §4).

Same-kind blocks (one parameter group, one shape, device, working dtype and vector
settings) are stacked so that each operation of a step is one batched call. A batched
call's rounding may depend on what else is in the batch: which library, which CPU, which
GPU decide, and none of them promises otherwise. So a block's numbers are fixed by the
call it is computed in and its companions there, and ``chunks`` cuts each kind's blocks
into stacks by a rule that reads only the blocks, in layout order: never the world size,
a rank or a placement. One process, every world size, every layout and a resume at
another world size then compute every block in the same call beside the same blocks, and
owners get whole stacks (``Distributor.assign``'s ``units``).

The rule: a kind of ``n`` blocks of ``e`` elements each is cut, in layout order, into
``min(n, max(MIN_STACKS, ceil(n·e / STACK_ELEMENTS)))`` consecutive stacks whose sizes
differ by at most one (the larger first). ``MIN_STACKS`` lets a small model's kinds
spread over several ranks; ``STACK_ELEMENTS`` keeps one call's stack within a size that
already fills a device, so that a large model's kinds spread over many ranks.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

#: every kind is cut into at least this many stacks (fewer only with fewer blocks)
MIN_STACKS = 8
#: a stack holds at most this many elements of blocks, unless one block is larger
STACK_ELEMENTS = 1 << 24


def stack_count(blocks: int, block_elements: int) -> int:
    """How many stacks ``blocks`` same-kind blocks of ``block_elements`` each are cut into."""
    if blocks == 0:
        return 0
    by_size = math.ceil(blocks * max(block_elements, 1) / STACK_ELEMENTS)
    return min(blocks, max(MIN_STACKS, by_size))


def chunks(kinds: Sequence[Hashable], shapes: Sequence[tuple[int, ...]]) -> list[list[int]]:
    """The stacks of blocks ``0 .. len(kinds) - 1``, as lists of block indices: each
    kind's blocks in the given (layout) order, cut by the module's rule; kinds in the order
    of their first block."""
    by_kind: dict[Hashable, list[int]] = {}
    for index, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(index)
    out: list[list[int]] = []
    for members in by_kind.values():
        count = stack_count(len(members), math.prod(shapes[members[0]]))
        size, extra = divmod(len(members), count)
        start = 0
        for c in range(count):
            end = start + size + (c < extra)
            out.append(members[start:end])
            start = end
    return out
