"""Drop-in parity: every input is taken as NVIDIA's nvidia-device-plugin v0.20.0 takes it.

One row per input (flags as `gpuvisor run` receives them, env vars, config file), with NVIDIA's
outcome: accepted with the same effective value, or rejected (for gpuvisor: one ConfigError line
and exit code 78). Each row names the NVIDIA source it follows, at tag v0.20.0 (commit
1b826acc6af3) unless another module is named: urfave/cli v2.27.7, go.yaml.in/yaml/v2 v2.4.3,
sigs.k8s.io/yaml v1.6.0, google/uuid v1.6.0, k8s.io/apimachinery v0.36.3 (NVIDIA's go.mod).
Rows 1-28 are issue 15's table; the rest were found reading the same sources, or already held.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from supervisor.cli import build_parser
from supervisor.config import EXIT_CONFIG_ERROR, ConfigError, DeviceSelector, load_config
from supervisor.config.nvidia import Leaf, leaf_at
from supervisor.config.settings import SETTINGS

UUID = "b1028956-cfa2-0990-bf4a-5da9abb51763"
TS = "sharing: {timeSlicing: {resources: [%s]}}"
GPU2 = "{name: gpu, replicas: 2%s}"


def ts(extra: str = "", entry: str = GPU2) -> str:
    """A time-slicing config with one resource entry (`extra` added inside the entry)."""
    return TS % (entry % extra)


@dataclass(frozen=True)
class Row:
    name: str
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    file: str | None = None
    expect: Mapping[str, Any] | None = None  # accepted: Config attribute path -> value
    error: str | None = None  # rejected: a part of the one-line error


ROWS = [
    # --- issue 15, rows 1-28 ------------------------------------------------------------------
    # 1. main.go:81-86 (Aliases: nvidia-dev-root), flags.go:131.
    Row("01 --nvidia-dev-root is --dev-root", argv=("--nvidia-dev-root", "/run/nvidia/driver"), expect={"dev_root": "/run/nvidia/driver"}),
    # 2. main.go:126-132 (Aliases: nvidia-ctk-path), flags.go:157.
    Row("02 --nvidia-ctk-path is --nvidia-cdi-hook-path", argv=("--nvidia-ctk-path=/opt/ctk",), expect={"nvidia_cdi_hook_path": "/opt/ctk"}),
    # 3. main.go:131 (EnvVars: NVIDIA_CDI_HOOK_PATH, NVIDIA_CTK_PATH).
    Row("03 env NVIDIA_CTK_PATH", env={"NVIDIA_CTK_PATH": "/opt/ctk"}, expect={"nvidia_cdi_hook_path": "/opt/ctk"}),
    # 4. main.go:133-139 (Aliases: container-driver-root), flags.go:159.
    Row("04 --container-driver-root is --driver-root-ctr-path", argv=("--container-driver-root", "/drv"), expect={"driver_root_ctr_path": "/drv"}),
    # 5. main.go:181-186: a StringSliceFlag with env CDI_FEATURE_FLAGS.
    Row("05a --cdi-feature-flags", argv=("--cdi-feature-flags", "a,b"), expect={"cdi_feature_flags": ("a", "b")}),
    Row("05b env CDI_FEATURE_FLAGS", env={"CDI_FEATURE_FLAGS": "x"}, expect={"cdi_feature_flags": ("x",)}),
    # 6. main.go:187-192: a StringSliceFlag with env CDI_DISABLE_HOOKS.
    Row("06a --cdi-disable-hooks", argv=("--cdi-disable-hooks=all",), expect={"cdi_disable_hooks": ("all",)}),
    Row("06b env CDI_DISABLE_HOOKS", env={"CDI_DISABLE_HOOKS": "update-ldcache"}, expect={"cdi_disable_hooks": ("update-ldcache",)}),
    # 7. urfave flag_string.go:56-59 (an env var found, even empty, is the value); main.go:244-250.
    Row("07 env MIG_STRATEGY empty", env={"MIG_STRATEGY": ""}, error='env MIG_STRATEGY: invalid value ""'),
    # 8. urfave flag_bool.go:113-128: an empty env var sets false.
    Row("08 env FAIL_ON_INIT_ERROR empty", env={"FAIL_ON_INIT_ERROR": ""}, expect={"fail_on_init_error": False}),
    # 9. urfave flag_string_slice.go:158-171 ([""]), api/config/v1/strategy.go:36-41.
    Row("09 env DEVICE_LIST_STRATEGY empty", env={"DEVICE_LIST_STRATEGY": ""}, error='invalid device list strategy ""'),
    # 10. urfave flag_string.go:56-59; main.go:214-216.
    Row("10 env DEVICE_ID_STRATEGY empty", env={"DEVICE_ID_STRATEGY": ""}, error='env DEVICE_ID_STRATEGY: invalid value ""'),
    # 11. urfave flag_string.go:56-59; internal/plugin/server.go:417-428 (prefix + key).
    Row("11 env CDI_ANNOTATION_PREFIX empty", env={"CDI_ANNOTATION_PREFIX": ""}, expect={"cdi_annotation_prefix": ""}),
    # 12. urfave flag_bool.go:62-64 (TakesValue false) and parse.go:19-21 (Go's FlagSet.Parse:
    #     a bool flag takes no separate value; the first non-flag argument ends the flags).
    Row("12 --pass-device-specs false", argv=("--pass-device-specs", "false"), expect={"pass_device_specs": True}),
    # 13. api/config/v1/config.go:128-130.
    Row("13 version empty", file="version: ''", expect={"mig_strategy": "none"}),
    # 14. flags.go:76 (*bool): encoding/json refuses a string.
    Row("14 passDeviceSpecs a string", file="flags: {plugin: {passDeviceSpecs: 'true'}}", error="flags.plugin.passDeviceSpecs: must be a boolean"),
    # 15. flags.go:61 (*bool).
    Row("15 failOnInitError a string", file="flags: {failOnInitError: 'true'}", error="flags.failOnInitError: must be a boolean"),
    # 16. flags.go:91-97 (one string is one item, commas included), strategy.go:36-41.
    Row("16 deviceListStrategy one comma string", file="flags: {plugin: {deviceListStrategy: 'envvar,volume-mounts'}}",
        error='invalid device list strategy "envvar,volume-mounts"'),
    # 17. flags.go:99-102, strategy.go:29-43 (no strategy is a valid set).
    Row("17 deviceListStrategy empty list", file="flags: {plugin: {deviceListStrategy: []}}", expect={"device_list_strategy": ()}),
    # 18. config.go:68-70: an empty dev root is the driver root.
    Row("18 nvidiaDevRoot empty", file="flags: {nvidiaDriverRoot: /drv, nvidiaDevRoot: ''}", expect={"dev_root": "/drv"}),
    # 19. replicas.go:173-181 (json into bool).
    Row("19 renameByDefault a string", file="sharing: {timeSlicing: {renameByDefault: 'true', resources: [{name: gpu, replicas: 2}]}}",
        error="sharing.timeSlicing.renameByDefault: must be a boolean"),
    # 20. replicas.go:183-188 (json into *bool).
    Row("20 failRequestsGreaterThanOne a string",
        file="sharing: {timeSlicing: {failRequestsGreaterThanOne: 'true', resources: [{name: gpu, replicas: 2}]}}",
        error="sharing.timeSlicing.failRequestsGreaterThanOne: must be a boolean"),
    # 21. replicas.go:292-318: an empty list is a (empty) list of references.
    Row("21 devices empty list", file=ts(", devices: []"), expect={"sharing.resources[0].devices": DeviceSelector(refs=())}),
    # 22. replicas.go:128-134 (uuid.Parse), 305-315.
    Row("22 devices GPU-foo", file=ts(", devices: [GPU-foo]"), error='invalid device reference "GPU-foo"'),
    # 23. replicas.go:100-105 (strconv.ParseUint: no spaces), 305-315.
    Row("23 devices ' 1 '", file=ts(", devices: [' 1 ']"), error='invalid device reference " 1 "'),
    # 24. replicas.go:255-263 -> resources.go:127-140 -> NewResourceName("") (resources.go:48-64).
    Row("24 rename empty", file=ts(", rename: ''"), error='sharing.timeSlicing.resources[0].rename: invalid resource name "nvidia.com/"'),
    # 25. resources.go:57-61: the name must be a DNS-1123 subdomain (apimachinery validation.go:198-207).
    Row("25a name upper case", file=ts(entry="{name: GPU, replicas: 2%s}"), error='invalid resource name "nvidia.com/GPU"'),
    Row("25b name with _", file=ts(entry="{name: my_gpu, replicas: 2%s}"), error='invalid resource name "nvidia.com/my_gpu"'),
    # 26. resources.go:94-124: any pattern string, "" included.
    Row("26 resources.gpus empty pattern", file="resources: {gpus: [{pattern: '', name: a100}]}",
        expect={"resources.gpus[0].pattern": "", "resources.gpus[0].name": "nvidia.com/a100"}),
    # 27. resources.go:117-121 -> 127-140 -> 48-64.
    Row("27 resources.gpus invalid name", file="resources: {gpus: [{pattern: '*', name: A100}]}", error='invalid resource name "nvidia.com/A100"'),
    # 28. sharing.go:36-45 (SharingStrategy: MPS first), 48-53 (ReplicatedResources: MPS).
    Row("28 timeSlicing and mps", file="flags: {mpsRoot: /m}\nsharing: {timeSlicing: {resources: [{name: gpu, replicas: 8}]}, "
        "mps: {resources: [{name: gpu, replicas: 3}]}}",
        expect={"sharing.strategy": "mps", "sharing.resources[0].replicas": 3, "sharing.fail_requests_greater_than_one": True}),
    # --- found reading the same sources -------------------------------------------------------
    # main.go:138 (EnvVars: DRIVER_ROOT_CTR_PATH, CONTAINER_DRIVER_ROOT).
    Row("29 env CONTAINER_DRIVER_ROOT", env={"CONTAINER_DRIVER_ROOT": "/drv"}, expect={"driver_root_ctr_path": "/drv"}),
    # urfave flag.go:378-384: the first env var present wins, even empty.
    Row("30 first env var present wins", env={"NVIDIA_CDI_HOOK_PATH": "", "NVIDIA_CTK_PATH": "/x"}, expect={"nvidia_cdi_hook_path": ""}),
    # main.go:74-80 (no check of the value), config.go:68-70; NVIDIA only joins paths onto it
    # (filepath.Join ignores ""), so its effective value is "/".
    Row("31 --driver-root empty", argv=("--driver-root=",), expect={"driver_root": "/", "dev_root": "/"}),
    # urfave flag.go:194-216 (normalizeFlags).
    Row("32 two forms of one flag", argv=("--driver-root", "/a", "--nvidia-driver-root", "/b"), error="cannot use two forms of the same flag"),
    # Go's flag package has no abbreviations (argparse would take --mig for --mig-strategy).
    Row("33 abbreviated flag", argv=("--mig", "mixed"), error="flag --mig: flag provided but not defined"),
    # Go's flag package: -name and --name are the same flag.
    Row("34 single-dash flag", argv=("-mig-strategy=mixed",), expect={"mig_strategy": "mixed"}),
    # Go's FlagSet.Parse stops at the first non-flag argument; main.go's action ignores c.Args().
    Row("35 arguments after a positional one are ignored", argv=("--pass-device-specs", "false", "--mig-strategy", "mixed"),
        expect={"pass_device_specs": True, "mig_strategy": "none"}),
    # Go's flag package takes the next argument as a string flag's value, even one starting with '-'.
    Row("36 a value that starts with '-'", argv=("--mps-root", "-odd"), expect={"mps_root": "-odd"}),
    # urfave flag_string_slice.go:48-53 keeps empty items; strategy.go:36-41.
    Row("37 --device-list-strategy with an empty item", argv=("--device-list-strategy", "envvar,"), error='invalid device list strategy ""'),
    # urfave flag_string_slice.go:48-53 trims each item.
    Row("38 --device-list-strategy items trimmed", argv=("--device-list-strategy", "envvar, volume-mounts"),
        expect={"device_list_strategy": ("envvar", "volume-mounts")}),
    # urfave flag_int_slice.go:62-66: strconv.ParseInt(s, 0, 64).
    Row("39 --imex-channel-ids 0x0", argv=("--imex-channel-ids", "0x0"), expect={"imex_channel_ids": (0,)}),
    # urfave flag_int_slice.go:171: an empty env var does not set the flag.
    Row("40 env IMEX_CHANNEL_IDS empty", env={"IMEX_CHANNEL_IDS": ""}, file="imex: {channelIDs: [0]}", expect={"imex_channel_ids": (0,)}),
    # urfave flag_string.go:56-59 (an empty env var is set, so it wins over the file), config.go:68-70.
    Row("41 env NVIDIA_DEV_ROOT empty beats the file", env={"NVIDIA_DEV_ROOT": ""}, file="flags: {nvidiaDevRoot: /f}", expect={"dev_root": "/"}),
    # urfave flag_bool.go:113-128, flags.go:32-33 (updateFromCLIFlag: IsSet wins over the file).
    Row("42 env PASS_DEVICE_SPECS empty beats the file", env={"PASS_DEVICE_SPECS": ""}, file="flags: {plugin: {passDeviceSpecs: true}}",
        expect={"pass_device_specs": False}),
    # sigs.k8s.io/yaml yaml.go:332-352: a number lands in a Go string field as its text.
    Row("43 mpsRoot a number", file="flags: {mpsRoot: 7}", expect={"mps_root": "7"}),
    # go-yaml v2 resolve.go:37 (y is true).
    Row("44 failOnInitError: y", file="flags: {failOnInitError: y}", expect={"fail_on_init_error": True}),
    # sigs.k8s.io/yaml yaml.go:262-273 and encoding/json: keys match fields case-insensitively.
    Row("45 keys case-insensitive", file="FLAGS: {MigStrategy: mixed, Plugin: {DEVICEIDSTRATEGY: index}}",
        expect={"mig_strategy": "mixed", "device_id_strategy": "index"}),
    # replicas.go:246-249 (json into int): 2.0 is written 2 by sigs.k8s.io/yaml's JSON.
    Row("46 replicas 2.0", file=ts(entry="{name: gpu, replicas: 2.0%s}"), expect={"sharing.resources[0].replicas": 2}),
    # go-yaml v2 resolve.go:151-168: 1e1 and 08 are floats (10, 8), so integers for a Go int.
    Row("47 replicas 1e1", file=ts(entry="{name: gpu, replicas: 1e1%s}"), expect={"sharing.resources[0].replicas": 10}),
    Row("48 replicas 08", file=ts(entry="{name: gpu, replicas: 08%s}"), expect={"sharing.resources[0].replicas": 8}),
    # replicas.go:246-249: 2.5 does not decode into an int.
    Row("49 replicas 2.5", file=ts(entry="{name: gpu, replicas: 2.5%s}"), error="replicas: must be an integer, not 2.5"),
    # replicas.go:271-279 (json.Unmarshal("null", &str) gives "", not "all").
    Row("50 devices null", file=ts(", devices: null"), error="but the only valid string input is 'all'"),
    # replicas.go:298-303: a null item decodes as uint 0.
    Row("51 devices [null] is GPU 0", file=ts(", devices: [null]"), expect={"sharing.resources[0].devices": DeviceSelector(refs=("0",))}),
    # sharing.go:22 (a value with its own UnmarshalJSON), replicas.go:190-193 ("no resources specified").
    Row("52 timeSlicing null", file="sharing: {timeSlicing: null}", error="sharing.timeSlicing.resources: no resources specified"),
    # sharing.go:24 (*ReplicatedResources: null clears it).
    Row("53 mps null", file="sharing: {mps: null}", expect={"sharing.strategy": "none"}),
    # Only main.go:227-234 checks MPS at config time; an MPS entry naming a resource the node
    # does not have is skipped (internal/rm/device_map.go:240-244).
    Row("54 mps entry for an absent MIG resource", file="flags: {mpsRoot: /m}\nsharing: {mps: {resources: [{name: mig-1g.10gb, replicas: 2}]}}",
        expect={"sharing.strategy": "mps"}),
    # imex.go:36 ([]int): a bare number or a string is not a list of ints.
    Row("55 imex.channelIDs a number", file="imex: {channelIDs: 0}", error="imex.channelIDs: must be a list, not an integer"),
    Row("56 imex.channelIDs strings", file="imex: {channelIDs: ['0']}", error="imex.channelIDs[0]: must be an integer"),
    # imex.go:41 (bool).
    Row("57 imex.required a string", file="imex: {required: 'true'}", error="imex.required: must be a boolean"),
    # sigs.k8s.io/yaml yaml.go:173-178: json.Marshal fails on NaN anywhere in the file.
    Row("58 NaN anywhere", file="extra: .nan", error="extra: holds nan"),
    # replicas.go:204-208: the default rename (name + ".shared") is not checked for length.
    Row("59 renameByDefault on a 56-character name",
        file="sharing: {timeSlicing: {renameByDefault: true, resources: [{name: " + "a" * 52 + ", replicas: 2}]}}",
        expect={"sharing.resources[0].rename": "nvidia.com/" + "a" * 52 + ".shared"}),
    # flags.go:108-115 (GFDCommandLineFlags): decoded, so a wrong type fails the file.
    Row("60 flags.gfd.oneshot a string", file="flags: {gfd: {oneshot: 'yes'}}", error="flags.gfd.oneshot: must be a boolean"),
    # resources.go:111-115: `pattern: null` reads as "".
    Row("61 pattern null", file="resources: {gpus: [{pattern: null, name: a}]}", expect={"resources.gpus[0].pattern": ""}),
    # go-yaml v2 yaml.go Unmarshal reads the first document only.
    Row("62 two YAML documents", file="flags: {migStrategy: single}\n---\nflags: {migStrategy: bogus}\n", expect={"mig_strategy": "single"}),
    # replicas.go:305-315: surrounding text makes a reference invalid; a valid UUID is accepted.
    Row("63 devices GPU UUID", file=ts(f", devices: [GPU-{UUID}, 'MIG-GPU-{UUID}/1/0']"),
        expect={"sharing.resources[0].devices": DeviceSelector(refs=(f"GPU-{UUID}", f"MIG-GPU-{UUID}/1/0"))}),
    # flags.go:99-102 (a list is taken as is: no trimming).
    Row("64 deviceListStrategy item with a space", file="flags: {plugin: {deviceListStrategy: [' envvar']}}",
        error='invalid device list strategy " envvar"'),
    # --- already taken as NVIDIA takes them -----------------------------------------------------
    Row("65 defaults", expect={"mig_strategy": "none", "fail_on_init_error": True, "device_list_strategy": ("envvar",),
                               "device_id_strategy": "uuid", "cdi_annotation_prefix": "cdi.k8s.io/", "dev_root": "/"}),
    Row("66 bare boolean flag", argv=("--pass-device-specs",), expect={"pass_device_specs": True}),
    Row("67 boolean flag =false", argv=("--fail-on-init-error=false",), expect={"fail_on_init_error": False}),
    Row("68 bad boolean", argv=("--gds-enabled=yes",), error='flag --gds-enabled: invalid boolean "yes"'),  # strconv.ParseBool
    Row("69 env MIG_STRATEGY bogus", env={"MIG_STRATEGY": "bogus"}, error='env MIG_STRATEGY: invalid value "bogus"'),  # main.go:244-250
    Row("70 flag beats env beats file", argv=("--mig-strategy", "none"), env={"MIG_STRATEGY": "mixed"}, file="flags: {migStrategy: single}",
        expect={"mig_strategy": "none"}),  # flags.go:32-33
    Row("71 env beats file", env={"MIG_STRATEGY": "mixed"}, file="flags: {migStrategy: single}", expect={"mig_strategy": "mixed"}),
    Row("72 version v2", file="version: v2", error="unsupported config version"),  # config.go:132-134
    Row("73 deviceListStrategy one string", file="flags: {plugin: {deviceListStrategy: volume-mounts}}",
        expect={"device_list_strategy": ("volume-mounts",)}),  # flags.go:91-97
    Row("74 IMEX channel 1", argv=("--imex-channel-ids", "1"), error="only [] or [0] is supported"),  # imex.go:45-53
    Row("75 IMEX channels [0, 0]", argv=("--imex-channel-ids", "0", "--imex-channel-ids", "0"), error="only [] or [0] is supported"),
    Row("76 replicas 1", file=ts(entry="{name: gpu, replicas: 1%s}"), error="number of replicas must be >= 2"),  # replicas.go:251-253
    Row("77 no replicas", file=ts(entry="{name: gpu%s}"), error="no replicas specified"),  # replicas.go:241-244
    Row("78 MPS without a root", file="sharing: {mps: {resources: [{name: gpu, replicas: 2}]}}", error="needs an MPS root"),  # main.go:231-233
    Row("79 MPS with mixed", file="flags: {migStrategy: mixed, mpsRoot: /m}\nsharing: {mps: {resources: [{name: gpu, replicas: 2}]}}",
        error="not supported with the mixed MIG strategy"),  # main.go:228-230
    Row("80 MPS fails requests > 1 by default", file="flags: {mpsRoot: /m}\nsharing: {mps: {resources: [{name: gpu, replicas: 2}]}}",
        expect={"sharing.fail_requests_greater_than_one": True}),  # config.go:72-76
    Row("81 MPS failRequestsGreaterThanOne false", file="flags: {mpsRoot: /m}\nsharing: {mps: {failRequestsGreaterThanOne: false, "
        "resources: [{name: gpu, replicas: 2}]}}", expect={"sharing.fail_requests_greater_than_one": False}),
    Row("82 renameByDefault", file="sharing: {timeSlicing: {renameByDefault: true, resources: [{name: gpu, replicas: 2}]}}",
        expect={"sharing.resources[0].rename": "nvidia.com/gpu.shared"}),  # replicas.go:204-208
    Row("83 devices count and MIG index", file=ts(", devices: 2") + "\n", expect={"sharing.resources[0].devices": DeviceSelector(count=2)}),
    Row("84 devices count 0", file=ts(", devices: 0"), error="device count must be > 0"),  # replicas.go:285-287
    Row("85 name too long", file=ts(entry="{name: " + "a" * 53 + ", replicas: 2%s}"), error="at most 63 characters"),  # resources.go:53-55
    Row("86 unquoted MIG index", file=ts(", devices: [1:2]"), expect={"sharing.resources[0].devices": DeviceSelector(refs=("1:2",))}),
    Row("87 kubelet socket elsewhere", argv=("--kubelet-socket", "/k/kubelet.sock"), expect={"kubelet_socket": "/k/kubelet.sock"}),
]  # fmt: skip


def _value(config: object, path: str) -> Any:
    value: Any = config
    for part in path.replace("]", "").replace("[", ".").split("."):
        value = value[int(part)] if part.isdigit() else getattr(value, part)
    return value


def _take(row: Row, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[object | None, str]:
    """(Config or None, the one-line error) for a row, through `gpuvisor run`'s real parser."""
    env = dict(row.env)
    if row.file is not None:
        path = tmp_path / "config.yaml"
        path.write_text(row.file)
        env["CONFIG_FILE"] = str(path)
    try:
        args = build_parser().parse_args(["run", *row.argv])
        return load_config(args, env), ""
    except SystemExit as exc:
        assert exc.code == EXIT_CONFIG_ERROR
        return None, capsys.readouterr().err.strip()
    except ConfigError as exc:
        return None, str(exc)


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_input_taken_as_nvidia_takes_it(row: Row, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each input is accepted with NVIDIA's effective value, or refused with one config-error line, as NVIDIA v0.20.0 does."""
    config, error = _take(row, tmp_path, capsys)
    if row.error is not None:
        assert config is None, f"accepted, but NVIDIA refuses it ({row.error})"
        assert row.error in error and "\n" not in error
        return
    assert config is not None, f"refused: {error}"
    assert row.expect is not None
    for path, expected in row.expect.items():
        assert _value(config, path) == expected, path


def test_ignored_arguments_are_named_in_a_notice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Arguments NVIDIA's flag parsing ignores are accepted, and a notice (a logged warning) names them."""
    config, _ = _take(
        Row("", argv=("--pass-device-specs", "false", "--mig-strategy", "mixed")), tmp_path, capsys
    )
    assert config is not None
    notices = config.notices  # type: ignore[attr-defined]
    assert any(
        '"false" "--mig-strategy" "mixed"' in notice and "--flag=false" in notice for notice in notices
    )


def test_help_and_version_exit_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """`-h`/`--help`, `help` and `-v`/`--version` are urfave/cli's own: they print and exit 0."""
    for argv in (["-h"], ["--help"], ["help"], ["--version"], ["-v"]):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["run", *argv])
        assert info.value.code == 0
    assert "gpuvisor" in capsys.readouterr().out


def test_the_bare_command_answers_version_as_run_does(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuvisor --version` and `gpuvisor -v`, as NVIDIA's binaries answer them, print what
    `gpuvisor run --version` prints and exit 0."""
    printed = []
    for argv in (["--version"], ["-v"], ["run", "--version"]):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(argv)
        assert info.value.code == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] == printed[2]
    assert printed[0].startswith("gpuvisor ") and printed[0].endswith("\n")


def test_every_setting_read_from_the_config_file_names_a_key_of_nvidias_schema() -> None:
    """A setting's config-file key outside gpuvisor's own `gpuvisor.` section is a leaf of the
    schema gpuvisor decodes NVIDIA's config with (flags.*, flags.plugin.*, imex.*), so a typo in
    a key name cannot silently make a setting unreadable from an NVIDIA config file."""
    keys = [s.file_key for s in SETTINGS if s.file_key and not s.file_key.startswith("gpuvisor.")]
    assert len(keys) >= 15
    assert {key: type(leaf_at(key)).__name__ for key in keys} == {key: "Leaf" for key in keys}
    assert leaf_at("flags.plugin.noSuchKey") is None and leaf_at("flags.migStrategy.deeper") is None
    assert isinstance(leaf_at("flags.migStrategy"), Leaf)
