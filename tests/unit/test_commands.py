"""The one command surface: every command behind `python -m trainer <command>`, each flag under both spellings."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.__main__ import COMMANDS, main
from trainer.config import RunConfig
from trainer.errors import Parser, UsageError

ROOT = Path(__file__).resolve().parents[2]


def test_the_command_table_lists_every_command_with_a_main(capsys):
    assert main([]) == 0
    listing = capsys.readouterr().out
    for name, command in COMMANDS.items():
        assert f"  {name} " in listing
        assert callable(getattr(importlib.import_module(command.module), command.function)), name


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_answers_help_under_its_own_name(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    prog = "push_to_hub.py" if name == "push" else ("accelerate launch trainer/run.py" if name == "train"
                                                    else f"python -m trainer {name}")
    assert out.startswith(f"usage: {prog}"), out[:200]


def test_an_unknown_command_is_one_sentence_naming_the_close_one(capsys):
    assert main(["evalute", "--drafter", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown command 'evalute'; did you mean evaluate?") and err.count("\n") == 1
    with pytest.raises(SystemExit):  # underscores name the same command
        main(["states_cache", "--help"])
    assert capsys.readouterr().out.startswith("usage: python -m trainer states-cache")


def test_flags_answer_to_both_spellings():
    parser = Parser(prog="p")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--states_dir")
    args, rest = parser.parse_known_args(["--max_new_tokens", "3", "--states-dir=d", "--learning-rate", "1e-3"])
    assert (args.max_new_tokens, args.states_dir, rest) == (3, "d", ["--learning-rate", "1e-3"])
    with pytest.raises(UsageError, match="did you mean --max-new-tokens"):
        parser.parse_args(["--max-new-tokns", "3"])
    # no abbreviations: a run-config key that a command flag happens to prefix stays a run-config key
    parser.add_argument("--config")
    assert parser.parse_known_args(["--conf", "x"])[1] == ["--conf", "x"]
    config = RunConfig.load(str(ROOT / "configs" / "smollm2-135m.yaml"), ["--learning-rate", "1e-3",
                                                                          "--max_steps", "7"])
    assert (config.train.learning_rate, config.train.max_steps) == (1e-3, 7)


def test_python_dash_m_trainer_runs_a_command_in_a_fresh_process():
    """The real entry point, as a user types it: a bad flag value is one line and exit status 2."""
    proc = subprocess.run([sys.executable, "-m", "trainer", "evaluate", "--drafter", "d", "--prompts", "p",
                           "--max_new_tokens", "many"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: argument --max-new-tokens: invalid int value: 'many'"), proc.stderr
    assert "Traceback" not in proc.stderr
