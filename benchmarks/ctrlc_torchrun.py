"""Ctrl-C to a ``torchrun`` demo job at random moments of its steps: how does each worker end?

    python benchmarks/ctrlc_torchrun.py --tries 12                 # as shipped
    python benchmarks/ctrlc_torchrun.py --tries 12 --no-handler    # the demo's signal handler off

Each try starts ``torchrun --standalone --nproc-per-node 2 -m asyncdbo demo --launcher env`` (a
small model stepping until stopped, on a modeled ib400 link), waits until both workers run (with
the handler: until both have installed it, read from ``/proc/PID/status``; without: a fixed
``--settle`` seconds for start-up), waits a further uniform random 0-6 s, then sends SIGINT to the
job's process group, as Ctrl-C in its terminal does. It counts the tries whose output shows a
C++ abort (``terminate called``, ``SIGABRT``, ``IoException``, torchrun's ``exitcode  : -6``) or
that hung for 90 s. ``--no-handler`` runs the same CLI with
``asyncdbo.cli.demo_env._end_on_signals`` replaced by a no-op: the state issue 22 measured.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # the tests' /proc readers
from _procs import catches, children  # noqa: E402

DEMO = ["demo", "--launcher", "env", "--hidden", "64", "--layers", "1", "--experts", "4", "--tokens", "256",
        "--steps", "100000", "--link", "ib400"]
NO_HANDLER = ("import sys, asyncdbo.cli.demo_env as d; d._end_on_signals = lambda rank: None; "
              "from asyncdbo.cli import main; sys.argv[0] = 'asyncdbo'; raise SystemExit(main())")
ABORTS = ("terminate called", "SIGABRT", "IoException", "exitcode  : -6")


def one_try(no_handler: bool, settle_s: float, delay_s: float) -> tuple[list[str], str]:
    program = ["-c", NO_HANDLER] if no_handler else ["-m", "asyncdbo"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "--no-python",
           sys.executable, *program, *DEMO]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        found: list[int] = []
        while time.monotonic() < deadline:
            found = children(proc.pid)
            if len(found) == 2 and (no_handler or all(catches(pid, signal.SIGTERM) for pid in found)):
                break
            time.sleep(0.1)
        time.sleep((settle_s if no_handler else 0.0) + delay_s)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            return ["hung 90 s"], err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return [mark for mark in ABORTS if mark in err], err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=12)
    parser.add_argument("--no-handler", action="store_true", help="the demo's SIGINT/SIGTERM handler off")
    parser.add_argument("--settle", type=float, default=15.0,
                        help="--no-handler: seconds from the workers' start to the steps (start-up) [15]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    aborted = 0
    for t in range(args.tries):
        delay = rng.uniform(0.0, 6.0)
        marks, err = one_try(args.no_handler, args.settle, delay)
        clean = err.count("stopped by SIGINT, exiting with status 130")
        print(f"try {t}: +{delay:.1f} s, abort marks {marks or 'none'}, workers that printed their 130 line: {clean}",
              flush=True)
        aborted += bool(marks)
    print(f"{'no handler' if args.no_handler else 'as shipped'}: {aborted} of {args.tries} tries aborted or hung")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
