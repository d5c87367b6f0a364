"""NVIDIA's DRA demo specs (kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1, demo/specs/; written again
in tests/demospecs.py, which says which files and why some are left out) prepared end to end by
gpuvisor: the real supervisor in `--mode dra` on a simulated 8 x A100 40GB node, its DRA worker
publishing the pool to the fake API server (tests/kubeapi/), each claim allocated against that pool
and stored there as Kubernetes stores it (tests/drascheduler.py: the resourceclaim controller, the
scheduler's allocator, the kubelet's DRA manager), and the DRA kubelet stand-in
(supervisor/sim/drakubelet.py) making the kubelet's NodePrepareResources and
NodeUnprepareResources calls, one per pod. Time-slicing goes through a fake nvidia-smi
(tests/smifake.py) on the worker's PATH, MPS through a fake nvidia-cuda-mps-control
(tests/mpsfake.py) run by the supervisor.

What each claim must get is NVIDIA's driver's behaviour at v0.4.1 (cmd/gpu-kubelet-plugin/
device_state.go `prepareDevices` / `applyConfig`: TimeSlicing sets the full GPUs' timeslice and is
not set on MIG devices, MPS starts one control daemon per claim and device group with the
config's limits; `unprepareDevices` stops it and sets the timeslice back to Default; the claim's
CDI spec `k8s.gpu.nvidia.com-claim_<uid>.yaml` is written at prepare and deleted at unprepare).
One node per hardware kind serves all the demos of this module, one demo at a time; every demo
leaves the node as it found it, which the next one relies on and each test checks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid as uuidlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from supervisor.mps.claims import daemon_id
from tests import demospecs, mpsfake, smifake
from tests.dranode import DraNode
from tests.drascheduler import Allocator, KubeletClaims, Unschedulable, instantiate, pool_devices, to_v1
from tests.helpers import gone, short_tmpdir, wait_until, write_mig_minors
from tests.kubeapi import RunningApiServer

INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}  # NVIDIA's setTimeSlice values
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"  # sharing.go GetCDIContainerEdits


@dataclass
class Cluster:
    """One simulated node, the API server it publishes to, and the cluster's allocation state."""

    node: DraNode
    api: RunningApiServer
    smi: Path  # the fake nvidia-smi's directory
    allocator: Allocator
    kubelet: KubeletClaims
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> slice device
    smi_seen: int = 0  # nvidia-smi commands run before the test at hand

    def mark(self) -> None:
        self.smi_seen = len(smifake.commands(self.smi))

    def uuid_of(self, device: str) -> str:
        return str(self.devices[device]["attributes"]["uuid"]["string"])

    def parent_of(self, device: str) -> str:
        attrs = self.devices[device]["attributes"]
        return str((attrs.get("parentUUID") or attrs["uuid"])["string"])


def _start(stack: contextlib.ExitStack, kind: str) -> Cluster:
    base = Path(stack.enter_context(short_tmpdir("gvdemo")))
    stack.callback(mpsfake.kill_daemons, base)  # only the daemons this module's fake started
    profile = base / f"{kind}.yaml"
    profile.write_text(demospecs.node_profile(mig=kind == "a100-mig"))
    minors = base / "mig-minors"
    write_mig_minors(minors)
    fake = mpsfake.install(base)
    smi = base / "smi"
    smifake.install(smi, [demospecs.gpu_uuid(i) for i in range(8)])
    api = RunningApiServer(base)
    stack.callback(api.close)
    args = (
        "--mode", "dra", "--mps-root", str(base / "mps"), "--mps-control-binary", str(fake),
        "--mig-minors-path", str(minors),
    )  # fmt: skip
    node = DraNode(str(profile), args=args, api=api, env={"PATH": smifake.path_with(smi)})
    stack.enter_context(node)
    node.wait_registered()
    assert wait_until(lambda: node.published(), 30), node.log()[-4000:]
    slices = node.slices()
    devices = {d["name"]: d for s in slices for d in s["spec"]["devices"]}
    allocator = Allocator(node.node_name, pool_devices(slices), demospecs.classes())
    return Cluster(node, api, smi, allocator, KubeletClaims(node.dra), devices)


@pytest.fixture(scope="module")
def clusters() -> Iterator[Callable[[str], Cluster]]:
    """A node of each kind the demos need, started at its first use, shared by the module."""
    with contextlib.ExitStack() as stack:
        made: dict[str, Cluster] = {}

        def get(kind: str) -> Cluster:
            if kind not in made:
                made[kind] = _start(stack, kind)
            return made[kind]

        yield get


# ---------------------------------------------------------------------------------- what each demo gets
@dataclass(frozen=True)
class Want:
    """One request's devices: their type, how many, the MIG profile, and the sharing applied:
    ("TimeSlicing", interval), ("MPS", thread percentage or None, pinned MiB or None), or ()."""

    type: str = "gpu"
    count: int = 1
    profile: str = ""
    sharing: tuple[Any, ...] = ()


MPS_DEMO = ("MPS", 50, 10 * 1024)  # defaultActiveThreadPercentage: 50, defaultPinnedDeviceMemoryLimit: 10Gi
MIG_SET = {
    "mig-1g-5gb-0": Want("mig", profile="1g.5gb"),
    "mig-1g-5gb-1": Want("mig", profile="1g.5gb"),
    "mig-2g-10gb": Want("mig", profile="2g.10gb"),
    "mig-3g-20gb": Want("mig", profile="3g.20gb"),
}

# Demo file (without its v1/ or v1beta1/ folder) -> claim ("<pod>/<pod claim>" for a claim from a
# template, the claim's name for a named one) -> request -> Want; and how many prepare calls.
EXPECTED: dict[str, tuple[dict[str, dict[str, Want]], int]] = {
    "gpu-test1": ({"pod1/gpu": {"gpu": Want()}, "pod2/gpu": {"gpu": Want()}}, 2),
    "gpu-test2": ({"pod/shared-gpu": {"gpu": Want()}}, 1),
    "gpu-test3": ({"single-gpu": {"gpu": Want()}}, 1),  # pod2's start: already prepared, no call
    "gpu-test4": ({f"pod-{i}/mig-devices": MIG_SET for i in range(4)}, 4),
    "gpu-test5": (
        {
            "pod0/shared-gpus": {
                "ts-gpu": Want(sharing=("TimeSlicing", "Long")),
                "mps-gpu": Want(sharing=MPS_DEMO),
            }
        },
        1,
    ),
    "gpu-test-mps": ({"test-pod/shared-gpu": {"mps-gpu": Want(sharing=MPS_DEMO)}}, 1),
    "gpu-test7": ({"gpu-pod/gpu0": {"gpu": Want()}, "gpu-pod/gpu1": {"gpu": Want()}}, 1),
    "gpu-test8": ({"gpu-pod/twogpus": {"gpu": Want(count=2)}}, 1),
    "sharing-demo-job": (
        {
            "gpu-ts-sharing": {"gpu": Want(sharing=("TimeSlicing", "Default"))},
            "gpu-mps-sharing": {"gpu": Want(sharing=("MPS", None, None))},
            "mig-ts-sharing": {"mig": Want("mig", profile="1g.5gb")},  # no timeslice on MIG devices
            "mig-mps-sharing": {"mig": Want("mig", profile="1g.5gb", sharing=("MPS", None, None))},
        },
        1,  # the job's first pod prepares the four claims; the other three find them prepared
    ),
}
SCHEDULABLE = [d for d in demospecs.DEMOS if os.path.basename(d.id) in EXPECTED]


@dataclass
class Placed:
    """A demo's pods and claims once in the cluster."""

    pods: list[tuple[str, str, list[tuple[str, str, str]]]]  # (pod name, uid, its claims)
    keys: dict[str, str]  # claim uid -> key in EXPECTED
    stored: dict[str, dict[str, Any]]  # claim uid -> the claim as the API server has it


def place(cluster: Cluster, demo: demospecs.Demo) -> Placed:
    """The demo's claims made, allocated and stored at the API server; raises Unschedulable."""
    named = {n: to_v1(o) for n, o in demo.claims().items()}
    templates = {n: to_v1(o) for n, o in demo.templates().items()}
    placed = Placed([], {}, {})
    by_name: dict[str, dict[str, Any]] = {}
    for pod in demo.pods:
        uid = str(uuidlib.uuid4())
        refs = []
        for pod_claim, (how, name) in pod.claims:
            if how == "claim":
                if name not in by_name:
                    claim = named[name]
                    claim["metadata"]["uid"] = str(uuidlib.uuid4())
                    by_name[name] = cluster.allocator.allocate(claim, (pod.name, uid))
                    placed.keys[claim["metadata"]["uid"]] = name
                else:  # the scheduler reserves an allocated claim for each further pod
                    by_name[name]["status"]["reservedFor"].append(
                        {"resource": "pods", "name": pod.name, "uid": uid}
                    )
                obj = by_name[name]
            else:
                obj = cluster.allocator.allocate(
                    instantiate(templates[name], pod.name, uid, pod_claim), (pod.name, uid)
                )
                placed.keys[obj["metadata"]["uid"]] = f"{pod.name}/{pod_claim}"
            cluster.api.state.put_claim(obj)
            placed.stored[obj["metadata"]["uid"]] = obj
            refs.append((obj["metadata"]["namespace"], obj["metadata"]["name"], obj["metadata"]["uid"]))
        placed.pods.append((pod.name, uid, refs))
    return placed


def remove(cluster: Cluster, placed: Placed) -> None:
    for uid, obj in placed.stored.items():
        cluster.allocator.release(uid)
        with contextlib.suppress(KeyError):
            cluster.api.state.delete_claim(obj["metadata"]["namespace"], obj["metadata"]["name"])


def mps_home(spec: dict[str, Any]) -> Path | None:
    """The daemon directory whose pipe dir the claim's spec mounts at /tmp/nvidia-mps, if any."""
    for device in spec["devices"]:
        for mount in device["containerEdits"].get("mounts", []):
            if mount["containerPath"] == "/tmp/nvidia-mps":
                return Path(mount["hostPath"]).parent
    return None


def mps_claims(node: DraNode) -> Any:
    """status' cluster.dra.mps_claims; None while a supervisor just started has no DRA side yet
    (its status says `cluster: null` until the side starts)."""
    cluster = node.command("status").get("cluster") or {}
    return (cluster.get("dra") or {}).get("mps_claims")


def daemon_pid(home: Path) -> int:
    return int((home / "pipe" / "nvidia-cuda-mps-control.pid").read_text())


def check_claim(
    cluster: Cluster, uid: str, key: str, want: dict[str, Want], stored: dict[str, Any], answer: Any
) -> Path | None:
    """One prepared claim against its Want: the answer's devices, the spec, the sharing applied."""
    node = cluster.node
    results = stored["status"]["allocation"]["devices"]["results"]
    assert answer.error == "", f"{key}: {answer.error}\n{node.log()[-3000:]}"
    got = sorted((d.request_names[0], d.device_name) for d in answer.devices)
    assert got == sorted((r["request"], r["device"]) for r in results), key
    by_request: dict[str, list[str]] = {}
    for request, device in got:
        by_request.setdefault(request, []).append(device)
    assert set(by_request) == set(want), key
    spec = node.claim_spec(uid)
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"], key
    assert {i for d in answer.devices for i in d.cdi_device_ids} == node.claim_cdi_names(uid), key
    spec_devices = {d["name"]: d for d in spec["devices"]}
    assert set(spec_devices) == {f"{uid}-{d}" for _, d in got}, key
    home = mps_home(spec)
    mps_uuids: list[str] = []
    for request, w in want.items():
        devices = by_request[request]
        assert len(devices) == w.count, (key, request, devices)
        for device in devices:
            attrs = cluster.devices[device]["attributes"]
            assert attrs["type"]["string"] == w.type, (key, device)
            if w.profile:
                assert attrs["profile"]["string"] == w.profile, (key, device)
            edits = spec_devices[f"{uid}-{device}"]["containerEdits"]
            nodes = [n["path"] for n in edits["deviceNodes"]]
            minor = int(device.split("-")[1])
            assert nodes[0] == f"/dev/nvidia{minor}", (key, nodes)
            # A MIG device adds its GPU instance's and compute instance's capability nodes.
            assert len(nodes) == (3 if w.type == "mig" else 1) and all(
                n.startswith("/dev/nvidia-caps/nvidia-cap") for n in nodes[1:]
            ), (key, nodes)
            strategy = w.sharing[0] if w.sharing else ""
            assert (PIPE_ENV in edits.get("env", [])) == (strategy == "MPS"), (key, device, edits)
            if strategy == "MPS":
                mps_uuids.append(cluster.uuid_of(device))
                mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
                assert home is not None and mounts == {
                    "/tmp/nvidia-mps": str(home / "pipe"),
                    "/dev/shm": str(home / "shm"),
                }
            if strategy != "TimeSlicing":  # nor on a MIG device's parent (NVIDIA: GpuUUIDs() only)
                parent = cluster.parent_of(device)
                assert not [c for c in smifake.commands(cluster.smi)[cluster.smi_seen :] if parent in c], key
            else:
                gpu = cluster.uuid_of(device)
                assert smifake.timeslices(cluster.smi)[gpu] == INTERVALS[w.sharing[1]], (key, device)
                assert (
                    f"compute-policy -i {gpu} --set-timeslice {INTERVALS[w.sharing[1]]}"
                    in smifake.commands(cluster.smi)
                )
    if not mps_uuids:
        assert home is None, key
        return None
    # The claim's own daemon: NVIDIA's ID, its devices, the config's limits in NVIDIA's order.
    assert home is not None and home.name == daemon_id(uid, tuple(sorted(mps_uuids))), (key, home)
    pid = daemon_pid(home)
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"CUDA_VISIBLE_DEVICES={','.join(sorted(mps_uuids))}".encode() in environ, key
    commands = [
        c for c in (home / "log" / "fake-commands.log").read_text().splitlines() if c.startswith("set_")
    ]
    mps = next(w.sharing for w in want.values() if w.sharing and w.sharing[0] == "MPS")
    limits = [f"set_default_active_thread_percentage {mps[1]}"] if mps[1] else []
    limits += (
        [f"set_default_device_pinned_mem_limit {u} {mps[2]}M" for u in sorted(mps_uuids)] if mps[2] else []
    )
    assert commands == limits, (key, commands)
    return home


def assert_clean(cluster: Cluster, uids: list[str], homes: list[Path], pids: list[int]) -> None:
    """Nothing of the claims left: no spec, no checkpoint entry, no daemon, every timeslice Default."""
    node = cluster.node
    assert not [u for u in uids if os.path.exists(node.claim_spec_path(u))]
    assert not node.prepared_uids() & set(uids)
    assert wait_until(lambda: gone(pids), 15), pids
    assert not [h for h in homes if h.exists()]
    assert set(smifake.timeslices(cluster.smi).values()) == {0}


@pytest.mark.parametrize("demo", SCHEDULABLE, ids=[d.id for d in SCHEDULABLE])
def test_a_demo_is_prepared_with_its_devices_spec_and_sharing_then_unprepared_clean(
    clusters: Callable[[str], Cluster], demo: demospecs.Demo
) -> None:
    """Each of NVIDIA's demos, its pods started in order and then stopped: every claim is prepared
    once (the kubelet's one call per pod, none for a claim already prepared) with exactly the
    devices the scheduler allocated (type, count, MIG profile, one parent GPU where the claim
    constrains it), its own CDI spec holding those devices' nodes and the sharing's edits, the
    TimeSlicing interval on the full GPUs it time-slices, an MPS control daemon of its own with the
    config's limits; once its last pod stops, spec, checkpoint entry and daemon are gone and the
    timeslices are back to Default."""
    cluster = clusters(demo.node)
    cluster.mark()
    want, calls = EXPECTED[os.path.basename(demo.id)]
    before = len(cluster.kubelet.calls)
    placed = place(cluster, demo)
    homes: list[Path] = []
    pids: list[int] = []
    try:
        answers: dict[str, Any] = {}
        for _, pod_uid, refs in placed.pods:
            answers.update(cluster.kubelet.start_pod(pod_uid, refs))
        assert sorted(placed.keys.values()) == sorted(want)
        assert set(answers) == set(placed.keys) and len(cluster.kubelet.calls) - before == calls
        for uid, key in placed.keys.items():
            home = check_claim(cluster, uid, key, want[key], placed.stored[uid], answers[uid])
            if home is not None:
                homes.append(home)
                pids.append(daemon_pid(home))
        if os.path.basename(demo.id) == "gpu-test4":  # constraints: matchAttribute parentUUID
            parents = [
                {cluster.parent_of(d.device_name) for d in answers[uid].devices} for uid in placed.keys
            ]
            assert all(len(p) == 1 for p in parents) and len(set.union(*parents)) == 4, parents
        assert cluster.node.prepared_uids() >= set(placed.keys)

        for _, pod_uid, refs in placed.pods:
            for uid, answer in cluster.kubelet.stop_pod(pod_uid, refs).items():
                assert answer.error == "", (placed.keys[uid], answer.error)
        assert cluster.kubelet.prepared.keys().isdisjoint(placed.keys)
        assert_clean(cluster, list(placed.keys), homes, pids)
    finally:
        for _, pod_uid, refs in placed.pods:  # a failed test still leaves the node clean for the next
            with contextlib.suppress(Exception):
                cluster.kubelet.stop_pod(pod_uid, refs)
        remove(cluster, placed)


GPU_TEST6 = [d for d in demospecs.DEMOS if d.id.endswith("/gpu-test6")]


@pytest.mark.parametrize("demo", GPU_TEST6, ids=[d.id for d in GPU_TEST6])
def test_gpu_test6_selects_by_an_index_attribute_no_device_has(
    clusters: Callable[[str], Cluster], demo: demospecs.Demo
) -> None:
    """gpu-test6's selector reads `device.attributes['gpu.nvidia.com'].index`, which NVIDIA's
    driver at v0.4.1 does not publish (cmd/gpu-kubelet-plugin/deviceinfo.go GpuInfo.Attributes:
    type, uuid, productName, brand, architecture, versions, PCI) and gpuvisor, publishing the same
    attributes, does not either: on an A100 the productName clause holds, so the index clause is
    evaluated and fails with a CEL runtime error, which fails the claim's allocation (the
    scheduler's structured allocator treats it so). The demo's pods stay pending on both drivers."""
    cluster = clusters(demo.node)
    assert all("index" not in d["attributes"] for d in cluster.devices.values())
    with pytest.raises(Unschedulable, match=r"CEL runtime error: .*index"):
        place(cluster, demo)
    assert cluster.allocator.in_use == {}


# ---------------------------------------------------------------------------------- restarts
def test_an_mps_claim_keeps_its_daemon_and_spec_through_worker_and_supervisor_restarts() -> None:
    """NVIDIA's gpu-test-mps claim prepared; the DRA worker SIGKILLed and back, then the supervisor
    SIGKILLed and started again: each time the claim's CDI spec is unchanged and its MPS control
    daemon is the same process (the supervisor adopts it); the unprepare after both stops that
    daemon and removes the spec and the daemon's directory."""
    demo = next(d for d in demospecs.DEMOS if d.id == "quickstart/v1/gpu-test-mps")
    with contextlib.ExitStack() as stack:
        cluster = _start(stack, "a100")
        node = cluster.node
        placed = place(cluster, demo)
        ((_, pod_uid, refs),) = placed.pods
        ((uid, key),) = placed.keys.items()
        answers = cluster.kubelet.start_pod(pod_uid, refs)
        home = check_claim(
            cluster, uid, key, EXPECTED["gpu-test-mps"][0][key], placed.stored[uid], answers[uid]
        )
        assert home is not None
        spec, pid = node.claim_spec(uid), daemon_pid(home)

        worker, before = node.dra_worker_pid(), node.registrations()
        os.kill(worker, signal.SIGKILL)
        assert wait_until(lambda: node.dra_worker_pid() not in (0, worker), 30), node.log()[-4000:]
        node.wait_registered(more_than=before)
        assert node.claim_spec(uid) == spec and daemon_pid(home) == pid and not gone([pid])

        # The daemon is the supervisor's child too (a subreaper adopts it); it must outlive it.
        old, before = [p.pid for p in node.workers() if p.pid != pid], node.registrations()
        node.stop_supervisor(signal.SIGKILL)
        assert wait_until(lambda: gone(old), 15), "the workers outlived their supervisor"
        node.start_supervisor()
        node.wait_registered(more_than=before)
        assert node.claim_spec(uid) == spec and not gone([pid])

        def adopted() -> bool:
            """The new supervisor supervises the daemon it found: up, same PID, in its status."""
            daemons = (mps_claims(node) or {}).get("daemons", {})
            return bool(daemons.get(home.name, {}).get("up")) and daemons[home.name]["pid"] == pid

        assert wait_until(adopted, 30), mps_claims(node)
        assert daemon_pid(home) == pid

        ((_, answer),) = cluster.kubelet.stop_pod(pod_uid, refs).items()
        assert answer.error == ""
        assert_clean(cluster, [uid], [home], [pid])


def test_a_device_class_config_reaches_the_driver_as_the_allocation_carries_it(
    clusters: Callable[[str], Cluster],
) -> None:
    """No class of the demos carries `spec.config`; a class that does (the driver's gpu.nvidia.com
    selector plus a GpuConfig TimeSlicing Long, an example of ours) used by gpu-test1's template:
    the allocation carries the class's entry with source FromClass for the request (the
    allocator copies class config into `status.allocation.devices.config`), and gpuvisor applies
    it as NVIDIA's driver does a claim's own: the GPU's timeslice is Long until unprepare."""
    cluster = clusters("a100")
    cluster.mark()
    gpu_class = demospecs.classes()["gpu.nvidia.com"]
    sliced: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "ts-long.gpu.nvidia.com"},
        "spec": {
            "selectors": gpu_class["spec"]["selectors"],
            "config": [
                {
                    "opaque": {
                        "driver": "gpu.nvidia.com",
                        "parameters": {
                            "apiVersion": "resource.nvidia.com/v1beta1",
                            "kind": "GpuConfig",
                            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
                        },
                    }
                }
            ],
        },
    }
    base = next(d for d in demospecs.DEMOS if d.id == "quickstart/v1/gpu-test1")
    template = to_v1(base.templates()["single-gpu"])
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = (
        "ts-long.gpu.nvidia.com"
    )
    demo = demospecs.Demo("class-config", "a100", (template,), base.pods[:1])
    cluster.allocator.classes[sliced["metadata"]["name"]] = sliced
    placed = place(cluster, demo)
    try:
        ((_, pod_uid, refs),) = placed.pods
        ((uid, key),) = placed.keys.items()
        assert placed.stored[uid]["status"]["allocation"]["devices"]["config"] == [
            {"source": "FromClass", "requests": ["gpu"], **sliced["spec"]["config"][0]}
        ]
        answers = cluster.kubelet.start_pod(pod_uid, refs)
        want = {"gpu": Want(sharing=("TimeSlicing", "Long"))}
        assert check_claim(cluster, uid, key, want, placed.stored[uid], answers[uid]) is None
        assert [a.error for a in cluster.kubelet.stop_pod(pod_uid, refs).values()] == [""]
        assert_clean(cluster, [uid], [], [])
    finally:
        del cluster.allocator.classes[sliced["metadata"]["name"]]
        remove(cluster, placed)
