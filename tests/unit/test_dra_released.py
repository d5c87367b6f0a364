"""`ReleasedResources._pass` (supervisor/dra/released.py): when a device-plugin resource the
kubelet left at 0 is removed from the Node's status, with a fake client and checkpoint files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from supervisor.dra.released import VERIFY_S, ReleasedResources
from supervisor.kube.errors import ApiError
from supervisor.observe.allocations import registered_resources as kubelet_registered

GPU = "nvidia.com/gpu"


class FakeClient:
    """A Node whose status the test sets; a JSON patch applies `test`/`remove` like the server."""

    stopped = False

    def __init__(self, capacity: dict[str, str], allocatable: dict[str, str]) -> None:
        self.status = {"capacity": dict(capacity), "allocatable": dict(allocatable)}
        self.patches: list[Any] = []
        self.gets = 0

    def get(self, path: str, *, what: str) -> Any:
        self.gets += 1
        return {"status": json.loads(json.dumps(self.status))}

    def request(self, method: str, path: str, *, what: str, body: Any, content_type: str) -> Any:
        self.patches.append(body)
        for op in body:
            part, key = op["path"].split("/")[2], op["path"].split("/")[3].replace("~1", "/")
            if op["op"] == "test" and self.status[part].get(key) != op["value"]:
                raise ApiError(what, 422, "Invalid", "testing value failed")
        for op in body:
            part, key = op["path"].split("/")[2], op["path"].split("/")[3].replace("~1", "/")
            if op["op"] == "remove":
                del self.status[part][key]
        return None


def _checkpoint(directory: Path, registered: dict[str, list[str]]) -> None:
    data = {"Data": {"PodDeviceEntries": [], "RegisteredDevices": registered}, "Checksum": 1}
    (directory / "kubelet_internal_checkpoint").write_text(json.dumps(data))


def _released(tmp_path: Path, client: FakeClient) -> ReleasedResources:
    return ReleasedResources(client, node_name="n1", plugin_dir=str(tmp_path))  # type: ignore[arg-type]


def test_the_kubelets_checkpoint_says_which_resources_it_still_has(tmp_path: Path) -> None:
    """RegisteredDevices' keys (a resource with no device too); None without a readable file."""
    assert kubelet_registered(str(tmp_path)) is None
    _checkpoint(tmp_path, {GPU: [], "example.com/x": ["a"]})
    assert kubelet_registered(str(tmp_path)) == frozenset({GPU, "example.com/x"})
    (tmp_path / "kubelet_internal_checkpoint").write_text("{not json")
    assert kubelet_registered(str(tmp_path)) is None


def test_while_the_checkpoint_lists_it_nothing_is_asked_of_the_api_server(tmp_path: Path) -> None:
    """The kubelet still has nvidia.com/gpu (grace period): no GET, no patch, a look again soon."""
    _checkpoint(tmp_path, {GPU: []})
    client = FakeClient({GPU: "0"}, {GPU: "0"})
    released = _released(tmp_path, client)
    assert released._pass(frozenset({GPU})) == released.check_s
    assert (client.gets, client.patches) == (0, [])
    assert released.status()["kubelet_holds"] == [GPU]


def test_a_counted_resource_is_left_and_a_zero_one_removed_with_tests(tmp_path: Path) -> None:
    """Allocatable above 0 (a plugin serves it): left, looked at again. At 0 and off the
    checkpoint: one patch that tests both values before removing them; then nothing more to do."""
    _checkpoint(tmp_path, {})
    client = FakeClient({GPU: "2"}, {GPU: "2"})
    released = _released(tmp_path, client)
    assert released._pass(frozenset({GPU})) == released.check_s and client.patches == []
    client.status = {"capacity": {GPU: "0"}, "allocatable": {GPU: "0"}}
    assert released._pass(frozenset({GPU})) is None
    assert [op["op"] for op in client.patches[0]] == ["test", "remove", "test", "remove"]
    assert [op.get("value") for op in client.patches[0]] == ["0", None, "0", None]
    assert client.status == {"capacity": {}, "allocatable": {}}
    assert released._pass(frozenset({GPU})) is None and len(client.patches) == 1


def test_a_lost_zero_update_is_removed_only_where_the_checkpoint_says_the_kubelet_forgot(
    tmp_path: Path,
) -> None:
    """The kubelet writes a forgotten resource's 0 once; where that update was lost the Node keeps
    the grace period's 8 with allocatable 0. With the checkpoint not listing it, the patch tests 8
    as read and allocatable 0; without a checkpoint to go by, capacity must read 0."""
    client = FakeClient({GPU: "8"}, {GPU: "0"})
    released = _released(tmp_path, client)
    assert released._pass(frozenset({GPU})) == released.check_s and client.patches == []
    _checkpoint(tmp_path, {})
    assert released._pass(frozenset({GPU})) is None
    assert [op.get("value") for op in client.patches[0]] == ["8", None, "0", None]
    assert client.status == {"capacity": {}, "allocatable": {}}


def test_a_switch_back_and_forth_looks_again_at_what_was_removed(tmp_path: Path) -> None:
    """Removed once; the node runs as a device plugin again and the kubelet writes the key back;
    back in DRA mode the key is removed again (what the thread found is forgotten at a switch)."""
    _checkpoint(tmp_path, {})
    client = FakeClient({GPU: "0"}, {GPU: "0"})
    released = _released(tmp_path, client)
    released.want(frozenset({GPU}), False)
    assert released.step() is None and len(client.patches) == 1
    released.want(frozenset({GPU}), True)
    assert released.step() is None
    client.status = {"capacity": {GPU: "0"}, "allocatable": {GPU: "0"}}
    released.want(frozenset({GPU}), False)
    assert released.step() is None and len(client.patches) == 2 and client.status["capacity"] == {}


def test_a_failed_test_leaves_the_key_and_looks_again(tmp_path: Path) -> None:
    """The kubelet counted devices again between the GET and the patch (the server answers 422):
    nothing is counted as removed, and the next look comes soon."""
    _checkpoint(tmp_path, {})
    client = FakeClient({GPU: "0"}, {GPU: "0"})
    released = _released(tmp_path, client)
    original = client.get

    def racing_get(path: str, *, what: str) -> Any:
        answer = original(path, what=what)
        client.status["capacity"][GPU] = "4"
        return answer

    client.get = racing_get  # type: ignore[method-assign]
    assert released._pass(frozenset({GPU})) == released.check_s
    assert released.removals == 0 and client.status["capacity"][GPU] == "4"


def test_without_a_checkpoint_a_removal_is_verified_at_doubling_intervals(tmp_path: Path) -> None:
    """No checkpoint to go by: removed, then looked at again after VERIFY_S; written back by the
    kubelet, it is counted, removed again, and the next look waits twice as long."""
    client = FakeClient({GPU: "0"}, {})
    released = _released(tmp_path, client)
    assert released._pass(frozenset({GPU})) == VERIFY_S
    assert [op["op"] for op in client.patches[0]] == ["test", "remove"]
    client.status["capacity"][GPU] = "0"  # the kubelet's next update, within its grace period
    assert released._pass(frozenset({GPU})) == VERIFY_S * 2
    assert released.readded == 1 and released.removals == 2
    assert released._pass(frozenset({GPU})) is None  # gone at the next look: done
    assert released.status()["readded"] == 1


def test_a_resource_the_kubelet_keeps_counting_is_looked_at_less_and_less(tmp_path: Path) -> None:
    """Another plugin serves nvidia.com/gpu for good (capacity above 0, no checkpoint to go by):
    the Node is read at doubling intervals, up to a minute, never faster."""
    from supervisor.dra.released import WAIT_MAX_S

    client = FakeClient({GPU: "8"}, {GPU: "8"})
    released = _released(tmp_path, client)
    pauses = [released._pass(frozenset({GPU})) for _ in range(8)]
    assert pauses[:3] == [2.0, 4.0, 8.0] and pauses[-1] == WAIT_MAX_S
    assert client.patches == []
