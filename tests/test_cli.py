"""The `autopart` command: plan a model for a mesh and save it, report a saved plan
(`autopart calibrate` is tested with calibration); each mistake in what the user gives
said in one line with its fix, exit status 2."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

import autopart
import autopart.calibrate
from autopart.cli import DEFAULT_PROFILE, main
from autopart.plan import Plan, PlanError
from tests.models import tiny_gpt2, token_batch


def gpt2_example():
    """The `--model` factory: (model, example inputs)."""
    return tiny_gpt2(), (token_batch(batch=8)[0],)


def linear_example():
    return torch.nn.Linear(4, 4), (torch.randn(8, 4),)


def not_a_pair():
    return torch.nn.Linear(4, 4)


def _one_line(capsys, *parts: str) -> str:
    """The error the command wrote: one line, no traceback, naming `parts`."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    for part in parts:
        assert part in err
    return err


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
    printed = capsys.readouterr()
    assert "tp" in printed.out
    assert "solver: priced" in printed.err  # INFO: what the solver priced
    assert "chose Choices(" not in printed.err  # DEBUG: only with -v
    assert main(["report", str(path)]) == 0
    assert str(plan) in capsys.readouterr().out


def test_a_model_in_the_current_directory_is_importable(tmp_path, monkeypatch, capsys):
    """As with `python -m`, though the installed `autopart` script's path holds only its
    own directory."""
    (tmp_path / "cli_models_here.py").write_text(
        "import torch\n\n\ndef small():\n    return torch.nn.Linear(4, 4), (torch.randn(8, 4),)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        assert main(["plan", "--model", "cli_models_here:small", "--mesh", "cpu:1x1"]) == 0
    finally:
        sys.modules.pop("cli_models_here", None)
    assert "autopart plan v1" in capsys.readouterr().out
    assert str(tmp_path) not in sys.path  # as it was


def test_a_model_that_cannot_be_imported_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--mesh", "cpu:1x1", "--model"]
    assert main([*argv, "no_such_models:small"]) == 2
    _one_line(capsys, "no module no_such_models in", str(tmp_path), "PYTHONPATH")
    (tmp_path / "cli_broken_import.py").write_text("import no_such_dependency\n")
    assert main([*argv, "cli_broken_import:small"]) == 2
    sys.modules.pop("cli_broken_import", None)
    _one_line(capsys, "importing cli_broken_import failed: No module named 'no_such_dependency'")
    assert main([*argv, "tests.test_cli:no_such_factory"]) == 2
    _one_line(capsys, "has no function 'no_such_factory'")
    assert main([*argv, "tests.test_cli"]) == 2
    _one_line(capsys, "--model must look like package.module:function")
    assert main([*argv, "tests.test_cli:not_a_pair"]) == 2
    _one_line(capsys, "must return (model, example_inputs), not Linear")


def test_mesh_errors_show_the_accepted_forms(capsys):
    argv = ["plan", "--model", "tests.test_cli:linear_example", "--mesh"]
    assert main([*argv, "h100-80g:8by8"]) == 2
    _one_line(capsys, "'h100-80g:8by8' is not a mesh", "DEVICE:NODESxPER_NODE", "h100-80g:8x8")
    assert main([*argv, "h100-80g:8"]) == 2
    _one_line(capsys, "DEVICE:NODESxPER_NODE")
    assert main([*argv, "h100:8x8"]) == 2
    _one_line(capsys, "unknown device 'h100': use one of", "h100-80g")


def test_option_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["report", "plan.json", "--bogus"])
    assert exited.value.code == 2
    _one_line(capsys, "unrecognized arguments: --bogus", "autopart report --help")
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--mesh", "cpu:1x2"])
    assert exited.value.code == 2
    _one_line(capsys, "the following arguments are required: --model")


def test_errors_from_autopart_are_one_line_with_a_traceback_under_debug(tmp_path, capsys):
    missing = str(tmp_path / "missing.json")
    assert main(["report", missing]) == 2
    _one_line(capsys, f"autopart report: no plan file at {missing}")
    with pytest.raises(PlanError, match="no plan file"):
        main(["--debug", "report", missing])
    with pytest.raises(PlanError, match="no plan file"):
        main(["report", missing, "--debug"])


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "autopart plan | report | verify | calibrate:" in " ".join(out.split())
    for command in ("plan", "report", "verify", "calibrate"):
        assert f"    {command} " in out


def test_calibrate_writes_to_a_default_path_it_prints(tmp_path, monkeypatch, capsys):
    written = []
    monkeypatch.setattr(autopart.calibrate, "calibrate", lambda out, **_: written.append(out))
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "--quick"]) == 0
    assert str(tmp_path / DEFAULT_PROFILE) in capsys.readouterr().out
    assert main(["calibrate", "--quick", "--name", "box"]) == 0
    assert str(tmp_path / "box.json") in capsys.readouterr().out
    assert main(["calibrate", "--quick", "--out", "p.json"]) == 0
    assert written == [DEFAULT_PROFILE, "box.json", "p.json"]


def test_info_reaches_the_terminal_and_debug_only_with_v(monkeypatch, capsys):
    from tests.test_plan import _plan

    def plan(*args, **kwargs):
        log = logging.getLogger("autopart.solver")
        log.info("solver: pricing plans: 3 of 9")
        log.debug("solver: chose Choices(...)")
        return _plan()

    monkeypatch.setattr(autopart, "plan", plan)
    argv = ["plan", "--model", "tests.test_cli:linear_example", "--mesh", "cpu:1x2"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "pricing plans: 3 of 9" in err and "chose" not in err
    assert main([*argv, "-v"]) == 0
    assert "chose Choices(...)" in capsys.readouterr().err
    assert not logging.getLogger("autopart").handlers  # none left behind


@pytest.mark.slow  # a world of 2; tests/test_verify.py checks verify quick
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
    assert main([*args, "--world", "4"]) == 2
    _one_line(capsys, "--world 4 does not match the plan, made for 2 devices")
