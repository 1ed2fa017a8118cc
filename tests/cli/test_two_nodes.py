"""``torchrun --nnodes 2`` with two agents on this host: the demo runs across both "nodes".

Each agent is a separate ``torch.distributed.run`` process with one worker (2 nodes x 1 process),
as on two machines; they meet through a c10d rendezvous at a store this test holds open on
127.0.0.1 (port 0: the kernel picks it as the store binds, so no other process can take it in
between, and both agents join as clients, ``is_host=0``). The workers' EP group is the whole
world, so every all-to-all of the MoE layer crosses the node boundary. Every process group the
test started is killed at the end, whatever happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest

pytestmark = pytest.mark.slow

TINY = ["--hidden", "64", "--layers", "1", "--experts", "4", "--tokens", "64", "--warmup", "0",
        "--prefill-threshold", "0", "--steps", "2", "--timeout", "60"]


def _agent(port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id", "asyncdbo-two-nodes",
            "--rdzv-conf", "is_host=0", "--max-restarts", "0",
            "-m", "asyncdbo", "demo", "--launcher", "env", *TINY]


@pytest.mark.timeout(600)
def test_the_demo_runs_across_two_torchrun_agents_with_a_c10d_rendezvous() -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    agents = [subprocess.Popen(_agent(store.port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True) for _ in range(2)]
    try:
        results = [agent.communicate(timeout=540) for agent in agents]
    finally:
        for agent in agents:
            try:
                os.killpg(agent.pid, signal.SIGKILL)  # the agent and its worker, stopped or not
            except ProcessLookupError:
                pass
            agent.communicate()
    codes = [agent.returncode for agent in agents]
    assert codes == [0, 0], results
    # rank 0 prints the table; it runs under whichever agent the rendezvous made node 0
    (table,) = [out for out, _ in results if "DBO steps:" in out]
    assert "DBO steps: microbatched, every step on every rank" in table, table
    assert "outputs serial vs DBO: max |logits diff| = 0 (bitwise equal; deterministic mode)" in table, table
