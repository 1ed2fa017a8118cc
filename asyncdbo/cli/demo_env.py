"""``asyncdbo demo --launcher env``: one rank of a ``torchrun`` job.

Every process joins through ``env://`` (NCCL and its own GPU when CUDA is available, else gloo),
runs :func:`asyncdbo.cli.demo.demo_rank`, and rank 0 prints the table. What it does beyond that
is for the job's edges:

* it dies with its agent (``PR_SET_PDEATHSIG``): a killed ``torchrun`` leaves no rank running
  with its ports open;
* a rank that fails prints one line, ``asyncdbo demo: rank R: error: ...``, naming the ranks that
  did not answer a roll call in the store after it failed (a stopped, hung or dead rank never
  does), and records that line where ``torchrun`` reads a worker's error, then exits with status
  1; it never leaves a gloo thread alive into interpreter exit (see
  :func:`asyncdbo.dist.destroy_process_groups`), so it ends by its exit status, not SIGABRT;
* Ctrl-C (SIGINT to the job's process group, which torchrun's agent forwards once more) or SIGTERM
  ends it at once with status 130 or 143 and one line naming the rank and the signal
  (:func:`_end_on_signals`).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch

__all__ = ["main_env"]

#: Longest wait for the other ranks to check in after a failure.
ROLL_CALL_S = 10.0
#: What ``env://`` rendezvous reads; torchrun sets them for every worker.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def main_env(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..dist import destroy_process_groups
    from ..testing.process import exit_with_parent
    from .demo_config import _config_from_args
    from .demo_memory import check_memory
    from .demo_run import _report, demo_rank, passed, summarize
    from .inputs import check_output_dir

    missing = [v for v in TORCHRUN_ENV if v not in os.environ]
    if missing:  # else init_process_group raises a bare ValueError about env:// rendezvous
        print(f"asyncdbo demo: error: --launcher env runs one rank of a torchrun job, but {', '.join(missing)} "
              f"{'is' if len(missing) == 1 else 'are'} not set (not started by torchrun?); run it as "
              "`torchrun --nproc-per-node 2 -m asyncdbo demo --launcher env`, or drop --launcher env "
              "to start the ranks here", file=sys.stderr)
        return 2
    exit_with_parent()  # torchrun's agent started this process: end with it
    _end_on_signals(int(os.environ.get("RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = _config_from_args(args, ranks=world)
        check_memory(cfg, processes=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
        if cfg.trace and rank == 0:
            check_output_dir("--trace", cfg.trace)
    except ValueError as exc:
        print(f"asyncdbo demo: error: {exc}", file=sys.stderr)
        return 2
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method="env://",
                            timeout=timedelta(seconds=cfg.timeout_s))
    failure: str | None = None
    try:
        mine = demo_rank(rank, world, cfg)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        rc = _report(cfg, gathered) if rank == 0 else (0 if passed(summarize(cfg, gathered)) else 1)
    except Exception as exc:
        failure = _describe_failure(exc, min(ROLL_CALL_S, cfg.timeout_s))
        traceback.clear_frames(exc.__traceback__)  # its frames hold the model and its groups
    if failure is None:
        destroy_process_groups()  # leave together; join every group's gloo threads now
        return rc
    print(f"asyncdbo demo: rank {rank}: error: {failure}", file=sys.stderr)
    _record_for_torchrun(failure)
    gc.collect()
    destroy_process_groups(barrier=False)  # peers may be gone: a barrier could only time out
    return 1


def _end_on_signals(rank: int) -> None:
    """End this rank with status 128 + signal on SIGINT or SIGTERM, without unwinding.

    Without it, Ctrl-C to a torchrun job's process group can abort a worker: KeyboardInterrupt
    unwinds it into interpreter exit, where a C++ thread object still joinable ends it with
    ``terminate called without an active exception`` (SIGABRT). ``benchmarks/ctrlc_torchrun.py``
    sends SIGINT at random moments with the handler on and off (results in
    ``benchmarks/results/``). ``os._exit`` skips all teardown, and the exit status and one line
    say what happened (``tests/cli/test_demo_interrupt.py``)."""
    import signal

    def end(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        try:
            print(f"asyncdbo demo: rank {rank}: stopped by {name}, exiting with status {128 + signum}", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(128 + signum)

    signal.signal(signal.SIGINT, end)
    signal.signal(signal.SIGTERM, end)


def _describe_failure(exc: BaseException, wait_s: float) -> str:
    from ..dist import roll_call
    from ..testing.rank_error import exception_line

    line = exception_line(exc)
    silent = roll_call("demo-failed", wait_s)
    if silent:
        return f"rank(s) {silent} did not answer within {wait_s:g} s after this rank failed (stopped, hung or dead); here: {line}"
    if silent is None:  # the store itself is gone: under torchrun, rank 0's agent hosts it
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        where = f" at {addr}:{port}" if addr and port else ""
        return (f"{line}; the rendezvous store{where} cannot be reached either, so the node that hosts it is lost "
                "(under torchrun, rank 0's agent hosts it)")
    return line


def _record_for_torchrun(message: str) -> None:
    """Write the error where torchrun's summary reads it (``TORCHELASTIC_ERROR_FILE``), so its
    "Root Cause" shows this line instead of "To enable traceback see ...".

    The file is written in the format of torch's ``ErrorHandler.record_exception`` (a JSON
    ``message`` with the text and an ``extraInfo.py_callstack``, which the summary prints as the
    worker's traceback), but with the line as it is: ``record_exception`` would prefix the type of
    an exception raised to carry it, and the line already starts with the original one's type
    (``RuntimeError: RuntimeError: ...`` in the summary)."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = f"asyncdbo demo: rank {os.environ.get('RANK', '?')}: error: {message}"
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError as exc:  # the summary is a courtesy; the exit status carries the failure
        print(f"asyncdbo demo: could not record the error for torchrun in {path}: {exc}", file=sys.stderr)
