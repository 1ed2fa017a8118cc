"""The public API: everything in __all__ exists, is documented, and importing has no side effects."""

from __future__ import annotations

import subprocess
import sys

import asyncdbo


def test_every_public_name_exists_and_has_a_docstring() -> None:
    missing = [n for n in asyncdbo.__all__ if not hasattr(asyncdbo, n)]
    assert missing == []
    undocumented = [n for n in asyncdbo.__all__ if callable(getattr(asyncdbo, n)) and not getattr(asyncdbo, n).__doc__]
    assert undocumented == []


def test_stable_names_from_the_issues_are_public() -> None:
    stable = {
        "run_ubatches", "run", "dbo_yield", "dbo_yield_and_switch_from_compute_to_comm",
        "dbo_yield_and_switch_from_comm_to_compute", "dbo_switch_to_comm", "dbo_switch_to_compute",
        "dbo_switch_to_comm_sync", "dbo_switch_to_compute_sync", "dbo_register_recv_hook",
        "dbo_maybe_run_recv_hook", "dbo_get_previous_event", "dbo_enabled", "dbo_current_ubatch_id",
    }
    assert stable <= set(asyncdbo.__all__)


def test_py_typed_ships() -> None:
    from importlib.resources import files

    assert files("asyncdbo").joinpath("py.typed").is_file()


def test_import_has_no_side_effects() -> None:
    code = (
        "import sys, asyncdbo, torch.distributed as dist, logging;"
        "assert not dist.is_initialized();"
        "assert logging.getLogger('asyncdbo').handlers == [];"
        "assert 'asyncdbo.sim' not in sys.modules and 'asyncdbo.cli.demo' not in sys.modules;"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok" and out.stderr == ""
