"""Tests of worker.dra.config and worker.dra.quantity: a claim's opaque configuration read as NVIDIA's
DRA driver reads it. Every rule cites where kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1 has it
(api/nvidia.com/resource/v1beta1/*.go, cmd/gpu-kubelet-plugin/device_state.go); the node is the
simulated mig-a100 (GPUs 0-3 in MIG mode, 4-7 whole), so both kinds meet both kinds of device."""

from __future__ import annotations

import re
from typing import Any

import pytest

from common.dracheckpoint import MPS, TIME_SLICING, DeviceSharing
from common.model import ResourcePlan
from supervisor.config import config_from_data
from supervisor.node.draplan import dra_plan
from tests import draconfigs as dc
from tests import nodes
from worker.dra.claims import ClaimRef, allocated_devices
from worker.dra.config import ClaimConfigError, Result, resolve
from worker.dra.quantity import QuantityError, json_quantity, parse_quantity

POOL = "node-a"
GI = 1 << 30
MIB = 1 << 20
MIG0 = "gpu-0-mig-1g10gb-gi1-ci0"
MIG1 = "gpu-0-mig-1g10gb-gi2-ci0"


@pytest.fixture(scope="module")
def plan() -> ResourcePlan:
    config = config_from_data(
        {"version": "v1", "gpuvisor": {"mode": "dra", "kubeletPluginsDir": "/nonexistent/p"}},
        flags={"node_name": POOL},
        source="test",
    )
    return dra_plan(nodes.mig_a100(), config)


def sharing_of(plan: ResourcePlan, claim: dc.Claim) -> list[DeviceSharing | None]:
    """The claim resolved as the Preparer resolves it, through the same checks of its allocation."""
    assert plan.dra is not None
    obj = claim.to_json(POOL)
    ref = ClaimRef(claim.namespace, claim.name, claim.uid)
    by_id = {d.id: d for d in plan.devices}
    allocated = allocated_devices(obj, ref, driver=plan.dra.driver, pool=POOL, devices=by_id)
    results = [Result(a.result_request, by_id[a.device], a.admin_access) for a in allocated]
    return resolve(obj, ref, plan.dra.driver, results)


def error_of(plan: ResourcePlan, claim: dc.Claim) -> str:
    with pytest.raises(ClaimConfigError) as info:
        sharing_of(plan, claim)
    return str(info.value)


def one(requests: list[dc.Request], *configs: dc.Config) -> dc.Claim:
    return dc.Claim("default", "c1", requests, list(configs))


def uuid(plan: ResourcePlan, device: str) -> str:
    return next(d.uuid for d in plan.devices if d.id == device)


# --------------------------------------------------------------------------- NVIDIA's demo claims
def test_the_demo_claims_resolve_as_nvidia_applies_them(plan: ResourcePlan) -> None:
    """gpu-test1 (no config), gpu-test6 (TimeSlicing Long), gpu-test-mps (MPS 50 %, 10Gi), gpu-test5
    (one request time-sliced, the other MPS), gpu-test4 (MIG, no config): each device gets its
    request's entry, with the limits in bytes as NVIDIA hands them to the daemon (whole MiB)."""
    assert sharing_of(plan, dc.gpu_test1(["gpu-4"])) == [None]
    [ts] = sharing_of(plan, dc.gpu_test6(["gpu-5"]))
    assert ts == DeviceSharing(TIME_SLICING, uuid(plan, "gpu-5"), uuid(plan, "gpu-5"), interval="Long")
    [m] = sharing_of(plan, dc.gpu_test_mps("gpu-6"))
    assert m is not None and (m.strategy, m.active_thread_percentage, m.pinned_memory_limit) == (
        MPS,
        50,
        10 * GI,
    )
    ts5, mps5 = sharing_of(plan, dc.gpu_test5("gpu-4", "gpu-7"))
    assert ts5 is not None and ts5.strategy == TIME_SLICING and ts5.uuid == uuid(plan, "gpu-4")
    assert mps5 is not None and mps5.strategy == MPS and mps5.uuid == uuid(plan, "gpu-7")
    assert sharing_of(plan, dc.gpu_test4([MIG0, MIG1])) == [None, None]


def test_mig_devices_under_mps_get_their_limits_by_index_among_sorted_uuids(plan: ResourcePlan) -> None:
    """A MigDeviceConfig with MPS applies to MIG devices; a per-device key that is an index names
    the device at that place among the group's UUIDs, sorted (sharing.go uuidSet.Normalize)."""
    result = sharing_of(plan, dc.mig_mps([MIG1, MIG0]))
    first = sorted([uuid(plan, MIG0), uuid(plan, MIG1)])[0]
    assert all(s is not None and s.strategy == MPS for s in result)
    assert {s.per_device_pinned_memory_limit for s in result if s} == {((first, GI),)}
    assert {s.active_thread_percentage for s in result if s} == {25}


# --------------------------------------------------------------------------- precedence
def test_claim_entries_win_over_class_entries_whatever_their_order(plan: ResourcePlan) -> None:
    """FromClass entries come before FromClaim ones, and later wins (GetOpaqueDeviceConfigs: class
    configs, then claim configs; prepareDevices walks them with slices.Backward)."""
    claim = one(
        [dc.Request("gpu", ["gpu-4"])],
        dc.Config(dc.gpu_config(dc.time_slicing("Short")), ["gpu"], source="FromClaim"),
        dc.Config(dc.gpu_config(dc.time_slicing("Long")), ["gpu"], source="FromClass"),
    )
    obj = claim.to_json(POOL)
    obj["status"]["allocation"]["devices"]["config"].reverse()  # the class entry last in the list
    assert obj["status"]["allocation"]["devices"]["config"][-1]["source"] == "FromClass"
    ref = ClaimRef("default", "c1", claim.uid)
    device = next(d for d in plan.devices if d.id == "gpu-4")
    [s] = resolve(obj, ref, "gpu.nvidia.com", [Result("gpu", device)])
    assert s is not None and s.interval == "Short"


def test_a_later_entry_wins_and_a_shadowed_bad_one_is_never_checked(plan: ResourcePlan) -> None:
    """Of two entries for one request the later applies; only entries that apply are normalized
    and validated (prepareDevices: Normalize and Validate run over configResultsMap), so a bad
    interval in a shadowed entry is no error, as on NVIDIA's driver."""
    claim = one(
        [dc.Request("gpu", ["gpu-4"])],
        dc.Config(dc.gpu_config(dc.time_slicing("Fortnightly")), ["gpu"]),
        dc.Config(dc.gpu_config(dc.time_slicing("Medium")), ["gpu"]),
    )
    [s] = sharing_of(plan, claim)
    assert s is not None and s.interval == "Medium"


def test_an_entry_for_a_request_beats_a_later_entry_for_all_only_if_later(plan: ResourcePlan) -> None:
    """An entry for all requests applies where it comes after the request's own entry, and is
    overruled by one after it (the backward walk stops at the first entry that names the request
    or names none)."""
    for_all = dc.Config(dc.gpu_config(dc.time_slicing("Short")))
    for_gpu = dc.Config(dc.gpu_config(dc.time_slicing("Long")), ["gpu"])
    [a] = sharing_of(plan, one([dc.Request("gpu", ["gpu-4"])], for_gpu, for_all))
    [b] = sharing_of(plan, one([dc.Request("gpu", ["gpu-4"])], for_all, for_gpu))
    assert (a and a.interval, b and b.interval) == ("Short", "Long")


def test_an_entry_for_all_requests_skips_devices_of_the_other_kind(plan: ResourcePlan) -> None:
    """An entry without requests applies to each device it fits and is skipped by the others, which
    fall through to NVIDIA's defaults (prepareDevices: `len(c.Requests) == 0` ... `continue`)."""
    claim = one(
        [dc.Request("gpu", ["gpu-4"]), dc.Request("mig", [MIG0], "mig.nvidia.com")],
        dc.Config(dc.gpu_config(dc.time_slicing("Long"))),
    )
    ts, mig = sharing_of(plan, claim)
    assert ts is not None and ts.interval == "Long" and mig is None


def test_a_subrequest_result_is_matched_by_its_full_name(plan: ResourcePlan) -> None:
    """NVIDIA matches an entry's requests against the result's request as the result names it,
    `<request>/<subrequest>` (slices.Contains(c.Requests, result.Request)): an entry for the
    subrequest applies, one for its parent request alone does not."""
    requests = [dc.Request("gpu", ["gpu-4"], subrequest="big")]
    [sub] = sharing_of(plan, one(requests, dc.Config(dc.gpu_config(dc.time_slicing("Long")), ["gpu/big"])))
    [parent] = sharing_of(plan, one(requests, dc.Config(dc.gpu_config(dc.time_slicing("Long")), ["gpu"])))
    assert sub is not None and sub.interval == "Long" and parent is None


def test_another_drivers_entry_is_ignored_even_when_it_is_no_config_of_ours(plan: ResourcePlan) -> None:
    """An entry of another driver is skipped undecoded (GetOpaqueDeviceConfigs: `config.Opaque.Driver
    != driverName` ... continue)."""
    claim = one(
        [dc.Request("gpu", ["gpu-4"])], dc.Config({"anything": ["at", "all"]}, driver="other.example.com")
    )
    assert sharing_of(plan, claim) == [None]


# --------------------------------------------------------------------------- defaults
def test_time_slicing_without_its_config_defaults_to_the_default_interval(plan: ResourcePlan) -> None:
    """GpuConfig.Normalize gives TimeSlicing without timeSlicingConfig the interval Default."""
    [s] = sharing_of(
        plan, one([dc.Request("gpu", ["gpu-4"])], dc.Config(dc.gpu_config(dc.time_slicing(None))))
    )
    assert s is not None and s.interval == "Default"


def test_mps_without_its_config_sets_no_limits(plan: ResourcePlan) -> None:
    """Normalize gives MPS without mpsConfig an empty MpsConfig: a daemon with no limits."""
    [s] = sharing_of(plan, one([dc.Request("gpu", ["gpu-4"])], dc.Config(dc.gpu_config(dc.mps()))))
    assert s == DeviceSharing(MPS, uuid(plan, "gpu-4"), uuid(plan, "gpu-4"))


def test_a_config_without_sharing_and_time_slicing_on_mig_change_nothing(plan: ResourcePlan) -> None:
    """A GpuConfig without sharing is NVIDIA's default; TimeSlicing on a MIG device passes
    validation and sets nothing (MigDeviceSharing.GetTimeSlicingConfig returns nil)."""
    [a] = sharing_of(plan, one([dc.Request("gpu", ["gpu-4"])], dc.Config(dc.gpu_config())))
    mig = dc.Config(dc.mig_config({"strategy": "TimeSlicing", "mpsConfig": {}}))
    [b] = sharing_of(plan, one([dc.Request("mig", [MIG0], "mig.nvidia.com")], mig))
    assert a is None and b is None


def test_a_default_limit_and_a_uuid_keyed_override(plan: ResourcePlan) -> None:
    """The default pinned limit covers every device; a per-device entry keyed by UUID overrides it
    for that one (MpsPerDevicePinnedMemoryLimit.Normalize); fractions of a MiB are dropped."""
    u4, u5 = uuid(plan, "gpu-4"), uuid(plan, "gpu-5")
    sharing = dc.mps(defaultPinnedDeviceMemoryLimit="2Gi", defaultPerDevicePinnedMemoryLimit={u5: "1.5Mi"})
    a, b = sharing_of(plan, one([dc.Request("gpu", ["gpu-4", "gpu-5"])], dc.Config(dc.gpu_config(sharing))))
    assert a is not None and a.pinned_memory_limit == 2 * GI
    assert a.per_device_pinned_memory_limit == ((u5, MIB),) and b is not None and b.uuid == u5
    assert a.uuid == u4


# --------------------------------------------------------------------------- refusals
REFUSED: list[tuple[str, Any, str]] = [
    ("unknown kind", {"apiVersion": dc.API, "kind": "TpuConfig"}, 'no kind "TpuConfig" is registered'),
    ("old version", {"apiVersion": "gpu.resource.nvidia.com/v1alpha1", "kind": "GpuConfig"}, "is registered for version"),
    ("no kind", {"apiVersion": dc.API}, "parameters.kind: missing"),
    ("no apiVersion", {"kind": "GpuConfig"}, "parameters.apiVersion: missing"),
    ("not an object", ["GpuConfig"], "parameters: expected an object"),
    ("unknown top field", dc.gpu_config(metadata={"name": "x"}), 'unknown field "metadata"'),
    ("wrong case", {"apiVersion": dc.API, "kind": "GpuConfig", "Sharing": {}}, 'unknown field "Sharing"'),
    ("unknown sharing field", dc.gpu_config({"strategy": "MPS", "mps": {}}), 'parameters.sharing: unknown field "mps"'),
    ("unknown ts field", dc.gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long", "x": 1}}), 'unknown field "x"'),
    ("unknown mps field", dc.gpu_config(dc.mps(threads=5)), 'mpsConfig: unknown field "threads"'),
    ("strategy type", dc.gpu_config({"strategy": 1}), "sharing.strategy: expected a string"),
    ("percentage type", dc.gpu_config(dc.mps(defaultActiveThreadPercentage="50")), "defaultActiveThreadPercentage: expected an integer"),
    ("percentage float", dc.gpu_config(dc.mps(defaultActiveThreadPercentage=50.0)), "expected an integer"),
    ("bad quantity", dc.gpu_config(dc.mps(defaultPinnedDeviceMemoryLimit="10 gigs")), "defaultPinnedDeviceMemoryLimit: '10 gigs' is no quantity"),
    ("bad per-device quantity", dc.gpu_config(dc.mps(defaultPerDevicePinnedMemoryLimit={"0": "lots"})), "defaultPerDevicePinnedMemoryLimit.0: 'lots' is no quantity"),
    ("timeSlicingConfig on MIG", dc.mig_config({"strategy": "TimeSlicing", "timeSlicingConfig": {}}), 'unknown field "timeSlicingConfig"'),
    ("too big", dc.gpu_config(dc.mps(defaultPerDevicePinnedMemoryLimit={str(i): "1Gi" for i in range(1000)})), "the API allows at most 10240"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "parameters", "words"), REFUSED, ids=[c for c, _, _ in REFUSED])
def test_strict_decoding_refuses_with_the_field_and_why(
    plan: ResourcePlan, case: str, parameters: Any, words: str
) -> None:
    """configapi.StrictDecoder (api.go: Strict: true): an unknown kind or version, a missing kind or
    apiVersion, an unknown field (case-sensitive, as sigs.k8s.io/json), a value of the wrong type,
    a quantity that does not parse: the claim's error names the entry and the field. Decoding runs
    for every entry of this driver, applied or not (GetOpaqueDeviceConfigs decodes them all)."""
    claim = one(
        [dc.Request("gpu", ["gpu-4"])], dc.Config(parameters, ["gpu"]), dc.Config(dc.gpu_config(), ["gpu"])
    )
    text = error_of(plan, claim)
    assert (
        words in text
        and "status.allocation.devices.config[0]" in text
        and text.startswith("claim default/c1: ")
    )


INVALID: list[tuple[str, Any, str]] = [
    ("no strategy", dc.gpu_config({}), "unknown GPU sharing strategy ''"),
    ("unknown strategy", dc.gpu_config({"strategy": "Exclusive"}), "unknown GPU sharing strategy 'Exclusive'"),
    ("bad interval", dc.gpu_config(dc.time_slicing("Fast")), "timeSlicingConfig.interval: unknown time-slice interval 'Fast'"),
    ("lowercase interval", dc.gpu_config(dc.time_slicing("long")), "unknown time-slice interval 'long'"),
    ("interval missing", dc.gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {}}), "interval: missing"),
    ("mpsConfig with TimeSlicing", dc.gpu_config({"strategy": "TimeSlicing", "mpsConfig": {}}), "cannot use MpsConfig with the 'TimeSlicing' strategy"),
    ("timeSlicingConfig with MPS", dc.gpu_config({"strategy": "MPS", "timeSlicingConfig": {"interval": "Long"}}), "cannot use TimeSlicingConfig with the 'MPS' strategy"),
    ("percentage 0", dc.gpu_config(dc.mps(defaultActiveThreadPercentage=0)), "0 is outside 1..100"),
    ("percentage 101", dc.gpu_config(dc.mps(defaultActiveThreadPercentage=101)), "101 is outside 1..100"),
    ("percentage negative", dc.gpu_config(dc.mps(defaultActiveThreadPercentage=-5)), "-5 is outside 1..100"),
    ("limit under 1Mi", dc.gpu_config(dc.mps(defaultPinnedDeviceMemoryLimit="1000Ki")), "value set too low"),
    ("negative limit", dc.gpu_config(dc.mps(defaultPinnedDeviceMemoryLimit="-1Gi")), "value set too low"),
    ("per-device null", dc.gpu_config(dc.mps(defaultPerDevicePinnedMemoryLimit={"0": None})), "value set too low"),
    ("per-device index out of range", dc.gpu_config(dc.mps(defaultPerDevicePinnedMemoryLimit={"1": "1Gi"})), "invalid device index: 1"),
    ("per-device unknown key", dc.gpu_config(dc.mps(defaultPerDevicePinnedMemoryLimit={"GPU-nope": "1Gi"})), "invalid device: 'GPU-nope'"),
    ("compute-domain kind", {"apiVersion": dc.API, "kind": "ComputeDomainChannelConfig"}, "configures no GPU or MIG device"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "parameters", "words"), INVALID, ids=[c for c, _, _ in INVALID])
def test_validation_of_the_entry_that_applies_refuses_with_why(
    plan: ResourcePlan, case: str, parameters: Any, words: str
) -> None:
    """validate.go and sharing.go: the strategy is TimeSlicing or MPS, the interval one of four, the
    other strategy's config is refused on a GPU, the thread share 1..100 (gpuvisor's bound; NVIDIA's
    Validate lets 0 through), a limit at least 1 MiB, a per-device key a device's UUID or index;
    another kind of the group configures nothing here ("not a recognized configuration")."""
    text = error_of(plan, one([dc.Request("gpu", ["gpu-4"])], dc.Config(parameters, ["gpu"])))
    assert words in text and "config[0] (FromClaim, requests gpu)" in text


def test_a_config_of_one_kind_for_a_device_of_the_other_is_refused(plan: ResourcePlan) -> None:
    """An entry naming a request whose device it does not fit is an error (prepareDevices: "cannot
    apply GpuConfig to device ..."), both ways, and a VfioDeviceConfig fits no device here."""
    gpu_on_mig = one(
        [dc.Request("mig", [MIG0], "mig.nvidia.com")], dc.Config(dc.gpu_config(dc.time_slicing()), ["mig"])
    )
    mig_on_gpu = one([dc.Request("gpu", ["gpu-4"])], dc.Config(dc.mig_config(dc.mps()), ["gpu"]))
    vfio = one(
        [dc.Request("gpu", ["gpu-4"])], dc.Config({"apiVersion": dc.API, "kind": "VfioDeviceConfig"}, ["gpu"])
    )
    assert f"cannot apply GpuConfig to device {MIG0} of request mig, a MIG device" in error_of(
        plan, gpu_on_mig
    )
    assert "cannot apply MigDeviceConfig to device gpu-4 of request gpu, a full GPU" in error_of(
        plan, mig_on_gpu
    )
    assert "cannot apply VfioDeviceConfig to device gpu-4" in error_of(plan, vfio)


def test_both_a_mig_and_a_gpu_config_for_one_device_refuse_when_the_wrong_one_wins(
    plan: ResourcePlan,
) -> None:
    """Two entries for one request, a GpuConfig and a MigDeviceConfig: the later decides, so on a
    full GPU a later MigDeviceConfig is an error, and an earlier one is shadowed."""
    gpu = dc.Config(dc.gpu_config(dc.time_slicing("Long")), ["gpu"])
    mig = dc.Config(dc.mig_config(dc.mps()), ["gpu"])
    assert "cannot apply MigDeviceConfig to device gpu-4" in error_of(
        plan, one([dc.Request("gpu", ["gpu-4"])], gpu, mig)
    )
    [s] = sharing_of(plan, one([dc.Request("gpu", ["gpu-4"])], mig, gpu))
    assert s is not None and s.interval == "Long"


def test_entries_that_are_not_ours_to_read_are_refused(plan: ResourcePlan) -> None:
    """An entry without opaque parameters (GetOpaqueDeviceConfigs: "only opaque parameters are
    supported"), an unknown source ("invalid config source"), and an entry for a request the claim
    does not have (the API server refuses such a claim; gpuvisor does not ignore it)."""
    claim = one([dc.Request("gpu", ["gpu-4"])])
    obj = claim.to_json(POOL)
    ref = ClaimRef("default", "c1", claim.uid)
    device = next(d for d in plan.devices if d.id == "gpu-4")
    cases = [
        ({"source": "FromClaim", "requests": ["gpu"]}, "only opaque parameters are supported"),
        ({"source": "FromNowhere", "opaque": {"driver": "gpu.nvidia.com", "parameters": dc.gpu_config()}}, "invalid config source"),
        (dc.Config(dc.gpu_config(), ["gpu", "typo"]).to_json(), "config[0].requests: the claim has no request 'typo'"),
    ]  # fmt: skip
    for entry, words in cases:
        obj["status"]["allocation"]["devices"]["config"] = [entry]
        with pytest.raises(ClaimConfigError, match=re.escape(words)):
            resolve(obj, ref, "gpu.nvidia.com", [Result("gpu", device)])


def test_two_mps_entries_in_one_claim_are_refused(plan: ResourcePlan) -> None:
    """gpuvisor runs one MPS daemon per claim: two MPS entries applying to one claim's devices are
    refused saying so (NVIDIA starts one daemon per entry)."""
    claim = one(
        [dc.Request("a", ["gpu-4"]), dc.Request("b", ["gpu-5"])],
        dc.Config(dc.gpu_config(dc.mps()), ["a"]),
        dc.Config(dc.gpu_config(dc.mps(defaultActiveThreadPercentage=10)), ["b"]),
    )
    assert "a second MPS configuration in one claim" in error_of(plan, claim)


def test_admin_access_devices_are_checked_but_not_shared(plan: ResourcePlan) -> None:
    """An adminAccess device's entry is decoded and validated as NVIDIA does (a bad one is still an
    error), but no sharing is applied to it: it sits beside the claim that holds the device."""
    admin = [dc.Request("gpu", ["gpu-4"], admin_access=True)]
    assert sharing_of(plan, one(admin, dc.Config(dc.gpu_config(dc.time_slicing("Long"))))) == [None]
    assert "unknown time-slice interval" in error_of(
        plan, one(admin, dc.Config(dc.gpu_config(dc.time_slicing("x"))))
    )


# --------------------------------------------------------------------------- quantities
@pytest.mark.parametrize(
    ("text", "value"),
    [("1Gi", GI), ("10Gi", 10 * GI), ("512M", 512 * 10**6), ("1.5Gi", 3 * GI // 2), ("1e9", 10**9), ("1E3", 10**3),
     ("2k", 2000), ("100m", 1), ("0.5", 1), ("+1Ki", 1024), ("-1Ki", -1024), (" 1Mi ", MIB), (".5Ki", 512), ("1.", 1), ("3E", 3 * 10**18)],
)  # fmt: skip
def test_quantities_parse_as_apimachinery_parses_them(text: str, value: int) -> None:
    """resource.ParseQuantity's grammar (binary and decimal suffixes, exponents, signs, fractions),
    blanks trimmed as Quantity.UnmarshalJSON trims them, rounded up as Quantity.Value() rounds."""
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    "text", ["", "Gi", "1GB", "1 Gi", "1gi", "0x10", "1e", "1e400", "1.2.3", "ten", "1" * 65, "10E"]
)
def test_what_is_no_quantity_is_refused(text: str) -> None:
    """Anything outside the grammar is refused, and so is what is beyond the bounds (an exponent
    over 30, 64 characters, more than an int64)."""
    with pytest.raises(QuantityError):
        parse_quantity(text)


def test_json_numbers_are_quantities_and_other_json_types_are_not() -> None:
    """A JSON number is a quantity written as a number (Quantity.UnmarshalJSON parses its text)."""
    assert json_quantity(1073741824) == GI and json_quantity(1.5e9) == 1500000000
    for bad in (True, None, [1], {"v": 1}, float("nan")):
        with pytest.raises(QuantityError):
            json_quantity(bad)
