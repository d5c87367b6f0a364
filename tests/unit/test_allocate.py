"""Tests for worker.allocate: NVIDIA-compatible Allocate responses, byte for byte, per strategy."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

import pytest

from common.devnodes import host_path, read_mig_minors
from common.model import AllocatableDevice, AllocateSettings, ResourcePlan
from worker.allocate import AllocationError, Allocator, ContainerResponse, DeviceSpec, Mount

FIXED_UUID = "12345678-1234-5678-1234-567812345678"
ANNOTATION = f"cdi.k8s.io/nvidia-device-plugin_{FIXED_UUID}"
VMR = "/var/run/nvidia-container-devices"


def gpu(
    i: int, *, minor: int | None = None, replica: int | None = None, replicas: int = 1
) -> AllocatableDevice:
    uid = f"GPU-{i:04d}"
    return AllocatableDevice(
        id=uid if replica is None else f"{uid}::{replica}",
        uuid=uid,
        index=str(i),
        gpu_uuid=uid,
        gpu_index=i,
        gpu_minor=i if minor is None else minor,
        numa_node=0,
        memory_mib=16384,
        replica=replica,
        replicas=replicas,
    )


def mig(i: int, j: int, gi: int, ci: int, *, minor: int | None = None) -> AllocatableDevice:
    return AllocatableDevice(
        id=f"MIG-{i}{j}",
        uuid=f"MIG-{i}{j}",
        index=f"{i}:{j}",
        gpu_uuid=f"GPU-{i:04d}",
        gpu_index=i,
        gpu_minor=i if minor is None else minor,
        numa_node=0,
        memory_mib=10240,
        mig_gi=gi,
        mig_ci=ci,
        mig_profile="1g.10gb",
    )


GPUS = (gpu(0), gpu(1), gpu(2))
REPLICAS = tuple(gpu(i, replica=r, replicas=4) for i in range(2) for r in range(4))
MIGS = (mig(0, 0, 1, 0), mig(0, 1, 2, 0), mig(1, 0, 1, 0, minor=3))


def plan(
    devices: tuple[AllocatableDevice, ...] = GPUS,
    *,
    resource: str = "nvidia.com/gpu",
    sharing: str = "none",
    fail: bool = False,
    **settings: Any,
) -> ResourcePlan:
    return ResourcePlan(
        resource=resource,
        devices=devices,
        sharing=sharing,
        fail_requests_greater_than_one=fail,
        allocate=AllocateSettings(**settings),
    )


def allocator(p: ResourcePlan, existing: frozenset[str] = frozenset()) -> Allocator:
    # Every IMEX channel node exists here; tests/unit/test_imex.py covers the missing ones.
    return Allocator(
        p,
        uuid_factory=lambda: FIXED_UUID,
        exists=lambda path: path in existing,
        imex_problem=lambda path: None,
    )


def strategies(*names: str) -> dict[str, Any]:
    return {"device_list_strategies": names}


def envs(value: str) -> dict[str, str]:
    return {"NVIDIA_VISIBLE_DEVICES": value}


def vm(*ids: str) -> tuple[Mount, ...]:
    return tuple(Mount(f"{VMR}/{i}", "/dev/null", False) for i in ids)


LIST_CASES: list[tuple[str, ResourcePlan, list[str], ContainerResponse]] = [
    (
        "envvar uuid, request order",
        plan(),
        ["GPU-0002", "GPU-0000"],
        ContainerResponse(envs("GPU-0002,GPU-0000")),
    ),
    (
        "envvar index",
        plan(device_id_strategy="index"),
        ["GPU-0002", "GPU-0000"],
        ContainerResponse(envs("2,0")),
    ),
    (
        "replicas: ::n stripped, first occurrence kept",
        plan(REPLICAS, sharing="time-slicing"),
        ["GPU-0001::3", "GPU-0000::2", "GPU-0001::0"],
        ContainerResponse(envs("GPU-0001,GPU-0000")),
    ),
    (
        "replicas, index strategy",
        plan(REPLICAS, sharing="time-slicing", device_id_strategy="index"),
        ["GPU-0001::3", "GPU-0001::0"],
        ContainerResponse(envs("1")),
    ),
    ("MIG uuid", plan(MIGS), ["MIG-01", "MIG-10"], ContainerResponse(envs("MIG-01,MIG-10"))),
    (
        "MIG index i:j",
        plan(MIGS, device_id_strategy="index"),
        ["MIG-01", "MIG-10"],
        ContainerResponse(envs("0:1,1:0")),
    ),
    (
        "volume-mounts",
        plan(**strategies("volume-mounts")),
        ["GPU-0001", "GPU-0000"],
        ContainerResponse(envs(VMR), vm("GPU-0001", "GPU-0000")),
    ),
    (
        "envvar + volume-mounts: volume-mounts wins the env var",
        plan(**strategies("envvar", "volume-mounts")),
        ["GPU-0001"],
        ContainerResponse(envs(VMR), vm("GPU-0001")),
    ),
    (
        "volume-mounts, index strategy MIG",
        plan(MIGS, device_id_strategy="index", **strategies("volume-mounts")),
        ["MIG-10"],
        ContainerResponse(envs(VMR), vm("1:0")),
    ),
    (
        "cdi-annotations only: no NVIDIA_VISIBLE_DEVICES",
        plan(**strategies("cdi-annotations")),
        ["GPU-0001", "GPU-0000"],
        ContainerResponse(
            annotations={
                ANNOTATION: "k8s.device-plugin.nvidia.com/gpu=GPU-0001,k8s.device-plugin.nvidia.com/gpu=GPU-0000"
            }
        ),
    ),
    (
        "cdi-cri only",
        plan(**strategies("cdi-cri")),
        ["GPU-0001", "GPU-0000"],
        ContainerResponse(
            cdi_devices=(
                "k8s.device-plugin.nvidia.com/gpu=GPU-0001",
                "k8s.device-plugin.nvidia.com/gpu=GPU-0000",
            )
        ),
    ),
    (
        "both CDI strategies, custom prefix, index strategy",
        plan(
            device_id_strategy="index",
            cdi_annotation_prefix="example.com/",
            **strategies("cdi-annotations", "cdi-cri"),
        ),
        ["GPU-0002"],
        ContainerResponse(
            annotations={
                f"example.com/nvidia-device-plugin_{FIXED_UUID}": "k8s.device-plugin.nvidia.com/gpu=2"
            },
            cdi_devices=("k8s.device-plugin.nvidia.com/gpu=2",),
        ),
    ),
    (
        "envvar + cdi-cri: both",
        plan(**strategies("envvar", "cdi-cri")),
        ["GPU-0000"],
        ContainerResponse(envs("GPU-0000"), cdi_devices=("k8s.device-plugin.nvidia.com/gpu=GPU-0000",)),
    ),
    (
        "CDI vendor and class come from the plan",
        plan(cdi_vendor="example.com", cdi_class="mig", **strategies("cdi-cri")),
        ["GPU-0000"],
        ContainerResponse(cdi_devices=("example.com/mig=GPU-0000",)),
    ),
    (
        "replicas under CDI: de-duplicated names",
        plan(REPLICAS, sharing="time-slicing", **strategies("cdi-cri")),
        ["GPU-0000::1", "GPU-0000::2"],
        ContainerResponse(cdi_devices=("k8s.device-plugin.nvidia.com/gpu=GPU-0000",)),
    ),
]


@pytest.mark.parametrize(("name", "p", "ids", "expected"), LIST_CASES, ids=[c[0] for c in LIST_CASES])
def test_device_list_strategies(
    name: str, p: ResourcePlan, ids: list[str], expected: ContainerResponse
) -> None:
    """Each device-list / ID strategy gives exactly NVIDIA's envs, mounts, annotations and CDI names."""
    assert allocator(p).allocate(ids) == expected


FLAG_CASES: list[tuple[str, ResourcePlan, ContainerResponse]] = [
    (
        "gds/mofed/gdrcopy with envvar",
        plan(gds_enabled=True, mofed_enabled=True, gdrcopy_enabled=True),
        ContainerResponse(
            {
                "NVIDIA_VISIBLE_DEVICES": "GPU-0000",
                "NVIDIA_GDS": "enabled",
                "NVIDIA_MOFED": "enabled",
                "NVIDIA_GDRCOPY": "enabled",
            }
        ),
    ),
    (
        "gds/mofed/gdrcopy with CDI only: env vars and the =all CDI devices",
        plan(gds_enabled=True, mofed_enabled=True, gdrcopy_enabled=True, **strategies("cdi-cri")),
        ContainerResponse(
            {"NVIDIA_GDS": "enabled", "NVIDIA_MOFED": "enabled", "NVIDIA_GDRCOPY": "enabled"},
            cdi_devices=(
                "k8s.device-plugin.nvidia.com/gpu=GPU-0000",
                "k8s.device-plugin.nvidia.com/gdrcopy=all",
                "k8s.device-plugin.nvidia.com/gds=all",
                "k8s.device-plugin.nvidia.com/mofed=all",
            ),
        ),
    ),
    (
        "gds only",
        plan(gds_enabled=True),
        ContainerResponse({"NVIDIA_VISIBLE_DEVICES": "GPU-0000", "NVIDIA_GDS": "enabled"}),
    ),
    (
        "IMEX with envvar",
        plan(imex_channel_ids=(0, 3)),
        ContainerResponse({"NVIDIA_VISIBLE_DEVICES": "GPU-0000", "NVIDIA_IMEX_CHANNELS": "0,3"}),
    ),
    (
        "IMEX with volume-mounts: one /dev/null mount per channel",
        plan(imex_channel_ids=(0,), **strategies("volume-mounts")),
        ContainerResponse(envs(VMR), (*vm("GPU-0000"), Mount(f"{VMR}/imex/0", "/dev/null"))),
    ),
    (
        "IMEX with CDI annotations",
        plan(imex_channel_ids=(0,), **strategies("cdi-annotations")),
        ContainerResponse(
            annotations={
                ANNOTATION: "k8s.device-plugin.nvidia.com/gpu=GPU-0000,k8s.device-plugin.nvidia.com/imex-channel=0"
            }
        ),
    ),
    (
        "IMEX with device specs: the channel node after the GPUs",
        plan(imex_channel_ids=(2,), pass_device_specs=True, dev_root="/run/nvidia/driver"),
        ContainerResponse(
            {"NVIDIA_VISIBLE_DEVICES": "GPU-0000", "NVIDIA_IMEX_CHANNELS": "2"},
            devices=(
                DeviceSpec("/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0", "rw"),
                DeviceSpec(
                    "/dev/nvidia-caps-imex-channels/channel2",
                    "/run/nvidia/driver/dev/nvidia-caps-imex-channels/channel2",
                    "rw",
                ),
            ),
        ),
    ),
]


@pytest.mark.parametrize(("name", "p", "expected"), FLAG_CASES, ids=[c[0] for c in FLAG_CASES])
def test_feature_flags(name: str, p: ResourcePlan, expected: ContainerResponse) -> None:
    """GDS, MOFED, GDRCopy and IMEX add exactly NVIDIA's env vars, mounts, device nodes and CDI names."""
    assert allocator(p).allocate(["GPU-0000"]) == expected


MPS_PIPE = "/mps/nvidia.com/gpu/pipe"
MPS_MOUNTS = (
    Mount(MPS_PIPE, "/run/nvidia/mps/nvidia.com/gpu/pipe", False),
    Mount("/dev/shm", "/run/nvidia/mps/shm", False),
)


def mps_plan(**settings: Any) -> ResourcePlan:
    return plan(REPLICAS, sharing="mps", fail=True, mps_root="/run/nvidia/mps", **settings)


@pytest.mark.parametrize(
    ("name", "p", "expected"),
    [
        (
            "envvar",
            mps_plan(),
            ContainerResponse(
                {"CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE, "NVIDIA_VISIBLE_DEVICES": "GPU-0001"}, MPS_MOUNTS
            ),
        ),
        (
            "volume-mounts: MPS mounts first",
            mps_plan(**strategies("volume-mounts")),
            ContainerResponse(
                {"CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE, "NVIDIA_VISIBLE_DEVICES": VMR},
                (*MPS_MOUNTS, *vm("GPU-0001")),
            ),
        ),
        (
            "CDI only: MPS still applies",
            mps_plan(**strategies("cdi-cri")),
            ContainerResponse(
                {"CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE},
                MPS_MOUNTS,
                cdi_devices=("k8s.device-plugin.nvidia.com/gpu=GPU-0001",),
            ),
        ),
    ],
)
def test_mps(name: str, p: ResourcePlan, expected: ContainerResponse) -> None:
    """MPS uses the full resource name: /mps/<resource>/pipe in the container, <mpsRoot>/<resource>/pipe and <mpsRoot>/shm on the host."""
    assert allocator(p).allocate(["GPU-0001::2"]) == expected


def test_mps_renamed_resource() -> None:
    """A renamed MPS resource gets its own pipe directory under its full name."""
    p = dataclasses.replace(mps_plan(), resource="nvidia.com/gpu.shared")
    response = allocator(p).allocate(["GPU-0000::0"])
    assert response.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/nvidia.com/gpu.shared/pipe"
    assert response.mounts[0] == Mount(
        "/mps/nvidia.com/gpu.shared/pipe", "/run/nvidia/mps/nvidia.com/gpu.shared/pipe"
    )


@pytest.mark.parametrize(
    ("ids", "visible"),
    [
        (["GPU-0000::0", "GPU-0000::3"], "GPU-0000"),  # two replicas of one GPU: the GPU named once
        (["GPU-0001::1", "GPU-0000::2"], "GPU-0001,GPU-0000"),  # replicas of two GPUs, request order
    ],
)
def test_mps_several_replicas_without_fail_requests(ids: list[str], visible: str) -> None:
    """MPS with failRequestsGreaterThanOne: false serves several replicas: the GPUs in NVIDIA_VISIBLE_DEVICES, the pipe and shm mounts."""
    # NVIDIA internal/rm/rm.go:101-104 checks the flag for MPS as for time-slicing; the MPS
    # response (internal/plugin/mps.go:74-90, server.go:335-358) does not depend on the count.
    p = dataclasses.replace(mps_plan(), fail_requests_greater_than_one=False)
    expected = ContainerResponse(
        {"CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE, "NVIDIA_VISIBLE_DEVICES": visible}, MPS_MOUNTS
    )
    assert allocator(p).allocate(ids) == expected


def test_mps_fail_requests_greater_than_one_refuses_two() -> None:
    """MPS with failRequestsGreaterThanOne (its default) refuses two replicas with NVIDIA's text."""
    with pytest.raises(AllocationError) as info:
        allocator(mps_plan()).allocate(["GPU-0000::0", "GPU-0001::0"])
    assert str(info.value) == (
        'invalid allocation request for "nvidia.com/gpu": invalid request: maximum request size for shared resources is 1; found 2'
    )


def test_empty_device_list_strategies_pass_no_devices() -> None:
    """`deviceListStrategy: []` (valid for NVIDIA) gives neither NVIDIA_VISIBLE_DEVICES nor device specs, only the feature envs."""
    # api/config/v1/strategy.go:62-69: AllCDIEnabled() is true for no strategy at all, so
    # internal/plugin/server.go:351-353 returns before the envvar, mounts and device specs.
    p = plan(device_list_strategies=(), pass_device_specs=True, gds_enabled=True)
    assert allocator(p, frozenset({"/dev/nvidiactl"})).allocate(["GPU-0000"]) == ContainerResponse(
        {"NVIDIA_GDS": "enabled"}
    )


def test_mps_needs_root() -> None:
    """An MPS plan without mps_root is refused at construction with a message naming the resource."""
    with pytest.raises(ValueError, match=r"'nvidia.com/gpu': MPS sharing needs allocate.mps_root"):
        Allocator(plan(REPLICAS, sharing="mps"))


CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


@pytest.mark.parametrize(
    ("name", "dev_root", "existing", "ids", "expected"),
    [
        (
            "all control nodes, dev root /",
            "/",
            frozenset(CONTROL),
            ["GPU-0002", "GPU-0000"],
            [(p, p) for p in CONTROL] + [("/dev/nvidia2", "/dev/nvidia2"), ("/dev/nvidia0", "/dev/nvidia0")],
        ),
        (
            "only existing control nodes, checked under the dev root",
            "/run/nvidia/driver/",
            frozenset(
                {
                    "/run/nvidia/driver/dev/nvidiactl",
                    "/run/nvidia/driver/dev/nvidia-modeset",
                    "/dev/nvidia-uvm",
                }
            ),
            ["GPU-0001"],
            [
                ("/dev/nvidiactl", "/run/nvidia/driver/dev/nvidiactl"),
                ("/dev/nvidia-modeset", "/run/nvidia/driver/dev/nvidia-modeset"),
                ("/dev/nvidia1", "/run/nvidia/driver/dev/nvidia1"),
            ],
        ),
        ("no control nodes", "/", frozenset(), ["GPU-0001"], [("/dev/nvidia1", "/dev/nvidia1")]),
    ],
)
def test_device_specs(
    name: str, dev_root: str, existing: frozenset[str], ids: list[str], expected: list[tuple[str, str]]
) -> None:
    """pass_device_specs: rw control nodes that exist, then /dev/nvidia<minor> per GPU; host path = dev root + path."""
    response = allocator(plan(pass_device_specs=True, dev_root=dev_root), existing).allocate(ids)
    assert response.devices == tuple(DeviceSpec(c, h, "rw") for c, h in expected)


def test_device_specs_minor_not_index() -> None:
    """The device node follows the GPU's minor number, not its index."""
    p = plan((gpu(0, minor=5),), pass_device_specs=True)
    assert allocator(p).allocate(["GPU-0000"]).devices == (DeviceSpec("/dev/nvidia5", "/dev/nvidia5", "rw"),)


def test_device_specs_replicas_one_node_per_gpu() -> None:
    """Several replicas of one GPU give its device node once."""
    p = plan(REPLICAS, sharing="time-slicing", pass_device_specs=True)
    response = allocator(p).allocate(["GPU-0001::0", "GPU-0001::3", "GPU-0000::1"])
    assert [d.container_path for d in response.devices] == ["/dev/nvidia1", "/dev/nvidia0"]


def test_device_specs_not_with_cdi_only() -> None:
    """With only CDI strategies NVIDIA returns before device specs: none are passed."""
    p = plan(pass_device_specs=True, **strategies("cdi-annotations"))
    assert allocator(p, frozenset(CONTROL)).allocate(["GPU-0000"]).devices == ()


MIG_MINORS = """config 1
monitor 2
gpu0/gi1/access 12
gpu0/gi1/ci0/access 13
gpu0/gi2/access 21
gpu0/gi2/ci0/access 22
gpu3/gi1/access 336
gpu3/gi1/ci0/access 337
"""


def mig_plan(path: Path, **settings: Any) -> ResourcePlan:
    return plan(MIGS, pass_device_specs=True, mig_minors_path=str(path), **settings)


def test_mig_device_specs(tmp_path: Path) -> None:
    """A MIG device passes its parent GPU node, then its GI and CI capability nodes from the minors file."""
    minors = tmp_path / "mig-minors"
    minors.write_text(MIG_MINORS)
    response = allocator(mig_plan(minors, dev_root="/host"), frozenset({"/host/dev/nvidiactl"})).allocate(
        ["MIG-01", "MIG-00", "MIG-10"]
    )
    assert response.devices == tuple(
        DeviceSpec(c, "/host" + c, "rw")
        for c in (
            "/dev/nvidiactl",
            "/dev/nvidia0",
            "/dev/nvidia-caps/nvidia-cap21",
            "/dev/nvidia-caps/nvidia-cap22",
            "/dev/nvidia-caps/nvidia-cap12",
            "/dev/nvidia-caps/nvidia-cap13",
            "/dev/nvidia3",
            "/dev/nvidia-caps/nvidia-cap336",
            "/dev/nvidia-caps/nvidia-cap337",
        )
    )


def test_mig_minors_missing_file(tmp_path: Path) -> None:
    """A missing minors file fails only the Allocate that needs it, naming the file and the device; it is retried."""
    minors = tmp_path / "mig-minors"
    alloc = allocator(mig_plan(minors))
    with pytest.raises(AllocationError) as info:
        alloc.allocate(["MIG-01"])
    message = str(info.value)
    assert "MIG-01" in message and str(minors) in message and "No such file" in message
    minors.write_text(MIG_MINORS)
    assert alloc.allocate(["MIG-01"]).devices[-1] == DeviceSpec(
        "/dev/nvidia-caps/nvidia-cap22", "/dev/nvidia-caps/nvidia-cap22", "rw"
    )


def test_mig_minors_missing_entry(tmp_path: Path) -> None:
    """A minors file without the device's GI/CI entry gives an error naming the entry, the file and the device."""
    minors = tmp_path / "mig-minors"
    minors.write_text("gpu0/gi1/access 12\n")
    with pytest.raises(AllocationError) as info:
        allocator(mig_plan(minors)).allocate(["MIG-00"])
    assert str(info.value) == (
        "failed to get allocate response: MIG device MIG-00 (index 0:0): "
        f"no entry 'gpu0/gi1/ci0/access' in the MIG capability minors file {minors}"
    )


def test_mig_minors_not_needed_without_specs(tmp_path: Path) -> None:
    """Without pass_device_specs the minors file is never needed."""
    p = plan(MIGS, mig_minors_path=str(tmp_path / "absent"))
    assert allocator(p).allocate(["MIG-00"]) == ContainerResponse(envs("MIG-00"))


def test_read_mig_minors_skips_junk(tmp_path: Path) -> None:
    """The minors parser keeps `<name> <int>` lines and skips anything else."""
    minors = tmp_path / "mig-minors"
    minors.write_text("gpu0/gi1/access 12\n\nbad line here\ngpu0/gi1/ci0/access x\n  gpu1/gi2/access   7  \n")
    assert read_mig_minors(str(minors)) == {"gpu0/gi1/access": 12, "gpu1/gi2/access": 7}


ERROR_CASES: list[tuple[str, ResourcePlan, list[str], str]] = [
    (
        "unknown device",
        plan(),
        ["GPU-0000", "GPU-9999"],
        'invalid allocation request for "nvidia.com/gpu": invalid request: unknown device: GPU-9999',
    ),
    (
        "unknown replica",
        plan(REPLICAS, sharing="time-slicing"),
        ["GPU-0000::9"],
        'invalid allocation request for "nvidia.com/gpu": invalid request: unknown device: GPU-0000::9',
    ),
    (
        "shared request larger than one",
        plan(REPLICAS, sharing="time-slicing", fail=True, resource="nvidia.com/gpu.shared"),
        ["GPU-0000::0", "GPU-0001::0", "GPU-0000::0"],
        'invalid allocation request for "nvidia.com/gpu.shared": invalid request: '
        "maximum request size for shared resources is 1; found 3",
    ),
    (
        "unknown devices are reported before the size",
        plan(REPLICAS, sharing="time-slicing", fail=True),
        ["GPU-0000::0", "nope"],
        'invalid allocation request for "nvidia.com/gpu": invalid request: unknown device: nope',
    ),
]


@pytest.mark.parametrize(("name", "p", "ids", "message"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors(name: str, p: ResourcePlan, ids: list[str], message: str) -> None:
    """Bad requests fail with NVIDIA's exact error text, unknown IDs checked first."""
    with pytest.raises(AllocationError) as info:
        allocator(p).allocate(ids)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("name", "p", "ids"),
    [
        (
            "time-slicing without the flag",
            plan(REPLICAS, sharing="time-slicing"),
            ["GPU-0000::0", "GPU-0000::1"],
        ),
        ("flag on, single replica", plan(REPLICAS, sharing="time-slicing", fail=True), ["GPU-0000::0"]),
        ("flag on, full GPUs are not replicas", plan(fail=True), ["GPU-0000", "GPU-0001"]),
    ],
)
def test_size_allowed(name: str, p: ResourcePlan, ids: list[str]) -> None:
    """The size limit applies only to replica IDs, only when enabled, only above one."""
    assert allocator(p).allocate(ids).envs["NVIDIA_VISIBLE_DEVICES"]


def test_allocate_all_in_order() -> None:
    """Every container request gets its response, in order."""
    responses = allocator(plan()).allocate_all([["GPU-0002"], ["GPU-0000", "GPU-0001"], ["GPU-0001"]])
    assert [r.envs["NVIDIA_VISIBLE_DEVICES"] for r in responses] == [
        "GPU-0002",
        "GPU-0000,GPU-0001",
        "GPU-0001",
    ]


def test_allocate_all_fails_on_any_bad_request() -> None:
    """One bad container request fails the whole call, as NVIDIA does."""
    with pytest.raises(AllocationError, match="unknown device: bad"):
        allocator(plan()).allocate_all([["GPU-0000"], ["bad"]])


def test_annotation_key_is_fresh_per_response() -> None:
    """With the real uuid4 factory each response gets its own annotation key."""
    alloc = Allocator(plan(**strategies("cdi-annotations")))
    first, second = alloc.allocate(["GPU-0000"]), alloc.allocate(["GPU-0000"])
    (k1,), (k2,) = first.annotations, second.annotations
    assert k1 != k2 and k1.startswith("cdi.k8s.io/nvidia-device-plugin_")
    assert str(uuid.UUID(k1.rsplit("_", 1)[1])) == k1.rsplit("_", 1)[1]


@pytest.mark.parametrize(
    ("root", "path", "expected"),
    [
        ("/", "/dev/nvidia0", "/dev/nvidia0"),
        ("", "/dev/nvidia0", "/dev/nvidia0"),
        ("/run/nvidia/driver", "/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0"),
        ("/run/nvidia/driver/", "/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0"),
        ("//host//", "/dev//nvidia0", "/host/dev/nvidia0"),
    ],
)
def test_host_path(root: str, path: str, expected: str) -> None:
    """Host paths join like Go's filepath.Join: "/" and "" add nothing, slashes are cleaned."""
    assert host_path(root, path) == expected
