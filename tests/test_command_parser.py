"""The one parser base of every command: its `--debug`, its config arguments, and usage mistakes
as the command's own one-line error (never argparse's usage block and SystemExit)."""

from __future__ import annotations

import pytest

from nvfp4_jax import cli, device_check, plan, sample
from nvfp4_jax.cli import CommandParser, Exit
from nvfp4_jax.config import ConfigError
from nvfp4_jax.data import DataError
from nvfp4_jax.data import __main__ as data_main
from nvfp4_jax.federated import __main__ as federated_main
from nvfp4_jax.federated import client as federated_client
from nvfp4_jax.federated import ddp as federated_ddp
from nvfp4_jax.lab import __main__ as lab_main


class _Usage(Exception):
    pass


def test_a_usage_mistake_is_the_commands_error_with_where_the_help_is():
    parser = CommandParser("demo", error=_Usage)
    parser.add_argument("--count", type=int)
    with pytest.raises(_Usage, match=r"^argument --count: invalid int value: 'x' "
                                     r"\(see python -m nvfp4_jax\.demo --help\)\.$"):
        parser.parse_args(["--count", "x"])
    bare = CommandParser("demo", error=_Usage, hint=False)
    with pytest.raises(_Usage, match=r"^unrecognized arguments: --nope$"):
        bare.parse_args(["--nope"])


def test_the_base_holds_debug_and_the_config_arguments():
    parser = CommandParser("demo", config=True)
    args = parser.parse_intermixed_args(["run.yml", "steps=3", "--debug", "seed=1"])
    assert args.debug is True and args.config == ["run.yml", "steps=3", "seed=1"]
    assert parser.parse_args([]).debug is False and parser.parse_args([]).config == []
    assert not hasattr(CommandParser("demo").parse_args([]), "config")


def test_parse_command_prints_the_doc_for_help_and_parses_the_rest(capsys):
    parser = CommandParser("demo", error=_Usage)
    parser.add_argument("name", nargs="?")
    parser.add_argument("--flag", action="store_true")
    assert cli.parse_command(parser, ["--help"], "the doc") is None
    assert cli.parse_command(parser, [], "the doc") is None
    assert capsys.readouterr().out == "the doc\nthe doc\n"
    assert cli.parse_command(parser, [], "the doc", help_when_empty=False).name is None
    args = cli.parse_command(parser, ["x", "--flag", "--debug"], "the doc")
    assert (args.name, args.flag, args.debug) == ("x", True, True)
    with pytest.raises(_Usage):  # only a leading -h asks for the doc
        cli.parse_command(parser, ["x", "--help"], "the doc")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("make_parser, error", [
    (sample._parser, ConfigError), (data_main._parser, DataError), (federated_main._parser, ConfigError),
    (lab_main._parser, ConfigError), (federated_client._parser, ValueError), (device_check._parser, ValueError),
    (federated_ddp._parser, ConfigError),
])
def test_every_command_parser_is_built_on_the_base(make_parser, error):
    parser = make_parser()
    assert isinstance(parser, CommandParser) and parser.prog.startswith("python -m nvfp4_jax.")
    with pytest.raises(error):
        parser.parse_args(["--no-such-option"])


def test_debug_adds_the_traceback_to_a_commands_error_line(tmp_path, capsys):
    for main in (sample.main, lambda argv: data_main.main(["prepare", *argv]), lab_main.main, plan.main):
        assert main(["--seeds" if main is lab_main.main else "--nope", "x"]) == Exit.BAD_INPUT
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert main(["--debug", "--seeds" if main is lab_main.main else "--nope", "x"]) == Exit.BAD_INPUT
        err = capsys.readouterr().err
        assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")


def test_convert_takes_debug_too(tmp_path, capsys):
    from nvfp4_jax.convert.__main__ import main as convert_main

    assert convert_main(["to-hf", str(tmp_path / "nowhere"), str(tmp_path / "out"), "--debug"]) == Exit.BAD_INPUT
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")


def test_the_site_script_reads_its_arguments_on_the_base(capsys):
    """FLARE runs the site script with the job's arguments: a wrong one is one line (raised, so
    FLARE ends the job), -h prints the script's doc, the rest parse as the job wrote them."""
    with pytest.raises(ValueError, match=r"^argument --slowdown: invalid float value: 'fast'$"):
        federated_client.main(["--slowdown", "fast"])
    assert federated_client.main(["--help"]) == Exit.OK
    assert "site-local setting" in capsys.readouterr().out
    args = federated_client._parser().parse_args(["--devices", "2", "--slowdown", "1.5"])
    assert (args.devices, args.slowdown, args.data_path) == (2, 1.5, "")
