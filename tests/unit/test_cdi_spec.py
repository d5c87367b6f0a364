"""Tests of supervisor.cdi.spec: the spec's content per device-ID strategy, MIG capability nodes, replica
collapse, names identical to Allocate's, the validator, atomic replacement, YAML, nvidia-ctk."""

from __future__ import annotations

import copy
import json
import logging
import os
import stat
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.model import ResourcePlan
from supervisor.cdi import spec as cdi
from supervisor.cdi.strategy import cdi_plans
from supervisor.config import Config, config_from_data, parse_config_text
from supervisor.node.planning import plan_resources
from tests import nodes
from worker.allocate import Allocator

KIND = "k8s.device-plugin.nvidia.com/gpu"


# A driver root with no driver: these tests pin the device nodes, wherever they run (a machine
# with a driver at / would add its files); test_claim_cdi.py covers the driver's files.
NO_DRIVER = "/nonexistent/gpuvisor-test-driver-root"


def cfg(text: str = "", **flags: object) -> Config:
    flags.setdefault("driver_root", NO_DRIVER)
    return config_from_data(parse_config_text(text, "test.yaml"), flags=flags, source="test.yaml")


def make_dev_root(tmp_path: Path, *control: str) -> str:
    root = tmp_path / "devroot"
    (root / "dev").mkdir(parents=True, exist_ok=True)
    for name in control:
        (root / "dev" / name).write_text("")
    return str(root)


def write_minors(tmp_path: Path, node_minors: Mapping[int, int]) -> str:
    """A mig-minors file: for GPU minor g and GI n (CI 0), access minors 100*g + 2n and 100*g + 2n + 1."""
    lines = ["config 1", "monitor 2"]
    for gpu_minor, count in node_minors.items():
        for gi in range(1, count + 1):
            lines.append(f"gpu{gpu_minor}/gi{gi}/access {100 * gpu_minor + 2 * gi}")
            lines.append(f"gpu{gpu_minor}/gi{gi}/ci0/access {100 * gpu_minor + 2 * gi + 1}")
    path = tmp_path / "mig-minors"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def device(spec: Mapping[str, Any], name: str) -> dict[str, Any]:
    matches = [d for d in spec["devices"] if d["name"] == name]
    assert len(matches) == 1, name
    found: dict[str, Any] = matches[0]
    return found


def node_paths(entry: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    return [(n["path"], n["hostPath"], n["permissions"]) for n in entry["containerEdits"]["deviceNodes"]]


# --- content ------------------------------------------------------------------------------------


def test_uuid_strategy_spec(tmp_path: Path) -> None:
    """Uuid strategy: one device per GPU UUID with its node under the dev root; existing control nodes and void env spec-wide."""
    root = make_dev_root(tmp_path, "nvidiactl", "nvidia-uvm")
    node = nodes.pcie_l4()
    plans = plan_resources(node, cfg(device_list_strategy="cdi-annotations", dev_root=root))
    spec = cdi.build_spec(plans)
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == KIND
    assert [d["name"] for d in spec["devices"]] == [g.uuid for g in node.gpus]
    assert node_paths(device(spec, node.gpus[2].uuid)) == [("/dev/nvidia2", f"{root}/dev/nvidia2", "rw")]
    assert spec["containerEdits"] == {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [
            # In the order of NVIDIA's spec (the toolkit's sorter: by path depth, then path).
            {"path": "/dev/nvidia-uvm", "hostPath": f"{root}/dev/nvidia-uvm", "permissions": "rw"},
            {"path": "/dev/nvidiactl", "hostPath": f"{root}/dev/nvidiactl", "permissions": "rw"},
        ],
    }
    cdi.validate_spec(spec)


def test_index_strategy_with_mig_caps_nodes(tmp_path: Path) -> None:
    """Index strategy under mixed MIG: `i` and `i:j` devices; a MIG device has its GPU node, then its GI and CI cap nodes."""
    root = make_dev_root(tmp_path)
    minors = write_minors(tmp_path, {0: 7, 1: 3, 2: 2, 3: 3})
    node = nodes.mig_a100()
    plans = plan_resources(
        node,
        cfg(mig_strategy="mixed", device_list_strategy="cdi-cri", device_id_strategy="index", dev_root=root,
            mig_minors_path=minors),
    )  # fmt: skip
    spec = cdi.build_spec(plans)
    names = {d["name"] for d in spec["devices"]}
    assert names == {"4", "5", "6", "7"} | {
        f"{g}:{j}" for g, n in {0: 7, 1: 3, 2: 2, 3: 3}.items() for j in range(n)
    }
    mig = node.gpus[1].mig_devices[2]  # gi_id 3 in tests.nodes
    assert node_paths(device(spec, "1:2")) == [
        ("/dev/nvidia1", f"{root}/dev/nvidia1", "rw"),
        (
            f"/dev/nvidia-caps/nvidia-cap{100 + 2 * mig.gi_id}",
            f"{root}/dev/nvidia-caps/nvidia-cap{100 + 2 * mig.gi_id}",
            "rw",
        ),
        (
            f"/dev/nvidia-caps/nvidia-cap{101 + 2 * mig.gi_id}",
            f"{root}/dev/nvidia-caps/nvidia-cap{101 + 2 * mig.gi_id}",
            "rw",
        ),
    ]
    assert node_paths(device(spec, "5")) == [("/dev/nvidia5", f"{root}/dev/nvidia5", "rw")]
    assert "deviceNodes" not in spec["containerEdits"]  # no control node exists under this dev root
    cdi.validate_spec(spec)


def test_replicas_collapse_to_one_cdi_device(tmp_path: Path) -> None:
    """Every replica of a GPU is the same CDI device: one entry per backing device, under both strategies."""
    root = make_dev_root(tmp_path)
    node = nodes.pcie_l4()
    text = "sharing: {timeSlicing: {resources: [{name: gpu, devices: [0, 1], replicas: 4}]}}"
    for strategy, expected in (("uuid", [g.uuid for g in node.gpus]), ("index", ["0", "1", "2", "3"])):
        plans = plan_resources(
            node, cfg(text, device_list_strategy="cdi-cri", device_id_strategy=strategy, dev_root=root)
        )
        assert len(plans["nvidia.com/gpu"].devices) == 10
        assert [d["name"] for d in cdi.build_spec(plans)["devices"]] == expected


@pytest.mark.parametrize("id_strategy", ["uuid", "index"])
@pytest.mark.parametrize("mig_strategy", ["none", "mixed"])
def test_spec_names_every_device_allocate_hands_out(
    tmp_path: Path, id_strategy: str, mig_strategy: str
) -> None:
    """Each CDI name worker/allocate.py puts in a response is a device of the spec, and nothing more is listed."""
    root = make_dev_root(tmp_path, "nvidiactl")
    minors = write_minors(tmp_path, {0: 7, 1: 3, 2: 2, 3: 3})
    text = "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 3}]}}"
    plans = plan_resources(
        nodes.mig_a100(),
        cfg(text, mig_strategy=mig_strategy, device_list_strategy="cdi-annotations,cdi-cri",
            device_id_strategy=id_strategy, dev_root=root, mig_minors_path=minors),
    )  # fmt: skip
    spec = cdi.build_spec(plans)
    in_spec = {f"{KIND}={d['name']}" for d in spec["devices"]}
    handed_out: set[str] = set()
    for plan in plans.values():
        allocator = Allocator(plan)
        for dev in plan.devices:
            handed_out.update(allocator.allocate([dev.id]).cdi_devices)
    assert handed_out == in_spec
    assert sorted(in_spec) == list(cdi.cdi_names(plans))


def test_mig_minors_unreadable_is_a_clear_error(tmp_path: Path) -> None:
    """A MIG device whose capability minors cannot be read fails the build with the device and file named."""
    plans = plan_resources(
        nodes.mig_uniform(1, per_gpu=1),
        cfg(mig_strategy="single", device_list_strategy="cdi-cri", mig_minors_path=str(tmp_path / "nope")),
    )
    with pytest.raises(cdi.CdiError, match=r"MIG device MIG-\S+ \(index 0:0\) of nvidia.com/gpu needs its "
                       r"capability device nodes, but the MIG minors file .*/nope cannot be read"):  # fmt: skip
        cdi.build_spec(plans)
    (tmp_path / "partial").write_text("gpu0/gi1/access 12\n")
    plans = plan_resources(
        nodes.mig_uniform(1, per_gpu=1),
        cfg(mig_strategy="single", device_list_strategy="cdi-cri", mig_minors_path=str(tmp_path / "partial")),
    )
    with pytest.raises(cdi.CdiError, match=r"no entry 'gpu0/gi1/ci0/access' in the MIG minors file"):
        cdi.build_spec(plans)


@pytest.mark.parametrize(
    ("strategies", "needed"),
    [
        ("envvar", False),
        ("volume-mounts", False),
        ("cdi-annotations", True),
        ("cdi-cri", True),
        ("envvar,cdi-cri", True),
    ],
)
def test_cdi_plans(strategies: str, needed: bool) -> None:
    """CDI is needed exactly when a plan's list strategies include cdi-annotations or cdi-cri."""
    plans = plan_resources(nodes.pcie_l4(), cfg(device_list_strategy=strategies))
    assert bool(cdi_plans(plans)) is needed
    assert cdi_plans({}) == []


# --- validation ---------------------------------------------------------------------------------


def good_spec() -> dict[str, Any]:
    return {
        "cdiVersion": "0.5.0",
        "kind": KIND,
        "devices": [
            {
                "name": "GPU-0",
                "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0"}]},
            },
            {"name": "0:1", "containerEdits": {"env": ["A=1"]}},
        ],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": "/dev/nvidiactl"}],
        },
    }


def mutate(path: str, value: object) -> dict[str, Any]:
    spec = good_spec()
    target: Any = spec
    *parents, leaf = path.split(".")
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    if value is _DELETE:
        del target[int(leaf) if leaf.isdigit() else leaf]
    else:
        target[int(leaf) if leaf.isdigit() else leaf] = value
    return spec


_DELETE = object()


def test_valid_spec_passes() -> None:
    """The hand-written valid spec has no problems."""
    assert cdi.spec_problems(good_spec()) == []


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        ("cdiVersion", "0.5", "cdiVersion '0.5': must be a semantic version"),
        ("cdiVersion", "9.0.0", "cdiVersion '9.0.0': unknown CDI spec version"),
        (
            "cdiVersion",
            "0.4.0",
            "devices[0].containerEdits.deviceNodes[0].hostPath: needs cdiVersion 0.5.0 or later",
        ),
        ("kind", "gpu", "kind 'gpu': must be <vendor>/<class>"),
        ("kind", "vendor.com/", "kind 'vendor.com/': must be <vendor>/<class>"),
        ("kind", "vendor.com/a/b", "kind 'vendor.com/a/b': must be <vendor>/<class>"),
        ("kind", "1vendor.com/gpu", "kind '1vendor.com/gpu'"),
        ("kind", "vendor.com/" + "g" * 64, "the class must be at most 63 characters"),
        ("devices", [], "devices: must list at least one device"),
        ("devices.0.name", "GPU/0", "devices[0].name 'GPU/0': must start and end with a letter or digit"),
        ("devices.0.name", "-GPU", "devices[0].name '-GPU'"),
        ("devices.0.name", "GPU:", "devices[0].name 'GPU:'"),
        ("devices.1.name", "GPU-0", "devices[1].name 'GPU-0': listed twice"),
        (
            "devices.1.containerEdits",
            {},
            "devices[1].containerEdits: a device's container edits must not be empty",
        ),
        ("devices.1.containerEdits", _DELETE, "devices[1].containerEdits: a device needs container edits"),
        (
            "devices.0.containerEdits.deviceNodes.0.path",
            "dev/nvidia0",
            "deviceNodes[0].path 'dev/nvidia0': must be an absolute path",
        ),
        (
            "devices.0.containerEdits.deviceNodes.0.hostPath",
            "rel",
            "deviceNodes[0].hostPath 'rel': must be an absolute path",
        ),
        ("devices.0.containerEdits.deviceNodes.0.path", "", "deviceNodes[0].path: must be a non-empty path"),
        (
            "devices.0.containerEdits.deviceNodes.0.permissions",
            "rwx",
            "permissions 'rwx': must be made of r, w and m",
        ),
        ("devices.0.containerEdits.deviceNodes.0.type", "x", "type 'x': must be one of b, c, u, p"),
        (
            "devices.1.containerEdits.env",
            ["=1"],
            "devices[1].containerEdits.env[0] '=1': not of the form NAME=VALUE",
        ),
        ("containerEdits.env", ["VOID"], "containerEdits.env[0] 'VOID': not of the form NAME=VALUE"),
        (
            "containerEdits.hooks",
            [{"hookName": "boot", "path": "/x"}],
            "containerEdits.hooks[0].hookName 'boot'",
        ),
        (
            "containerEdits.hooks",
            [{"hookName": "createContainer", "path": "x"}],
            "hooks[0].path 'x': must be an absolute path",
        ),
        (
            "containerEdits.mounts",
            [{"hostPath": "/a"}],
            "containerEdits.mounts[0].containerPath: must be a non-empty path",
        ),
    ],
)
def test_validator_rejects(path: str, value: object, problem: str) -> None:
    """Each broken CDI rule is reported with where it is and why; validate_spec raises with all of them."""
    spec = mutate(path, value)
    problems = cdi.spec_problems(spec)
    assert any(problem in p for p in problems), problems
    with pytest.raises(cdi.CdiError, match=r"^invalid CDI spec: "):
        cdi.validate_spec(spec)


def test_validator_rejects_non_mapping() -> None:
    """A spec that is not a mapping at all is refused."""
    assert cdi.spec_problems(["x"]) == ["the spec must be a mapping"]


# --- files --------------------------------------------------------------------------------------


def plans_for(tmp_path: Path, **flags: object) -> dict[str, ResourcePlan]:
    flags.setdefault("device_list_strategy", "cdi-cri")
    flags.setdefault("dev_root", make_dev_root(tmp_path, "nvidiactl"))
    return plan_resources(nodes.pcie_l4(), config_from_data(None, flags=flags, source="test"))


def test_write_is_atomic_and_replaces(tmp_path: Path) -> None:
    """The spec is written at its fixed path, mode 0644, replacing the old one; a racing reader always sees a whole file."""
    spec_dir = tmp_path / "cdi"
    path = cdi.write_spec(cdi.build_spec(plans_for(tmp_path)), str(spec_dir))
    assert path == str(spec_dir / "k8s.device-plugin.nvidia.com-gpu.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    first = json.loads(Path(path).read_text())

    index_spec = cdi.build_spec(plans_for(tmp_path / "b", device_id_strategy="index"))
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.append(len(json.loads(Path(path).read_text())["devices"]))
            except BaseException as exc:  # a partial file would fail to parse
                errors.append(exc)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for n in range(40):
            cdi.write_spec(index_spec if n % 2 else first, str(spec_dir))
    finally:
        stop.set()
        thread.join()
    assert errors == [] and seen
    assert json.loads(Path(path).read_text()) == index_spec
    assert sorted(os.listdir(spec_dir)) == ["k8s.device-plugin.nvidia.com-gpu.json"]


def test_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the rename fails the old spec stays untouched, the temp file is removed, and the error is clear."""
    spec_dir = tmp_path / "cdi"
    path = cdi.write_spec(cdi.build_spec(plans_for(tmp_path)), str(spec_dir))
    before = Path(path).read_text()

    def broken(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(
        cdi.CdiError, match=r"^cannot write the CDI spec .*-gpu.json: No space left on device$"
    ):
        cdi.write_spec(cdi.build_spec(plans_for(tmp_path / "b", device_id_strategy="index")), str(spec_dir))
    assert Path(path).read_text() == before
    assert os.listdir(spec_dir) == ["k8s.device-plugin.nvidia.com-gpu.json"]


def test_invalid_spec_is_never_written(tmp_path: Path) -> None:
    """write_spec validates first: an invalid spec raises and no file appears."""
    spec = good_spec()
    spec["devices"][0]["name"] = "bad/name"
    with pytest.raises(cdi.CdiError, match="bad/name"):
        cdi.write_spec(spec, str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_yaml_variant_replaces_json(tmp_path: Path) -> None:
    """The yaml format writes <base>.yaml and removes our .json (two files of one kind break the kind), and back."""
    spec = cdi.build_spec(plans_for(tmp_path))
    spec_dir = str(tmp_path / "cdi")
    cdi.write_spec(spec, spec_dir, "json")
    path = cdi.write_spec(spec, spec_dir, "yaml")
    assert path.endswith("k8s.device-plugin.nvidia.com-gpu.yaml")
    assert yaml.safe_load(Path(path).read_text()) == spec
    assert os.listdir(spec_dir) == ["k8s.device-plugin.nvidia.com-gpu.yaml"]
    cdi.write_spec(spec, spec_dir, "json")
    assert os.listdir(spec_dir) == ["k8s.device-plugin.nvidia.com-gpu.json"]
    with pytest.raises(cdi.CdiError, match="unknown CDI spec format 'toml'"):
        cdi.CdiSpecWriter(spec_dir, fmt="toml")


def test_writer_sync_replaces_on_reload_and_leaves_file_without_cdi(tmp_path: Path) -> None:
    """sync rewrites the spec only on change and never deletes it, even when no plan uses CDI any more."""
    spec_dir = tmp_path / "cdi"
    writer = cdi.CdiSpecWriter(str(spec_dir))
    path = writer.sync(plans_for(tmp_path))
    assert path is not None and writer.source == "gpuvisor"
    inode = os.stat(path).st_ino
    assert writer.sync(plans_for(tmp_path)) == path
    assert os.stat(path).st_ino == inode  # unchanged spec: not rewritten
    writer.sync(plans_for(tmp_path / "b", device_id_strategy="index"))
    assert os.stat(path).st_ino != inode
    assert [d["name"] for d in json.loads(Path(path).read_text())["devices"]] == ["0", "1", "2", "3"]
    assert writer.sync(plan_resources(nodes.pcie_l4(), cfg())) is None
    assert os.path.exists(path)
    assert not any(name for name in dir(cdi) if "remove" in name or "delete" in name)


# --- nvidia-ctk -----------------------------------------------------------------------------------


class FakeCtk:
    """Stands in for subprocess.run of `nvidia-ctk cdi generate`: records argv, writes a spec to --output."""

    def __init__(self, names: list[str], returncode: int = 0, kind: str = KIND) -> None:
        self.names = names
        self.returncode = returncode
        self.kind = kind
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--"))
        if self.returncode == 0:
            spec = {
                "cdiVersion": "0.6.0",
                "kind": self.kind,
                "devices": [
                    {"name": n, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}
                    for n in [*self.names, "all"]
                ],
                "containerEdits": {
                    "env": ["NVIDIA_VISIBLE_DEVICES=void"],
                    "hooks": [
                        {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook", "args": ["x"]}
                    ],
                    "mounts": [
                        {"hostPath": "/usr/lib/libcuda.so.1", "containerPath": "/usr/lib/libcuda.so.1"}
                    ],
                },
            }
            text = yaml.safe_dump(spec) if opts["format"] == "yaml" else json.dumps(spec)
            Path(opts["output"]).write_text(text)
            return subprocess.CompletedProcess(argv, 0, "", "")
        return subprocess.CompletedProcess(
            argv, self.returncode, "", "ERRO[0000] failed to initialize NVML\n"
        )


def ctk_binary(tmp_path: Path) -> str:
    path = tmp_path / "nvidia-ctk"
    path.write_text("#!/bin/sh\nexit 1\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_nvidia_ctk_delegation(tmp_path: Path, fmt: str) -> None:
    """With nvidia-ctk present, it writes the spec with our vendor, class, naming and driver root; we install it."""
    ctk = ctk_binary(tmp_path)
    plans = plans_for(tmp_path, device_id_strategy="index", nvidia_cdi_hook_path=ctk, driver_root="/run/nvidia/driver",
                      dev_root="/run/nvidia/driver")  # fmt: skip
    fake = FakeCtk(["0", "1", "2", "3"])
    writer = cdi.CdiSpecWriter(str(tmp_path / "cdi"), fmt=fmt, use_nvidia_ctk=True, runner=fake)
    path = writer.sync(plans)
    assert path == str(tmp_path / "cdi" / f"k8s.device-plugin.nvidia.com-gpu.{fmt}")
    assert writer.source == "nvidia-ctk"
    argv = fake.calls[0]
    assert argv[:3] == [ctk, "cdi", "generate"]
    assert {f"--format={fmt}", "--vendor=k8s.device-plugin.nvidia.com", "--class=gpu", "--device-name-strategy=index",
            "--driver-root=/run/nvidia/driver"} <= set(argv)  # fmt: skip
    loaded = yaml.safe_load(Path(path).read_text())
    assert loaded["containerEdits"]["hooks"][0]["path"] == "/usr/bin/nvidia-cdi-hook"
    assert os.listdir(tmp_path / "cdi") == [os.path.basename(path)]  # the private work dir is gone


@pytest.mark.parametrize(
    ("fake", "why"),
    [
        (FakeCtk([], returncode=1), "exited with status 1: ERRO[0000] failed to initialize NVML"),
        (FakeCtk(["0", "1"]), "lacks device(s) 2, 3 that Allocate hands out"),
        (FakeCtk(["0", "1", "2", "3"], kind="nvidia.com/gpu"), "has kind 'nvidia.com/gpu'"),
    ],
)
def test_nvidia_ctk_failure_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fake: FakeCtk, why: str
) -> None:
    """When nvidia-ctk fails or its spec lacks our names or kind, our own spec is written and a warning says why."""
    plans = plans_for(tmp_path, device_id_strategy="index", nvidia_cdi_hook_path=ctk_binary(tmp_path))
    writer = cdi.CdiSpecWriter(str(tmp_path / "cdi"), use_nvidia_ctk=True, runner=fake)
    with caplog.at_level(logging.WARNING, logger="gpuvisor.cdi"):
        path = writer.sync(plans)
    assert path is not None and writer.source == "gpuvisor"
    assert [d["name"] for d in json.loads(Path(path).read_text())["devices"]] == ["0", "1", "2", "3"]
    assert any(
        why in r.getMessage() and "writing gpuvisor's own CDI spec" in r.getMessage() for r in caplog.records
    )
    assert os.listdir(tmp_path / "cdi") == ["k8s.device-plugin.nvidia.com-gpu.json"]


def test_nvidia_ctk_missing_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No nvidia-ctk at the configured path nor on PATH: the own spec is written, and the log says so."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    plans = plans_for(tmp_path, nvidia_cdi_hook_path=str(tmp_path / "no-such-ctk"))
    fake = FakeCtk([])
    writer = cdi.CdiSpecWriter(str(tmp_path / "cdi"), use_nvidia_ctk=True, runner=fake)
    with caplog.at_level(logging.WARNING, logger="gpuvisor.cdi"):
        assert writer.sync(plans) is not None
    assert fake.calls == [] and writer.source == "gpuvisor"
    assert any("nvidia-ctk not found" in r.getMessage() for r in caplog.records)


def test_own_spec_is_deep_copy_safe(tmp_path: Path) -> None:
    """build_spec returns fresh data each call: changing one result does not change the next."""
    plans = plans_for(tmp_path)
    first = cdi.build_spec(plans)
    second = copy.deepcopy(first)
    first["devices"].clear()
    assert cdi.build_spec(plans) == second


def test_imex_channels_get_their_own_cdi_spec_as_nvidia_writes_it(tmp_path: Path) -> None:
    """With CDI and an IMEX channel whose node exists, an imex-channel spec names it by its ID with
    its device node (NVIDIA internal/cdi/imex.go), so Allocate's imex-channel=0 name resolves."""
    config = config_from_data(
        {
            "version": "v1",
            "flags": {"plugin": {"deviceListStrategy": ["cdi-cri"]}},
            "imex": {"channelIDs": [0]},
        }
    )
    plans = plan_resources(nodes.pcie_l4(), config)
    spec = cdi.build_imex_spec(plans, problem=lambda path: None)
    assert spec is not None and spec["kind"] == "k8s.device-plugin.nvidia.com/imex-channel"
    assert spec["devices"] == [
        {
            "name": "0",
            "containerEdits": {
                "deviceNodes": [
                    {
                        "path": "/dev/nvidia-caps-imex-channels/channel0",
                        "hostPath": "/dev/nvidia-caps-imex-channels/channel0",
                    }
                ]
            },
        }
    ]
    path = cdi.write_spec(spec, str(tmp_path))
    assert path.endswith("k8s.device-plugin.nvidia.com-imex-channel.json")
    assert cdi.build_imex_spec(plans, problem=lambda path: f"{path} does not exist") is None  # missing: none
