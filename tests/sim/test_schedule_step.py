"""A schedule step added to the MoE layer as a layer option is race-checked through the public
``Deployment.moe`` (``asyncdbo check --moe NAME=VALUE``), with no monkeypatch: docs/maintaining.md,
"Add a schedule step", followed for ``MoEConfig.yield_after_route``."""

from __future__ import annotations

import functools
from typing import Any

import pytest

import asyncdbo
from asyncdbo.cli.check import add_arguments
from asyncdbo.cli.check import main as check_main
from asyncdbo.sim.predict import Deployment, ModelShape, Prediction, predict

pytestmark = pytest.mark.timeout(120)

TINY = ModelShape.of("qwen3-moe").with_overrides(hidden=64, intermediate=32, experts=8, heads=4)
TINY_ARGS = ["--model", "qwen3-moe", "--hidden", "64", "--intermediate", "32", "--experts", "8", "--heads", "4", "--ep", "4"]


def run(policy: str, **moe: Any) -> Prediction:
    dep = Deployment(ep=4, schedule="ht", moe=moe)
    return asyncdbo.run(functools.partial(predict, 64, model=TINY, shape="prefill", deployment=dep, stream_policy=policy),
                        loop="asyncio")


def test_the_step_is_taken_under_ubatch_streams_and_the_checker_finds_nothing_wrong_with_it() -> None:
    plain, stepped = run("ubatch"), run("ubatch", yield_after_route=True)
    assert (stepped.dbo.races, stepped.dbo.dead_waits, stepped.dbo.lost_overlaps) == ([], [], [])
    assert stepped.dbo.switches == plain.dbo.switches + 2 * TINY.layers  # one more handover per ubatch and layer


def test_under_role_streams_the_step_is_not_taken() -> None:
    """There a yield inside a compute phase would let the next compute-done event cover the other
    ubatch's work (the checker's lost overlap, found when the step was first written so)."""
    plain, stepped = run("role"), run("role", yield_after_route=True)
    assert (stepped.dbo.races, stepped.dbo.dead_waits, stepped.dbo.lost_overlaps) == ([], [], [])
    assert stepped.dbo.switches == plain.dbo.switches


def _check(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return check_main(p.parse_args(argv))


def test_check_takes_the_layer_option_and_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TINY_ARGS, "--tokens", "16", "--shape", "prefill", "--stream-policy", "ubatch", "--moe", "yield_after_route=true"]
    assert _check(argv) == 0
    out = capsys.readouterr().out
    assert "moe yield_after_route=True" in out.splitlines()[1]


def test_a_wrong_layer_option_is_refused_naming_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _check([*TINY_ARGS, "--moe", "hidden_size=3"])
    assert "--moe takes NAME=VALUE with NAME one of deterministic, sync_free, yield_after_route" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'top_k' is not a MoE layer option"):
        Deployment(moe={"top_k": 2})
