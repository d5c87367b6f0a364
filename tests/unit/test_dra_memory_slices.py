"""GPUs shared by memory on the supervisor's side: the setting gpuvisor.dra.memorySharing
(supervisor/config/memory.py), the slices it makes (supervisor/dra/memshare.py) and the fake API
server's consumable-capacity rules (tests/kubeapi/capacity.py), each allowed and refused case
against both gpuvisor's own check and the fake's.

The API server's rules kept, from kubernetes/kubernetes pkg/apis/resource/validation/validation.go
(read at commit 797475e, by function) and kubernetes/api v0.34.0 resource/v1/types.go:
- validateDevice: capacities go through validateSingleAllocatableDeviceCapacity unless
  `allowMultipleAllocations` is true; it forbids a `requestPolicy` ("allowMultipleAllocations
  must be true"); types.go:428-440 says the same of RequestPolicy;
- validateRequestPolicy: not `validValues` and `validRange` together (types.go:451-453, "Must not
  set more than one ValidRequestValues");
- validateValidRequestValues: `default` required with either;
- validateRequestPolicyValidValues: ascending, at most 10 (CapacityRequestPolicyDiscreteMaxOptions,
  types.go:461-479), none above the capacity, the default among them;
- validateRequestPolicyRange / validateRequestPolicyRangeStep: `min` required and within the
  capacity, default >= min, max within min..capacity and >= default, min + step within the
  capacity, default and max whole steps above min (types.go:496-530);
- validateUID for a result's shareID (types.go:1560-1567);
- pkg/registry/resource/resourceslice/strategy.go dropDisabledFields: without DRAConsumableCapacity
  the fields are dropped, unless the stored slice already uses them.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from supervisor.config import ConfigError, config_from_data, parse_config_text
from supervisor.config.errors import Invalid
from supervisor.config.memory import MemorySharing, memory_sharing
from supervisor.dra.memshare import capacity_problems, request_policy, status_data
from supervisor.dra.slices import build_slices, slice_problems
from supervisor.node.planning import plan_resources
from tests import nodes
from tests.helpers import wait_until
from tests.kubeapi.capacity import drop_consumable_capacity, result_problems, slice_capacity_problems
from tests.kubeapi.validation import resource_claim_problems, resource_slice_problems

GI, MI = 1 << 30, 1 << 20
POLICY = (GI, 4 * GI, GI)  # step, default, minimum


def cfg(text: str, **flags: object) -> Any:
    return config_from_data(parse_config_text(text, "t.yaml"), flags=flags, source="t.yaml")


# ---------------------------------------------------------------------------------- the setting


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ({"step": "1Gi", "default": "4Gi", "minimum": "1Gi"}, MemorySharing(GI, 4 * GI, GI)),
        ("step=512Mi,default=2Gi,minimum=1Gi", MemorySharing(512 * MI, 2 * GI, GI)),
        ({"step": "2Gi"}, MemorySharing(2 * GI, 2 * GI, 2 * GI)),  # minimum = step, default = minimum
        ({"step": 1048576}, MemorySharing(MI, MI, MI)),  # a YAML integer of bytes
        ("off", None),
        ("", None),
    ],
)
def test_the_setting_takes_a_mapping_or_its_flag_form(value: object, want: MemorySharing | None) -> None:
    """step, default and minimum as quantities; minimum defaults to the step, default to the
    minimum; "" and off are off."""
    assert memory_sharing(value) == want


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"default": "4Gi"}, "step is required"),
        ({"step": "1.5Gi"}, "is not a memory quantity"),
        ({"step": "1000k"}, "whole number of MiB"),
        ({"step": "1Gi", "minimum": "0"}, "at least 1Mi"),
        ({"step": "1Gi", "default": "1Gi", "minimum": "2Gi"}, "less than the minimum"),
        ({"step": "2Gi", "default": "4Gi", "minimum": "1Gi"}, "whole number of steps"),
        ({"step": "1Gi", "max": "8Gi"}, "unknown key"),
        ("step=1Gi,step=2Gi", "given twice"),
        ("size=1Gi", "expected step="),
        (["1Gi"], "must be a mapping"),
    ],
)
def test_a_bad_setting_is_refused_with_its_reason(value: object, words: str) -> None:
    """Each rule that needs no GPU is checked at load, with what is wrong."""
    with pytest.raises(Invalid, match=words):
        memory_sharing(value)


def test_the_file_key_is_nested_under_gpuvisor_dra_and_the_flag_wins() -> None:
    """gpuvisor.dra.memorySharing is read from its mapping; an unknown key beside it is reported;
    the flag overrides the file; a bad value names the key."""
    text = "gpuvisor: {dra: {memorySharing: {step: 1Gi, default: 4Gi}, colour: red}}"
    config = cfg(text)
    assert config.dra_memory_sharing == MemorySharing(GI, 4 * GI, GI)
    assert "gpuvisor.dra.colour" in config.unknown_keys
    assert cfg(text, dra_memory_sharing="step=2Gi").dra_memory_sharing == MemorySharing(
        2 * GI, 2 * GI, 2 * GI
    )
    with pytest.raises(ConfigError, match=r"gpuvisor\.dra\.memorySharing: step is required"):
        cfg("gpuvisor: {dra: {memorySharing: {default: 4Gi}}}")
    with pytest.raises(ConfigError, match=r"gpuvisor\.dra: this section must be a mapping"):
        cfg("gpuvisor: {dra: 3}")


def test_the_dra_plan_carries_the_policy_and_a_change_changes_the_plan() -> None:
    """The DRA plan holds the policy in bytes (so a reload that changes it is a plan change the
    publisher and the worker see); without the setting its step is 0."""
    text = "gpuvisor: {mode: dra, dra: {memorySharing: {step: 1Gi, default: 4Gi}}}"
    dra = plan_resources(nodes.pcie_l4(), cfg(text, node_name="n1"))["gpu.nvidia.com"].dra
    assert dra is not None and (dra.memory_step, dra.memory_default, dra.memory_minimum) == (GI, 4 * GI, GI)
    plain = plan_resources(nodes.pcie_l4(), cfg("gpuvisor: {mode: dra}", node_name="n1"))[
        "gpu.nvidia.com"
    ].dra
    assert plain is not None and plain.memory_step == 0


# ---------------------------------------------------------------------------------- the slices


def test_full_gpus_are_published_shared_by_memory_and_the_api_server_accepts_them() -> None:
    """Each full GPU allows multiple allocations with a range policy (min, step, default as set,
    max the largest whole step within its memory), its capacity value unchanged; the slice passes
    gpuvisor's own check, the 1.34 schema and the fake API server's rules."""
    node = nodes.pcie_l4()
    (obj,) = build_slices(node, (), node_name="n1", memory_sharing=POLICY)
    memory = node.gpus[0].memory_mib * MI
    for device in obj["spec"]["devices"]:
        assert device["allowMultipleAllocations"] is True
        top = GI + (memory - GI) // GI * GI
        assert device["capacity"]["memory"]["requestPolicy"] == {
            "default": "4Gi",
            "validRange": {"min": "1Gi", "max": f"{top // GI}Gi", "step": "1Gi"},
        }
    assert build_slices(node, (), node_name="n1")[0]["spec"]["devices"][0]["capacity"]["memory"] == {
        "value": obj["spec"]["devices"][0]["capacity"]["memory"]["value"]
    }
    obj["metadata"] = {"name": "n1-gpu.nvidia.com-abcde"}
    assert slice_problems(obj) == []
    assert resource_slice_problems(obj) == []


def test_mig_devices_and_gpus_too_small_for_the_policy_stay_whole() -> None:
    """MIG devices are never shared by memory; a GPU whose memory is below minimum + step, or
    whose largest whole step is below the default, is published whole."""
    (obj,) = build_slices(nodes.mig_a100(), (), node_name="n1", memory_sharing=POLICY)
    migs = [d for d in obj["spec"]["devices"] if d["attributes"]["type"]["string"] == "mig"]
    assert migs and not any("allowMultipleAllocations" in d for d in migs)
    assert request_policy(GI + GI - 1, POLICY) is None  # min + step above the memory
    assert request_policy(3 * GI + GI // 2, POLICY) is None  # largest step 3Gi, default 4Gi
    assert request_policy(4 * GI, POLICY) == {
        "default": "4Gi",
        "validRange": {"min": "1Gi", "max": "4Gi", "step": "1Gi"},
    }


def _device(policy: dict[str, Any] | None, multiple: bool = True, value: str = "24Gi") -> dict[str, Any]:
    capacity: dict[str, Any] = {"value": value}
    if policy is not None:
        capacity["requestPolicy"] = policy
    out: dict[str, Any] = {"name": "gpu-0", "capacity": {"memory": capacity}}
    if multiple:
        out["allowMultipleAllocations"] = True
    return out


RANGE = {"default": "4Gi", "validRange": {"min": "1Gi", "max": "24Gi", "step": "1Gi"}}
REFUSED = [
    ("a policy without allowMultipleAllocations", _device(RANGE, multiple=False), "allowMultipleAllocations"),
    ("validValues beside validRange", _device({**RANGE, "validValues": ["4Gi"]}), "validValues"),
    ("min above the capacity", _device({"default": "30Gi", "validRange": {"min": "30Gi"}}), "min"),
    ("default below min", _device({"default": "1Gi", "validRange": {"min": "2Gi"}}), "min"),
    ("max above the capacity", _device({"default": "4Gi", "validRange": {"min": "1Gi", "max": "32Gi"}}), "max"),
    ("default above max", _device({"default": "8Gi", "validRange": {"min": "1Gi", "max": "4Gi"}}), "max"),
    ("min + step above the capacity", _device({"default": "20Gi", "validRange": {"min": "20Gi", "step": "8Gi"}}), "step"),
    ("default not a whole step", _device({"default": "4Gi", "validRange": {"min": "1Gi", "step": "2Gi"}}), "step"),
    ("max not a whole step", _device({"default": "3Gi", "validRange": {"min": "1Gi", "max": "24Gi", "step": "2Gi"}}), "step"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "device", "where"), REFUSED, ids=[c[0] for c in REFUSED])
def test_a_bad_request_policy_is_refused_by_both_checks(
    case: str, device: dict[str, Any], where: str
) -> None:
    """Each of validation.go's request-policy rules refuses its case in the fake API server and in
    gpuvisor's own pre-send check (which must never send what the server refuses)."""
    fake = slice_capacity_problems(device, "spec.devices[0]")
    own = capacity_problems(device, "spec.devices[0]")
    assert fake and where in fake[0], fake
    assert own, case


ALLOWED = [
    ("a range policy", _device(RANGE)),
    ("no policy on a shared device", _device(None)),
    ("no policy, not shared", _device(None, multiple=False)),
    ("a range without max or step", _device({"default": "2Gi", "validRange": {"min": "1Gi"}})),
    ("valid values", _device({"default": "8Gi", "validValues": ["4Gi", "8Gi", "16Gi"]})),
]


@pytest.mark.parametrize(("case", "device"), ALLOWED, ids=[c[0] for c in ALLOWED])
def test_a_good_request_policy_passes_both_checks(case: str, device: dict[str, Any]) -> None:
    """The allowed forms pass the fake's rules and gpuvisor's own."""
    assert slice_capacity_problems(device, "d") == [] and capacity_problems(device, "d") == []


def test_the_fakes_valid_values_rules() -> None:
    """validValues: ascending, at most 10, none above the capacity, the default among them."""
    assert (
        "ascending"
        in slice_capacity_problems(_device({"default": "4Gi", "validValues": ["8Gi", "4Gi"]}), "d")[0]
    )
    many = [f"{i}Gi" for i in range(1, 12)]
    assert "Too many" in slice_capacity_problems(_device({"default": "1Gi", "validValues": many}), "d")[0]
    assert (
        "larger than capacity"
        in slice_capacity_problems(_device({"default": "4Gi", "validValues": ["4Gi", "48Gi"]}), "d")[0]
    )
    assert (
        "default value"
        in slice_capacity_problems(_device({"default": "2Gi", "validValues": ["4Gi"]}), "d")[0]
    )
    assert "Required" in slice_capacity_problems(_device({"validValues": ["4Gi"]}), "d")[0]  # fmt: skip


def test_without_the_gate_the_fields_are_dropped_and_results_are_checked() -> None:
    """dropDisabledFields takes allowMultipleAllocations and every requestPolicy; a claim result's
    shareID must be a normalized UID and its consumedCapacity quantities."""
    (obj,) = build_slices(nodes.pcie_l4(), (), node_name="n1", memory_sharing=POLICY)
    spec = copy.deepcopy(obj["spec"])
    drop_consumable_capacity(spec)
    assert spec == build_slices(nodes.pcie_l4(), (), node_name="n1")[0]["spec"]
    good = {"shareID": "0b0e7c6e-3f4a-4b7e-9a55-6c1f0d2e8a11", "consumedCapacity": {"memory": "4Gi"}}
    assert result_problems(good, "r") == []
    assert "RFC 4122" in result_problems({"shareID": "0B0E7C6E-3F4A-4B7E-9A55-6C1F0D2E8A11"}, "r")[0]
    assert "not a quantity" in result_problems({"consumedCapacity": {"memory": "lots"}}, "r")[0]
    from tests import draconfigs as dc

    claim = dc.memory_share("default", "a", "gpu-0", "4Gi", "n1")
    assert resource_claim_problems(claim, "default") == []
    claim["status"]["allocation"]["devices"]["results"][0]["shareID"] = "share-1"
    assert resource_claim_problems(claim, "default") != []


def test_a_memory_share_shows_in_its_claims_status_data() -> None:
    """status.devices[].data of a memory share: the share, the pinned limit handed to MPS, the GPU."""
    from common.dracheckpoint import MEMORY_SHARE, MPS, DeviceSharing

    share = DeviceSharing(MEMORY_SHARE, "GPU-1", "GPU-1", pinned_memory_limit=6 * GI)
    assert status_data(share) == {"memoryShare": "6Gi", "mpsPinnedDeviceMemoryLimit": "6144M", "gpu": "GPU-1"}
    assert status_data(DeviceSharing(MPS, "GPU-1", "GPU-1", pinned_memory_limit=GI)) is None
    assert status_data(None) is None


# ---------------------------------------------------------------------------------- the publisher


def _publisher(api: Any) -> Any:
    from tests.unit.test_dra_publish import NODE, Pub

    api.state.add_node(NODE)
    return Pub(api)


def test_the_publisher_asks_once_and_publishes_shared_where_the_server_keeps_the_fields(api: Any) -> None:
    """DRAConsumableCapacity on: one dry-run create (counted `sharing-kept`), then every full GPU
    is stored shared; the fake found nothing to refuse."""
    from supervisor.dra.slices import PoolWant

    api.state.consumable_capacity = True
    pub = _publisher(api)
    pub.publisher.start()
    try:
        pub.publisher.want(PoolWant(True, nodes.pcie_l4(), memory_sharing=POLICY))
        assert wait_until(
            lambda: len(pub.devices()) == 4 and all(d.get("allowMultipleAllocations") for d in pub.devices())
        )
        assert pub.counts.count(("probe", "sharing-kept")) == 1
        assert pub.publisher.status()["memory_sharing"] == "kept" and api.state.errors == []
    finally:
        pub.publisher.stop()
        pub.client.close()


def test_fields_dropped_on_a_real_write_turn_the_gpus_whole(api: Any) -> None:
    """A server that kept the fields when probed but drops them on a write (a rollback of the
    API server, its gate turned off): the answer shows it, status says `dropped`, and the pool
    stays as stored, whole (the next pass builds it whole too, so it finds nothing to rewrite)."""
    from supervisor.dra.slices import PoolWant

    pub = _publisher(api)
    pub.publisher.probes["sharing"].state = True  # as if probed before
    api.state.consumable_capacity = False
    pub.publisher.start()
    try:
        pub.publisher.want(PoolWant(True, nodes.pcie_l4(), memory_sharing=POLICY))
        assert wait_until(lambda: pub.publisher.status()["memory_sharing"] == "dropped")
        assert wait_until(lambda: len(pub.devices()) == 4)
        assert not any("allowMultipleAllocations" in d for d in pub.devices())
        assert wait_until(lambda: ("pass", "unchanged") in pub.counts)  # the pass after: in step
        assert pub.generations() == {1} and pub.publisher.writes["update"] == 0
    finally:
        pub.publisher.stop()
        pub.client.close()
