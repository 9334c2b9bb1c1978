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
already fills a device, so that a large model's kinds spread over many ranks. That is
``stacking="balanced"``; ``stacking="fused"`` keeps each kind in one stack (``FUSED``), so
the calls a step makes do not grow with the model's depth. Both read only the blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

#: every kind is cut into at least this many stacks (fewer only with fewer blocks)
MIN_STACKS = 8
#: a stack holds at most this many elements of blocks, unless one block is larger
STACK_ELEMENTS = 1 << 24


#: the ``stacking`` keyword's value that keeps each kind in one stack
FUSED = "fused"


def stack_count(blocks: int, block_elements: int, fused: bool = False) -> int:
    """How many stacks ``blocks`` same-kind blocks of ``block_elements`` each are cut into
    (one where ``fused``)."""
    if blocks == 0:
        return 0
    if fused:
        return 1
    by_size = math.ceil(blocks * max(block_elements, 1) / STACK_ELEMENTS)
    return min(blocks, max(MIN_STACKS, by_size))


def chunks(kinds: Sequence[Hashable], shapes: Sequence[tuple[int, ...]],
           fused: Callable[[Hashable], bool] = lambda kind: False) -> list[list[int]]:
    """The stacks of blocks ``0 .. len(kinds) - 1``, as lists of block indices: each
    kind's blocks in the given (layout) order, cut by the module's rule (one stack for a
    kind where ``fused(kind)``); kinds in the order of their first block."""
    by_kind: dict[Hashable, list[int]] = {}
    for index, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(index)
    out: list[list[int]] = []
    for kind, members in by_kind.items():
        count = stack_count(len(members), math.prod(shapes[members[0]]), fused(kind))
        size, extra = divmod(len(members), count)
        start = 0
        for c in range(count):
            end = start + size + (c < extra)
            out.append(members[start:end])
            start = end
    return out
