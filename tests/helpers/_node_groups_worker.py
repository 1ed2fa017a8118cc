"""One rank of a ``torchrun --nnodes 2 --nproc-per-node 2`` job (tests/cli/test_two_nodes.py).

It builds the two EP layouts a cluster uses, with torch's own helpers, and runs the MoE layer on
each, serial and DBO: node-local EP groups (``new_subgroups`` of the local world size: EP inside
a node, DP across nodes) and cross-node EP groups (one rank of each node per group). Rank 0
prints one ``RESULT`` line of JSON with every rank's view: the members of each group, the nodes
they sit on (torchrun's ``GROUP_RANK`` of each member), the layer's EP size and rank, and whether
three DBO steps equal the serial one bitwise.

Legend (shape suffixes): T tokens on this rank, D hidden.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import asyncdbo
from asyncdbo.dist import destroy_process_groups
from asyncdbo.moe import MoEConfig, MoELayer


def layout_result(group: Any, nodes: list[int], rank: int) -> dict[str, Any]:
    members = dist.get_process_group_ranks(group)
    cfg = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2)
    layer = MoELayer(cfg, ep_group=group, seed=7)  # makes the group's per-ubatch clones: every member at once
    x_TD = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(rank))
    ref_TD = asyncdbo.run(layer, x_TD)

    async def dbo() -> list[torch.Tensor]:
        return await asyncdbo.run_ubatches(layer, [(x_TD[:5],), (x_TD[5:],)], backend="host")

    equal = [torch.equal(torch.cat(asyncdbo.run(dbo)), ref_TD) for _ in range(3)]
    return {"members": members, "nodes": sorted({nodes[r] for r in members}),
            "ep": [layer.comm.size, layer.comm.rank], "equal": equal}


def main() -> None:
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, int(os.environ["GROUP_RANK"]))
    # torchrun numbers ranks node by node, so torch's intra-node helper cuts them by the local size
    node_local, _ = dist.new_subgroups(group_size=local)
    cross, _ = dist.new_subgroups_by_enumeration([list(range(i, world, local)) for i in range(local)])
    mine = {name: layout_result(group, nodes, rank) for name, group in (("node-local", node_local), ("cross-node", cross))}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    destroy_process_groups()


if __name__ == "__main__":
    main()
