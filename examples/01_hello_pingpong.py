"""Hello, DBO: two ubatches take turns at their yield points on one thread.

Run: python examples/01_hello_pingpong.py

Each ubatch is the same ``async def``; ``await dbo_yield(tag)`` hands the CPU to the next ubatch
in the ring. The printed lines show the strict round-robin order the scheduler guarantees, and
the results come back in ubatch order. Outside a DBO run the same function runs straight through.
"""

from __future__ import annotations

import asyncdbo
from asyncdbo import dbo_current_ubatch_id, dbo_num_ubatches, dbo_yield


async def layer_stack(name: str, num_layers: int) -> str:
    for layer in range(num_layers):
        print(f"  ubatch {dbo_current_ubatch_id()} of {dbo_num_ubatches()} ({name}): layer {layer}")
        await dbo_yield(f"layer{layer}")
    return f"{name} done"


async def main() -> list[str]:
    return await asyncdbo.run_ubatches(layer_stack, [("ping", 3), ("pong", 3)])


if __name__ == "__main__":
    print("plain call (no DBO run, every primitive is a no-op):")
    print("  ->", asyncdbo.run(layer_stack, "solo", 2))
    print("two ubatches under the DBO loop:")
    results = asyncdbo.run(main)
    print("  ->", results)
    assert results == ["ping done", "pong done"]
