"""How evenly block owners share the optimizer's state and work (docs/parallelism.md).

The largest rank's share of the state bytes and of the step's flops against the mean (1.00
is perfect) under the data-parallel assignment (greedy over all blocks) and the sharded one
(owners among the rows' holders), with blocks costed by ``shape`` alone (``Σ d² + numel``,
or ``Σ d³ + numel`` for compute, whatever the kind), by what their ``kind`` holds and
computes (``BlockStack.assignment_cost``, ``step_flops``), and the ``bound`` a block's size
allows (``max(1, largest block / mean)``: a block is never split). Configurations: Shampoo
with Adam grafting, blocks of 1024, and the ``muon`` preset of ``make_optimizer``.

    python -m benchmarks.owner_balance --models resnet50 gpt2 --worlds 2 4 8
"""

from __future__ import annotations

from benchmarks.common import (
    SimulatedRank,
    arguments,
    build_model,
    hardware,
    simulated_sharded,
    table_head,
    table_row,
)
from hf_shampoo import DistributedShampoo, make_optimizer
from hf_shampoo.distributors import block_cost

CONFIGS = {
    "shampoo": lambda model: DistributedShampoo(
        model.parameters(), lr=1e-3, grafting="adam", max_preconditioner_dim=1024,
        precondition_frequency=100, distributed="none"),
    "muon": lambda model: make_optimizer(model, preset="muon", lr=1e-3, distributed="none"),
}


class ShapeCosted:
    """A distributor that ignores the kinds' costs (the shape-only rule)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def assign(self, blocks, block_shapes, costs=None, slots=None, units=None):
        rule = self.inner.assignment_cost
        return self.inner.assign(blocks, block_shapes,
                                 [block_cost(s, rule) for s in block_shapes], units=units)


def shares(model_name: str, config: str, world: int, scheme: str, rule: str,
           cost: str) -> tuple[float, float, float, float]:
    """(largest rank's state / mean, largest rank's flops / mean, and the bounds of
    both: the largest block's / mean, at least 1)."""
    model = build_model(model_name)
    opt = CONFIGS[config](model)
    for group in opt.param_groups:
        group["assignment_cost"] = cost
    opt.defaults["assignment_cost"] = cost
    if scheme == "ddp":
        distributor = SimulatedRank(world, 0, assignment_cost=cost)
    else:
        distributor = simulated_sharded(world)
        distributor.assignment_cost = cost
    opt.distributor = distributor if rule == "kind" else ShapeCosted(distributor)
    state, work = [0.0] * world, [0.0] * world
    largest = [0.0, 0.0]
    for row in opt.describe_blocks():
        one = (row["state_bytes"], row["step_flops"])
        state[row["rank"]] += one[0]
        work[row["rank"]] += one[1]
        largest = [max(a, b) for a, b in zip(largest, one)]
    state_mean, work_mean = sum(state) / world, sum(work) / world
    return (max(state) / state_mean, max(work) / work_mean,
            max(1.0, largest[0] / state_mean), max(1.0, largest[1] / work_mean))


def main() -> None:
    parser = arguments(__doc__, models=["resnet50", "gpt2"], worlds=[2, 4, 8])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    args = parser.parse_args()
    print(f"# Owner balance ({hardware()})\n")
    print("largest rank / mean; state with assignment_cost='memory', work (flops) with "
          "'compute'; 'shape' = blocks costed by shape alone (before), 'kind' = by what "
          "their kind holds and computes (now)\n")
    for model_name in args.models:
        for config in args.configs:
            print(f"### {model_name}, {config}\n")
            print(table_head("world", "scheme", "state: shape", "state: kind", "state: bound",
                             "work: shape", "work: kind", "work: bound"))
            for world in args.worlds:
                for scheme in ("ddp", "fsdp2"):
                    cells = []
                    for cost in ("memory", "compute"):
                        for rule in ("shape", "kind"):
                            s, w, s_bound, w_bound = shares(model_name, config, world, scheme,
                                                            rule, cost)
                            cells.append(s if cost == "memory" else w)
                        cells.append(s_bound if cost == "memory" else w_bound)
                    print(table_row(world, scheme, *(f"{c:.2f}" for c in cells)), flush=True)
            print()


if __name__ == "__main__":
    main()
