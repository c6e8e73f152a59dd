"""The `autopart` command: plan a model for a mesh and save it, report a saved plan
(`autopart calibrate` is tested with calibration)."""

from __future__ import annotations

import pytest

import autopart
from autopart.cli import main
from autopart.plan import Plan
from tests.models import tiny_gpt2, token_batch


def gpt2_example():
    """The `--model` factory: (model, example inputs)."""
    return tiny_gpt2(), (token_batch(batch=8)[0],)


def test_plan_then_report(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = [
        "plan",
        "--model",
        "tests.test_cli:gpt2_example",
        "--mesh",
        "cpu:1x2",
        "--tp",
        "2",
        "--out",
        str(path),
    ]
    assert main(argv) == 0
    plan = Plan.load(path)
    assert (plan.dp, plan.tp, plan.pp) == (1, 2, 1)
    assert "tp" in capsys.readouterr().out
    assert main(["report", str(path)]) == 0
    assert str(plan) in capsys.readouterr().out


def test_unknown_options_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["report", "plan.json", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_verify_runs_a_saved_plan_beside_one_device(tmp_path, capsys):
    from tests.models import llama_training_case

    model, inputs, _, _, _ = llama_training_case()
    plan = autopart.plan(model, autopart.Mesh.cluster("cpu", nodes=1, per_node=2), inputs, tp=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    args = ["verify", "--model", "tests.models:llama_training_case", "--plan", str(path)]
    assert main([*args, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp=1 tp=2" in out and "the plan matches one device" in out
    with pytest.raises(SystemExit, match="does not match the plan, made for 2 devices"):
        main([*args, "--world", "4"])
