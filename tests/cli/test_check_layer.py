"""``asyncdbo check --layer FILE:NAME`` and :func:`asyncdbo.sim.check_layer` on the tutorial's
MoE port (tests/sim/tutorial_port.py): the port passes; the port with an ``.item()`` after the
router fails, naming that line, its cost and the cost model's estimate."""

from __future__ import annotations

import asyncio
import os
import re

import pytest

from asyncdbo.cli import main as cli_main
from asyncdbo.sim import SimCheckError, check_layer
from asyncdbo.sim.layer import load_layer

PORT = os.path.join(os.path.dirname(__file__), "..", "sim", "tutorial_port.py")
pytestmark = pytest.mark.timeout(120)


def _item_port(tmp_path: object) -> str:
    with open(PORT, encoding="utf-8") as f:
        src = f.read()
    src = src.replace("ITEM_AFTER_ROUTER = False", "ITEM_AFTER_ROUTER = True")
    path = os.path.join(str(tmp_path), "port_with_item.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(src)
    return path


def _line(path: str, text: str) -> int:
    with open(path, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_the_tutorial_port_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["check", "--layer", f"{PORT}:make_layer", "--tokens", "64", "--ep", "4", "--stream-policy", "both"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^\s+64\s+[\d.]+ \|\s+[\d.]+\s+[\d.]+x \|\s+[\d.]+\s+[\d.]+x$", out, re.M), out
    assert re.search(r"^over the serial run without DBO's yields and hooks \(.*\): 64 role [\d.]+x, 64 ubatch [\d.]+x$",
                     out, re.M), out


def test_an_item_after_the_router_fails_naming_its_line(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    path = _item_port(tmp_path)
    code = cli_main(["check", "--layer", f"{path}:make_layer", "--tokens", "64", "--ep", "4"])
    out = capsys.readouterr().out
    assert code == 1, out
    line = _line(path, "expert_T.max().item()")
    assert re.search(r"lost overlap \(host-sync, costs [\d.]+ us of this run; the cost model estimates [\d.]+ us on "
                     r"h200, eager launches \(a step of [\d.]+ us there\)\)", out), out
    assert "host sync aten._local_scalar_dense: ubatch 0 before its first yield, stream compute" in out
    assert f"port_with_item.py:{line} in forward" in out


def test_the_python_entry_point_raises_with_the_finding(tmp_path: object) -> None:
    layer = load_layer(f"{_item_port(tmp_path)}:TutorialMoE")  # a class: a factory of the group too
    with pytest.raises(SimCheckError) as err:
        asyncio.run(check_layer(layer, tokens=[32], ep=4, host="none"))
    (finding,) = err.value.findings
    assert finding.kind == "host-sync" and finding.site.op == "aten._local_scalar_dense"
    assert finding.estimate_s is not None and finding.estimate_s > 0  # fails whatever it cost at host "none"


def test_bad_layer_specs_exit_2_with_the_fix(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check", "--layer", "nofile.py:x"]) == 2
    assert "asyncdbo check: error: --layer nofile.py:x: no file 'nofile.py'" in capsys.readouterr().err
    assert cli_main(["check", "--layer", f"{PORT}:nothing"]) == 2
    assert "defines no 'nothing'; it defines" in capsys.readouterr().err


def test_compute_queued_behind_its_own_combine_is_lost_overlap_at_its_line(tmp_path: object) -> None:
    # A general finding, not a named pattern: the MLP after the residual switch reads nothing the
    # combine delivered, yet waits for it.
    with open(PORT, encoding="utf-8") as f:
        src = f.read()
    src = src.replace('''        await dbo_yield_and_switch_from_comm_to_compute("residual")
        return x_TD + back_TD''', '''        await dbo_yield_and_switch_from_comm_to_compute("residual")
        h_TH = torch.relu(x_TD @ self.w_up_EDH[0])  # reads nothing the combine delivered
        return x_TD + back_TD + h_TH @ self.w_down_EHD[0]''')
    path = os.path.join(str(tmp_path), "late_mlp.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(src)
    res = asyncio.run(check_layer(load_layer(f"{path}:make_layer"), tokens=[1024], ep=8, host="none",
                                  raise_problems=False))
    (lost,) = res.problems
    mlp, wait = _line(path, "h_TH = torch.relu"), _line(path, '"residual"')
    # (each place's next frame is this test's call of check_layer)
    assert [ln for ln in str(lost).splitlines() if "test_check_layer.py" not in ln] == [
        f"lost overlap (unneeded-comm-wait, costs {lost.cost_s * 1e6:.1f} us of this run): compute on stream compute "
        "waited for a transfer it does not read",
        "    aten::mm: ubatch 1 after its yield 'residual', stream compute",
        f"        at {os.path.relpath(path)}:{mlp} in forward",
        "    behind: wait event: ubatch 1 after its yield 'residual', stream compute",
        f"        at {os.path.relpath(path)}:{wait} in forward",
        "    it reads nothing the transfer delivered, yet was queued after the wait for it, so it could not run while "
        "the transfer was in flight: issue it before the wait (before the yield or the switch that waits)",
    ]
    assert lost.cost_s > 0


def test_findings_of_one_run_are_also_costed_together(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    # Each finding's cost is a run with that one fixed; two together are costed by one more run with
    # both fixed (SimReport.lost_overlap_s), printed beside them.
    with open(_item_port(tmp_path), encoding="utf-8") as f:
        src = f.read()
    src = src.replace('''        await dbo_yield_and_switch_from_comm_to_compute("residual")
        return x_TD + back_TD''', '''        await dbo_yield_and_switch_from_comm_to_compute("residual")
        h_TH = torch.relu(x_TD @ self.w_up_EDH[0])  # reads nothing the combine delivered
        return x_TD + back_TD + h_TH @ self.w_down_EHD[0]''')
    path = os.path.join(str(tmp_path), "two_findings.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(src)
    code = cli_main(["check", "--layer", f"{path}:make_layer", "--tokens", "1024", "--ep", "8", "--host", "none"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(r"^role streams, 1024 tokens: the lost overlap costs [\d.]+ us of this run together \(a run "
                     r"with every finding fixed at once\)$", out, re.M), out
    assert "lost overlap (host-sync, costs " in out and "lost overlap (unneeded-comm-wait, costs " in out


@pytest.mark.timeout(120)
def test_every_ubatch_gets_tokens_cut_as_the_planner_cuts_them() -> None:
    """4 tokens in 3 ubatches: the planner's token split, 1 + 1 + 2 (a ceiling cut left the third
    ubatch empty, though the check requires a token per ubatch)."""
    from asyncdbo import dbo_yield

    class Sizes:
        hidden_size = 8

        def __init__(self) -> None:
            self.seen: list[int] = []

        async def forward(self, x_TD: object) -> object:
            self.seen.append(x_TD.shape[0])  # type: ignore[attr-defined]
            await dbo_yield("layer")
            return x_TD

    layer = Sizes()
    asyncio.run(check_layer(layer, tokens=[4], ubatches=3, ep=1, host="none"))
    assert layer.seen == [4, 1, 1, 2, 4]  # serial, the three ubatches, the plain serial run
