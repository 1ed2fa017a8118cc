"""``torchrun --nnodes 2`` with two agents on this host: the serving example runs across both
"nodes", the EP layer runs on node-local and on cross-node groups (DBO bitwise equal to serial on
each), and a lost node ends the other's rank, stopped inside the demo's DBO step, with an error
naming it. (The demo's own bitwise table under torchrun is tested in tests/cli/test_demo.py; across
two agents it would add only the start-up of four more processes.)

Each agent is a separate ``torch.distributed.run`` process with one worker (2 nodes x 1 process;
2 x 2 for the groups),
as on two machines; they meet through a c10d rendezvous at a store this test holds open on
127.0.0.1 (port 0: the kernel picks it as the store binds, so no other process can take it in
between, and both agents join as clients, ``is_host=0``). The workers' EP group is the whole
world (except in the groups test), so every all-to-all of the MoE layer crosses the node boundary. Every process group the
test started is killed at the end, whatever happened.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import json
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from _procs import catches_sigusr1, children, torchrun_rank

pytestmark = pytest.mark.slow

TINY = ["--hidden", "64", "--layers", "1", "--experts", "4", "--tokens", "64", "--warmup", "0",
        "--prefill-threshold", "0", "--steps", "2", "--timeout", "60"]


ROOT = Path(__file__).resolve().parents[2]
DEMO = ["-m", "asyncdbo", "demo", "--launcher", "env", *TINY]


def _agent(port: int, program: list[str] = DEMO, nproc: int = 1) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id", "asyncdbo-two-nodes",
            "--rdzv-conf", "is_host=0", "--max-restarts", "0", *program]


def _two_agents(program: list[str], nproc: int = 1, timeout_s: float = 540) -> list[tuple[str, str]]:
    """Both agents to the end (status 0 each, else the test fails with their output); their
    ``(stdout, stderr)``, in start order (node ranks are the rendezvous's choice)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    agents = [subprocess.Popen(_agent(store.port, program, nproc), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, cwd=ROOT, start_new_session=True) for _ in range(2)]
    try:
        results = [agent.communicate(timeout=timeout_s) for agent in agents]
    finally:
        for agent in agents:
            try:
                os.killpg(agent.pid, signal.SIGKILL)  # the agent and its workers, stopped or not
            except ProcessLookupError:
                pass
            agent.communicate()
    codes = [agent.returncode for agent in agents]
    assert codes == [0, 0], results
    return results


@pytest.mark.timeout(600)
def test_the_serving_example_runs_across_two_torchrun_agents() -> None:
    """examples/05_engine_integration.py as one rank of each node: every rank writes the same
    seeded checkpoint to its own directory, and rank 0 checks every rank's tokens against
    transformers (greedy steps and ``generate()`` per request of the replayed trace)."""
    results = _two_agents([str(ROOT / "examples" / "05_engine_integration.py")])
    (out,) = [out for out, _ in results if "torchrun:" in out]
    assert "torchrun: 2 ranks on 2 node(s) agree with transformers" in out, out
    for rank in (0, 1):
        assert f"rank {rank}: every greedy request of the trace equals transformers' generate()" in out, out


@pytest.mark.timeout(600)
def test_node_local_and_cross_node_ep_groups_of_two_nodes_with_two_processes_each() -> None:
    """2 nodes x 2 processes. torch's ``new_subgroups`` gives node-local EP groups (EP inside a
    node, DP across) and an enumeration gives cross-node ones; on each, the MoE layer's EP rank is
    the rank's place in its group and three DBO steps equal the serial one bitwise."""
    results = _two_agents([str(ROOT / "tests" / "helpers" / "_node_groups_worker.py")], nproc=2)
    (line,) = [ln for out, _ in results for ln in out.splitlines() if ln.startswith("RESULT ")]
    views = json.loads(line[len("RESULT "):])
    assert [view["node-local"]["members"] for view in views] == [[0, 1], [0, 1], [2, 3], [2, 3]], views
    assert [view["node-local"]["nodes"] for view in views] == [[0], [0], [1], [1]], views
    assert [view["cross-node"]["members"] for view in views] == [[0, 2], [1, 3], [0, 2], [1, 3]], views
    assert [view["cross-node"]["nodes"] for view in views] == [[0, 1]] * 4, views
    # the layer's EP rank is the rank's place in its group
    assert [view["node-local"]["ep"] for view in views] == [[2, 0], [2, 1], [2, 0], [2, 1]], views
    assert [view["cross-node"]["ep"] for view in views] == [[2, 0], [2, 0], [2, 1], [2, 1]], views
    for layout in ("node-local", "cross-node"):
        assert [view[layout]["equal"] for view in views] == [[True] * 3] * 4, (layout, views)


def _read_into(stream: Any, lines: list[str]) -> threading.Thread:
    thread = threading.Thread(target=lambda: lines.extend(iter(stream.readline, "")), daemon=True)
    thread.start()
    return thread


def _worker_and_rank(agent_pid: int) -> tuple[int, int] | None:
    """The agent's worker (the child torchrun gave a RANK; any other child is not it) and its rank."""
    for pid in children(agent_pid):
        rank = torchrun_rank(pid)
        if rank is not None:
            return pid, rank
    return None


#: what the survivor's line in torchrun's summary must say: it names the lost rank (rank 0's roll
#: call, 10 s) and carries its own error line, from whichever collective met the lost peer first (a
#: DBO step's all-to-all, a serial step's, the vote's: the moment of the kill is a race), so any
#: exception type torch raises there (RuntimeError, or a subclass such as DistBackendError) and
#: gloo's transport named in its message
SURVIVOR_LINE = re.compile(
    r"traceback : asyncdbo demo: rank 0: error: rank\(s\) \[1\] did not answer within 10 s after this rank failed "
    r"\(stopped, hung or dead\); here: (?P<type>[\w.]+): (?P<message>.*gloo.*)")


@pytest.mark.timeout(600)
def test_killing_one_agent_mid_step_ends_the_other_nodes_rank_with_an_error_naming_the_lost_rank(tmp_path: Path) -> None:
    """SIGKILL to the agent of rank 1 (its worker dies with it: PR_SET_PDEATHSIG) while rank 1 is
    inside a DBO run. Rank 0's next collective fails (connection closed), its roll call finds rank 1
    silent, and its agent exits with status 1 and the error naming rank 1 in torchrun's summary.

    The moment is found, not slept for: the test asks rank 1 for its stacks (SIGUSR1, only once
    its handler is in place) until the dump shows a live run. Rank 1 is the victim because rank
    0's agent hosts the workers' store (killed, the survivor's error says the store is gone).
    Both agents' stderr is kept, whatever happens: in ``tmp_path`` (pytest keeps the last runs'
    folders) and on stdout, which pytest shows with a failure."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    argv = _agent(store.port)
    argv[argv.index("--steps") + 1] = "100000"  # still stepping when the agent is killed
    agents = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True) for _ in range(2)]
    errs: list[list[str]] = [[], []]
    readers = [_read_into(agent.stderr, out) for agent, out in zip(agents, errs)]
    victim = survivor = None
    try:
        deadline = time.monotonic() + 400
        while victim is None and time.monotonic() < deadline:  # which agent's worker is rank 1
            found = [_worker_and_rank(a.pid) for a in agents]
            if None not in found:
                victim = [f[1] for f in found if f is not None].index(1)
                survivor = 1 - victim
            time.sleep(0.2)
        assert victim is not None and survivor is not None, ("no agent started a worker of rank 1", errs)
        worker = _worker_and_rank(agents[victim].pid)
        assert worker is not None, ("rank 1's worker is gone", errs)
        live = False
        while not live and time.monotonic() < deadline:
            time.sleep(0.5)
            if agents[survivor].poll() is not None or agents[victim].poll() is not None:
                break
            if catches_sigusr1(worker[0]):
                os.kill(worker[0], signal.SIGUSR1)
                time.sleep(0.5)
                live = any(line.startswith("asyncdbo run '") for line in errs[victim])
        assert live, ("rank 1 never showed a live DBO run", errs)
        os.killpg(agents[victim].pid, signal.SIGKILL)
        code = agents[survivor].wait(timeout=180)
    finally:
        for agent in agents:
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            agent.wait()
        for agent, reader in zip(agents, readers):
            reader.join(timeout=10)
            agent.stderr.close()  # type: ignore[union-attr]
        for i, lines in enumerate(errs):
            role = {victim: "victim (rank 1)", survivor: "survivor (rank 0)"}.get(i, "rank unknown")
            (tmp_path / f"agent{i}.stderr").write_text("".join(lines))
            print(f"----- agent {i}, {role}: stderr ({tmp_path / f'agent{i}.stderr'})\n{''.join(lines)}")
    text = "".join(errs[survivor])
    assert code == 1, text
    assert "rank      : 0 (local_rank: 0)" in text, text  # torchrun's summary: the survivor is rank 0
    # torchrun's summary shows the line the rank recorded, as it is (no exception type added)
    summary = [line.strip() for line in text.splitlines() if line.strip().startswith("traceback : ")]
    assert len(summary) == 1, text
    assert SURVIVOR_LINE.fullmatch(summary[0]), text
    assert "RuntimeError: RuntimeError" not in text, text
