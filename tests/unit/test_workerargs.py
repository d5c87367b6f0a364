"""A worker's command line (common.workerargs): the supervisor's check and the worker's parse agree."""

from __future__ import annotations

import json

import pytest

from common.workerargs import FIELDS, WorkerArgsError, check_args, from_fields, parse_args

ARGV = [
    "--resource", "nvidia.com/gpu",
    "--plan", "/run/gpuvisor/plans/nvidia.com_gpu.json",
    "--control", "ipc:///run/gpuvisor/control",
    "--supervisor-pid", "41",
    "--zygote-pid", "42",
    "--log-format", "json",
    "--heartbeat-interval", "2.5",
    "--socket-tag", "0a1b2c",
]  # fmt: skip


def test_checked_fields_through_json_are_the_workers_own_parse() -> None:
    """What the supervisor sends the zygote (check_args, then JSON) becomes the very Namespace a
    worker parsing the same arguments gets: every field, with its type (ints, a float, None)."""
    fields = json.loads(json.dumps(check_args(ARGV)))
    assert from_fields(fields) == parse_args(ARGV)
    assert fields["zygote_pid"] == 42 and fields["heartbeat_interval"] == 2.5 and fields["secret_fd"] == -1


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--plan", "p"], "the following arguments are required: --resource"),
        (
            ["--resource", "r", "--plan", "p", "--socket-tag", "XYZ"],
            "--socket-tag: 'XYZ' is not 6 lower-case hex",
        ),
        (["--resource", "r", "--plan", "p", "--zygote-pid", "x"], "--zygote-pid: invalid int value"),
        (["--resource", "r", "--plan", "p", "--log-format", "yaml"], "--log-format: invalid choice"),
        (["--resource", "r", "--plan", "p", "-h"], "unrecognized arguments: -h"),
    ],
    ids=["missing", "bad-tag", "bad-int", "bad-choice", "help"],
)
def test_arguments_a_worker_refuses_are_refused_with_argparses_reason_and_no_output(
    argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """check_args raises WorkerArgsError with argparse's own reason, prints nothing and never
    exits (it runs in the supervisor), where the worker's parse exits 2 on the same arguments;
    `-h` is refused rather than printing help."""
    with pytest.raises(WorkerArgsError, match=reason):
        check_args(argv)
    assert capsys.readouterr() == ("", "")
    if "-h" not in argv:
        with pytest.raises(SystemExit) as exited:
            parse_args(argv)
        assert exited.value.code == 2


def test_the_field_names_are_the_parsers_own() -> None:
    """FIELDS, which the zygote checks a request against, names exactly what the parser makes."""
    assert set(vars(parse_args(["--resource", "r", "--plan", "p"]))) == FIELDS


@pytest.mark.parametrize(
    "fields",
    [["resource"], {"resource": "r"}, {**dict.fromkeys(FIELDS, 0), "extra": 1}, "resource"],
    ids=["list", "missing", "extra", "string"],
)
def test_fields_that_are_not_a_workers_parse_are_refused(fields: object) -> None:
    """from_fields raises ValueError for a non-mapping, a missing field or an unknown one, so the
    zygote answers that request with an error instead of forking a worker that would fail on it."""
    with pytest.raises(ValueError, match="not a worker's parsed arguments"):
        from_fields(fields)
