"""The deployment artefacts under deploy/: kustomize manifests, the systemd unit and its installer.

Everything here runs offline with tools that are on a developer's machine: `kubectl kustomize`
renders each kustomization, `kubernetes-validate --strict` checks the result against the API
schemas (an unknown field fails), and `systemd-analyze` checks the unit without a running
systemd. A missing tool skips only the tests that need it, with the reason.

The rendered config files are also loaded with gpuvisor's own config loader, under the env vars
the DaemonSet sets, so a manifest whose env and ConfigMap disagree (MPS with the mixed MIG
strategy, a misspelt key) fails here and not on a node.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import helpers, manifests

REPO = Path(helpers.REPO)
KUBE = REPO / "deploy" / "kubernetes"
SYSTEMD = REPO / "deploy" / "systemd"
UNIT = SYSTEMD / "gpuvisor.service"
INSTALL = SYSTEMD / "install.sh"
EXEC_START = "/opt/gpuvisor/venv/bin/gpuvisor run"

KUSTOMIZATIONS = (
    "base",
    "overlays/default",
    "overlays/mig",
    "overlays/cpu-manager",
    "overlays/mps",
    "overlays/labels",
)
NAMESPACE = "gpuvisor"
ADMISSION_KINDS = (
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)  # base/node-restriction.yaml
METRICS_PORT = 9475
CONFIG_MOUNT = "/etc/gpuvisor"
DEVICE_PLUGINS = "/var/lib/kubelet/device-plugins"
RUN_VOLUME = "/run/gpuvisor"  # an emptyDir: mode 0777
RUN_DIR = "/run/gpuvisor/state"  # gpuvisor makes it 0700 inside the volume
MPS_ROOT = "/run/nvidia/mps"
POD_RESOURCES = "/var/lib/kubelet/pod-resources"
FEATURES_D = "/etc/kubernetes/node-feature-discovery/features.d"  # NFD's local feature files
# `systemd-analyze security` scores 0 (locked down) to 10 (exposed); the unit scores 2.4 today.
# Above 3 means a hardening line was lost.
MAX_EXPOSURE = 3.0
SUBPROCESS_TIMEOUT = 60


# --- rendering ------------------------------------------------------------------------------


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: it renders the kustomizations (`kubectl kustomize`)")
    return path


@functools.cache
def _rendered_text(kustomization: str) -> str:
    proc = subprocess.run(
        [_kubectl(), "kustomize", str(KUBE / kustomization)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{proc.stderr}"
    return proc.stdout


def _render(kustomization: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(_rendered_text(kustomization)) if doc]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _pod_spec(docs: list[dict[str, Any]], name: str = "gpuvisor") -> dict[str, Any]:
    return manifests.pod(manifests.daemonset(docs, name))


def _container(
    docs: list[dict[str, Any]], name: str = "gpuvisor", container_name: str = "gpuvisor"
) -> dict[str, Any]:
    container = manifests.container(manifests.daemonset(docs, name))
    assert container["name"] == container_name
    return container


def _volume_sources(docs: list[dict[str, Any]], name: str = "gpuvisor") -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in _pod_spec(docs, name)["volumes"]}


def _mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


# --- kustomize + schema validation -------------------------------------------------------------


def test_every_kustomization_validates_strictly(tmp_path: Path) -> None:
    """Base and every overlay render with kubectl kustomize and pass strict schema validation."""
    paths = []
    for kustomization in KUSTOMIZATIONS:
        path = tmp_path / (kustomization.replace("/", "-") + ".yaml")
        path.write_text(_rendered_text(kustomization))
        paths.append(path)
    for path in paths:  # one validator run per file keeps the failure message pointed
        proc = manifests.validate_strict([path], "--quiet")
        assert proc.returncode == 0, f"{path.name} is not valid:\n{proc.stdout}{proc.stderr}"


def test_strict_validation_rejects_an_unknown_field(tmp_path: Path) -> None:
    """The validator run above really fails a manifest with a misspelt field (so a pass means something)."""
    docs = _render("overlays/default")
    _container(docs)["securityContext"]["readOnlyRootFilesytem"] = True
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    proc = manifests.validate_strict([path], "--quiet")
    assert proc.returncode != 0
    assert "readOnlyRootFilesytem" in proc.stdout + proc.stderr


# --- what every rendering shares --------------------------------------------------------------


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_objects_live_in_their_own_namespace(kustomization: str) -> None:
    """The Namespace gpuvisor exists and every namespaced object (SA, ConfigMap, DaemonSet) is in it;
    the admission policy and its binding are cluster-scoped, as the ClusterRole."""
    docs = _render(kustomization)
    assert _one(docs, "Namespace")["metadata"]["name"] == NAMESPACE
    kinds = sorted(doc["kind"] for doc in docs)
    daemonsets = 2 if kustomization == "overlays/labels" else 1  # the labeller's own DaemonSet
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        *["DaemonSet"] * daemonsets,
        "Namespace",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    cluster_scoped = ("Namespace", "ClusterRole", "ClusterRoleBinding", *ADMISSION_KINDS)
    for doc in docs:
        if doc["kind"] not in cluster_scoped:
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["kind"]
    assert manifests.daemonset(docs, "gpuvisor")["metadata"]["name"] == "gpuvisor"
    assert _one(docs, "ConfigMap")["metadata"]["name"] == "gpuvisor-config"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_pod_is_scheduled_on_every_gpu_node_and_not_evicted(kustomization: str) -> None:
    """system-node-critical, tolerations for nvidia.com/gpu and CriticalAddonsOnly, NVIDIA's node affinity."""
    pod = _pod_spec(_render(kustomization))
    assert pod["priorityClassName"] == "system-node-critical"
    tolerations = pod["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    assert {"key": "CriticalAddonsOnly", "operator": "Exists"} in tolerations
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    # Separate terms are ORed: any one of the labels admits the node.
    assert sorted(
        (expr["key"], expr["operator"], tuple(expr["values"]))
        for term in terms
        for expr in term["matchExpressions"]
    ) == [
        ("feature.node.kubernetes.io/cpu-model.vendor_id", "In", ("NVIDIA",)),
        ("feature.node.kubernetes.io/pci-10de.present", "In", ("true",)),
        ("nvidia.com/gpu.present", "In", ("true",)),
    ]
    assert all(len(term["matchExpressions"]) == 1 for term in terms)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_probes_hit_healthz_and_readyz_on_the_metrics_port(kustomization: str) -> None:
    """Liveness (and startup) probe /healthz, readiness /readyz, on the port named metrics = 9475."""
    container = _container(_render(kustomization))
    assert container["ports"] == [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}]
    for probe, path in (
        ("livenessProbe", "/healthz"),
        ("startupProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
    assert manifests.env_of(container)["GPUVISOR_METRICS_ADDRESS"] == f"0.0.0.0:{METRICS_PORT}"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_container_runs_with_least_privilege(kustomization: str) -> None:
    """Root (for the kubelet socket) but no capabilities, read-only root, no escalation, RuntimeDefault seccomp."""
    docs = _render(kustomization)
    ctx = _container(docs)["securityContext"]
    assert ctx["runAsUser"] == 0
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert "privileged" not in ctx
    pod = _pod_spec(docs)
    assert "hostNetwork" not in pod and "hostPID" not in pod
    assert pod["serviceAccountName"] == "gpuvisor"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_token_grants_health_on_the_node_and_nothing_more(kustomization: str) -> None:
    """Node health is on (GPUVISOR_NODE_HEALTH, NODE_NAME from the downward API); the token's
    ClusterRole allows reading Nodes, patching nodes/status and writing Events, bound to the SA."""
    docs = _render(kustomization)
    env = manifests.env_of(_container(docs))
    assert (env["GPUVISOR_NODE_HEALTH"], env["NODE_NAME"]) == ("true", "fieldRef:spec.nodeName")
    assert _pod_spec(docs)["automountServiceAccountToken"] is True
    assert _one(docs, "ServiceAccount")["automountServiceAccountToken"] is True
    rules = {(tuple(r["resources"]), tuple(r["verbs"])) for r in _one(docs, "ClusterRole")["rules"]}
    assert rules == {
        (("nodes",), ("get",)),
        (("nodes/status",), ("patch",)),
        (("events",), ("create", "patch")),
    }
    binding = _one(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpuvisor", "namespace": NAMESPACE}]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "gpuvisor",
    }


@pytest.mark.parametrize(
    ("kustomization", "added"),
    [
        ("base", None),
        ("overlays/default", None),
        ("overlays/mig", ["SYS_ADMIN"]),
        ("overlays/cpu-manager", None),
        ("overlays/mps", None),
        ("overlays/labels", None),
    ],
)
def test_sys_admin_is_added_only_for_mig(kustomization: str, added: list[str] | None) -> None:
    """Only the mig overlay adds a capability, and only SYS_ADMIN (MIG capability device nodes)."""
    assert _container(_render(kustomization))["securityContext"]["capabilities"].get("add") == added


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_volumes_reach_the_kubelet_and_the_config_directory(kustomization: str) -> None:
    """Kubelet dir at its host path, an emptyDir run dir, and the ConfigMap as a directory (no subPath)."""
    docs = _render(kustomization)
    container = _container(docs)
    mounts = _mounts(container)
    volumes = _volume_sources(docs)
    assert all("subPath" not in m and "subPathExpr" not in m for m in mounts.values())

    plugins = mounts[DEVICE_PLUGINS]
    assert volumes[plugins["name"]]["hostPath"]["path"] == DEVICE_PLUGINS
    assert not plugins.get("readOnly", False)

    assert "emptyDir" in volumes[mounts[RUN_VOLUME]["name"]]
    assert manifests.env_of(container)["GPUVISOR_RUN_DIR"] == RUN_DIR
    # Strictly inside the emptyDir (which is 0777): gpuvisor creates the run dir itself, 0700.
    assert os.path.dirname(RUN_DIR) == RUN_VOLUME

    pod_resources = mounts[POD_RESOURCES]
    assert pod_resources["readOnly"] is True
    assert volumes[pod_resources["name"]]["hostPath"]["path"] == POD_RESOURCES

    config = mounts[CONFIG_MOUNT]
    assert config["readOnly"] is True
    assert volumes[config["name"]]["configMap"]["name"] == "gpuvisor-config"
    assert manifests.env_of(container)["CONFIG_FILE"] == f"{CONFIG_MOUNT}/config.yaml"
    assert "config.yaml" in _one(docs, "ConfigMap")["data"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_image_env_and_resources(kustomization: str) -> None:
    """Image gpuvisor:latest via kustomize, JSON logs, NVIDIA runtime env, requests and a memory limit."""
    container = _container(_render(kustomization))
    assert container["image"] == "gpuvisor:latest"
    assert container["args"] == ["run"]
    env = manifests.env_of(container)
    assert env["GPUVISOR_LOG_FORMAT"] == "json"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    # The MPS overlay runs MPS control daemons: their binaries come with the "compute" capability.
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == (
        "compute,utility" if kustomization == "overlays/mps" else "utility"
    )
    resources = container["resources"]
    assert resources["requests"] == {"cpu": "50m", "memory": "128Mi"}
    assert resources["limits"] == {"memory": "384Mi"}


# --- what each overlay changes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kustomization", "env_expected", "host_ipc"),
    [
        ("overlays/default", {}, False),
        ("overlays/mig", {"MIG_STRATEGY": "mixed"}, False),
        ("overlays/cpu-manager", {"PASS_DEVICE_SPECS": "true"}, False),
        ("overlays/mps", {"MPS_ROOT": MPS_ROOT}, True),
        ("overlays/labels", {}, False),
    ],
)
def test_overlay_sets_its_own_settings_only(
    kustomization: str, env_expected: dict[str, str], host_ipc: bool
) -> None:
    """Each overlay adds its env var (MIG_STRATEGY, PASS_DEVICE_SPECS, MPS_ROOT) and nothing of the others."""
    docs = _render(kustomization)
    env = manifests.env_of(_container(docs))
    for name in ("MIG_STRATEGY", "PASS_DEVICE_SPECS", "MPS_ROOT"):
        assert env.get(name) == env_expected.get(name), name
    assert _pod_spec(docs).get("hostIPC", False) is host_ipc


def test_mps_overlay_mounts_the_mps_root_and_configures_sharing() -> None:
    """mps: MPS_ROOT is a writable hostPath at the same path, /dev/shm is MPS_ROOT/shm, the config holds sharing.mps."""
    docs = _render("overlays/mps")
    mount = _mounts(_container(docs))[MPS_ROOT]
    assert _volume_sources(docs)[mount["name"]]["hostPath"]["path"] == MPS_ROOT
    assert not mount.get("readOnly", False)  # gpuvisor's MPS daemons write their pipes there
    shm = _mounts(_container(docs))["/dev/shm"]
    assert _volume_sources(docs)[shm["name"]]["hostPath"]["path"] == f"{MPS_ROOT}/shm"
    config = yaml.safe_load(_one(docs, "ConfigMap")["data"]["config.yaml"])
    assert config["sharing"]["mps"]["resources"][0]["replicas"] >= 2


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_rendered_config_loads_under_the_daemonset_env(kustomization: str, tmp_path: Path) -> None:
    """gpuvisor's loader accepts each ConfigMap under the pod's env, with no unknown keys."""
    from supervisor.config import load_config

    docs = _render(kustomization)
    path = tmp_path / "config.yaml"
    path.write_text(_one(docs, "ConfigMap")["data"]["config.yaml"])
    env = {**manifests.env_of(_container(docs)), "CONFIG_FILE": str(path)}
    config = load_config(None, env)
    assert config.unknown_keys == ()
    assert config.metrics_address == f"0.0.0.0:{METRICS_PORT}"
    assert config.run_dir == RUN_DIR
    assert config.log_format == "json"
    assert config.mig_strategy == ("mixed" if kustomization == "overlays/mig" else "none")
    assert config.pass_device_specs is (kustomization == "overlays/cpu-manager")
    assert config.sharing.strategy == ("mps" if kustomization == "overlays/mps" else "none")


def test_labels_overlay_runs_the_labeller_into_nfds_features_d() -> None:
    """labels: a gpuvisor-labels DaemonSet runs `gpuvisor labels` in file mode, NFD's features.d host path
    mounted writable at the same path (the default --output-file lands there), on the plugin's GPU nodes."""
    docs = _render("overlays/labels")
    container = _container(docs, "gpuvisor-labels", "labels")
    assert container["image"] == "gpuvisor:latest" and container["args"] == ["labels"]
    env = manifests.env_of(container)
    assert env["GFD_USE_NODE_FEATURE_API"] == "false"
    assert "GFD_OUTPUT_FILE" not in env  # GFD's default path, inside the mount below
    mount = _mounts(container)[FEATURES_D]
    assert not mount.get("readOnly", False)
    assert _volume_sources(docs, "gpuvisor-labels")[mount["name"]]["hostPath"] == {
        "path": FEATURES_D,
        "type": "DirectoryOrCreate",
    }
    config = _mounts(container)[CONFIG_MOUNT]
    assert config["readOnly"] is True and env["CONFIG_FILE"] == f"{CONFIG_MOUNT}/config.yaml"
    assert _volume_sources(docs, "gpuvisor-labels")[config["name"]]["configMap"]["name"] == "gpuvisor-config"
    plugin, labeller = _pod_spec(docs), _pod_spec(docs, "gpuvisor-labels")
    assert labeller["affinity"] == plugin["affinity"] and labeller["tolerations"] == plugin["tolerations"]


def test_labels_overlay_is_least_privilege() -> None:
    """The labeller: no token, no kubelet directory, read-only root, all capabilities dropped but SYS_ADMIN
    (the vGPU label reads PCI configuration space past byte 64)."""
    docs = _render("overlays/labels")
    pod = _pod_spec(docs, "gpuvisor-labels")
    ctx = _container(docs, "gpuvisor-labels", "labels")["securityContext"]
    assert pod["automountServiceAccountToken"] is False and "hostNetwork" not in pod and "hostPID" not in pod
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert "privileged" not in ctx
    assert DEVICE_PLUGINS not in _mounts(_container(docs, "gpuvisor-labels", "labels"))


def test_labels_overlay_config_loads_for_the_labeller(tmp_path: Path) -> None:
    """`gpuvisor labels`' loader accepts the ConfigMap under the labeller's env: file mode, GFD's output path."""
    from supervisor.labels.settings import DEFAULT_OUTPUT_FILE, load_label_settings

    docs = _render("overlays/labels")
    path = tmp_path / "config.yaml"
    path.write_text(_one(docs, "ConfigMap")["data"]["config.yaml"])
    env = {**manifests.env_of(_container(docs, "gpuvisor-labels", "labels")), "CONFIG_FILE": str(path)}
    settings = load_label_settings(None, env)
    assert settings.use_node_feature_api is False
    assert settings.output_file == DEFAULT_OUTPUT_FILE and settings.output_file.startswith(FEATURES_D + "/")
    assert settings.log_format == "json"


def test_systemd_example_config_loads() -> None:
    """deploy/systemd/config.yaml loads with gpuvisor's loader, with no unknown keys."""
    from supervisor.config import load_config

    config = load_config(None, {"CONFIG_FILE": str(SYSTEMD / "config.yaml")})
    assert config.unknown_keys == ()


# --- systemd ------------------------------------------------------------------------------------


def _unit_entries() -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment; keys such as DeviceAllow repeat."""
    entries: list[tuple[str, str, str]] = []
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.append((section, key.strip(), value.strip()))
    return entries


def _unit_values(key: str) -> list[str]:
    return [value for _, k, value in _unit_entries() if k == key]


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("Type", ["notify"]),
        ("ExecStart", [EXEC_START]),
        ("ExecReload", ["/bin/kill -HUP $MAINPID"]),
        ("Restart", ["always"]),
        ("RestartSec", ["1"]),
        ("RestartPreventExitStatus", ["78"]),
        ("WatchdogSec", ["30"]),
        ("KillMode", ["mixed"]),
        ("TimeoutStopSec", ["10"]),
        ("RuntimeDirectory", ["gpuvisor"]),
        ("RuntimeDirectoryMode", ["0700"]),
        ("EnvironmentFile", ["-/etc/default/gpuvisor"]),
        ("NoNewPrivileges", ["yes"]),
        ("ProtectSystem", ["strict"]),
        ("ReadWritePaths", [f"{DEVICE_PLUGINS} -/var/run/cdi"]),
        ("ProtectHome", ["yes"]),
        ("PrivateTmp", ["yes"]),
        ("PrivateDevices", []),
        ("MemoryDenyWriteExecute", []),
        ("DevicePolicy", ["closed"]),
        (
            "DeviceAllow",
            ["/dev/nvidiactl rw", "char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps rw"],
        ),
        ("CapabilityBoundingSet", [""]),
        ("RestrictAddressFamilies", ["AF_UNIX AF_INET AF_INET6 AF_NETLINK"]),
        ("SystemCallFilter", ["@system-service"]),
    ],
)
def test_unit_setting(key: str, expected: list[str]) -> None:
    """The unit's lifecycle and hardening settings are the chosen ones (absent when expected is [])."""
    assert _unit_values(key) == expected


def test_unit_points_config_file_at_etc() -> None:
    """CONFIG_FILE=/etc/gpuvisor/config.yaml is set, before the env file that may override it."""
    assert "CONFIG_FILE=/etc/gpuvisor/config.yaml" in _unit_values("Environment")


def _systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    return path


def _unit_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at an executable that exists here.

    `systemd-analyze verify` fails a unit whose ExecStart binary is missing, and
    /opt/gpuvisor/venv exists only on an installed node, so the copy points at a stand-in script;
    every other line is the shipped unit's.
    """
    text = UNIT.read_text()
    assert f"ExecStart={EXEC_START}\n" in text
    binary = tmp_path / "bin" / "gpuvisor"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    copy = tmp_path / "gpuvisor.service"  # verify wants the real unit name
    copy.write_text(text.replace(f"ExecStart={EXEC_START}", f"ExecStart={binary} run"))
    return copy


def test_unit_passes_systemd_analyze_verify_silently(tmp_path: Path) -> None:
    """`systemd-analyze verify` prints nothing at all (it only warns, exit 0, on unknown keys)."""
    tool = _systemd_analyze()
    proc = subprocess.run(
        [tool, "verify", str(_unit_copy(tmp_path))],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def test_unit_exposure_score_stays_low(tmp_path: Path) -> None:
    """`systemd-analyze security --offline=true` rates the unit at most MAX_EXPOSURE."""
    tool = _systemd_analyze()
    proc = subprocess.run(
        [tool, "security", "--offline=true", str(_unit_copy(tmp_path))],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )
    if proc.returncode != 0 and "offline" in proc.stderr:
        pytest.skip(f"this systemd-analyze has no --offline: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"Overall exposure level for gpuvisor\.service: ([0-9.]+)", proc.stdout)
    assert match is not None, proc.stdout
    score = float(match.group(1))
    print(f"systemd-analyze security exposure of gpuvisor.service: {score} (threshold {MAX_EXPOSURE})")
    assert score <= MAX_EXPOSURE


# --- install.sh ---------------------------------------------------------------------------------


def _install(*args: str | Path, timeout: float = SUBPROCESS_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(INSTALL), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


STAGED = {
    "etc/systemd/system/gpuvisor.service": UNIT,
    "etc/gpuvisor/config.yaml": SYSTEMD / "config.yaml",
    "etc/default/gpuvisor": SYSTEMD / "gpuvisor.env",
}


def test_install_stages_unit_config_and_env_file(tmp_path: Path) -> None:
    """install.sh --prefix --no-venv places the unit, config and env file (0644) and calls no systemctl."""
    proc = _install("--prefix", tmp_path, "--no-venv")
    assert proc.returncode == 0, proc.stderr
    assert "systemctl was not called" in proc.stdout
    for rel, source in STAGED.items():
        staged = tmp_path / rel
        assert staged.read_bytes() == source.read_bytes(), rel
        assert stat.S_IMODE(staged.stat().st_mode) == 0o644, rel
    assert not (tmp_path / "opt").exists()


def test_install_keeps_an_edited_config(tmp_path: Path) -> None:
    """A second install replaces the unit but keeps the operator's config.yaml and env file."""
    assert _install("--prefix", tmp_path, "--no-venv").returncode == 0
    edited = "version: v1\nflags:\n  migStrategy: mixed\n"
    (tmp_path / "etc/gpuvisor/config.yaml").write_text(edited)
    (tmp_path / "etc/default/gpuvisor").write_text("MIG_STRATEGY=mixed\n")
    (tmp_path / "etc/systemd/system/gpuvisor.service").write_text("stale\n")
    proc = _install("--prefix", tmp_path, "--no-venv")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "etc/gpuvisor/config.yaml").read_text() == edited
    assert (tmp_path / "etc/default/gpuvisor").read_text() == "MIG_STRATEGY=mixed\n"
    assert (tmp_path / "etc/systemd/system/gpuvisor.service").read_bytes() == UNIT.read_bytes()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unknown option --bogus"),
        (["--prefix"], "--prefix needs a directory"),
        (["--prefix", "{tmp}"], "SOURCE (a gpuvisor wheel or source tree) is required"),
        (["--prefix", "{tmp}", "{tmp}/missing.whl"], "does not exist"),
        (["--prefix", "{tmp}", "a", "b"], "only one SOURCE may be given"),
        (["--prefix", "{tmp}", "--python", "no-such-python3", "{tmp}"], "no Python interpreter"),
    ],
)
def test_install_rejects_bad_usage_clearly(args: list[str], message: str, tmp_path: Path) -> None:
    """Bad arguments end with exit 2 and one line naming the problem, and install nothing."""
    proc = _install(*(arg.replace("{tmp}", str(tmp_path)) for arg in args))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert not (tmp_path / "etc").exists()


@pytest.mark.slow
def test_install_builds_a_dedicated_venv(tmp_path: Path) -> None:
    """install.sh --prefix with a source tree makes opt/gpuvisor/venv whose gpuvisor runs (~20 s:
    pip), with the dataclass code cache written in it."""
    source = tmp_path / "src"
    source.mkdir()
    # A copy, so that pip's in-tree build leaves no build/ or egg-info in the work tree.
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, source / name)
    for package in ("common", "supervisor", "worker"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    stage = tmp_path / "stage"
    proc = _install("--prefix", stage, "--python", sys.executable, source, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    venv = stage / "opt/gpuvisor/venv"
    assert (venv / "pyvenv.cfg").exists()
    gpuvisor = venv / "bin" / "gpuvisor"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:  # as installed, outside the checkout
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT,
            env=env,
            cwd=tmp_path,
            check=False,
        )

    help_text = run(str(gpuvisor), "run", "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "--metrics-address" in help_text.stdout
    # The cache of the code the dataclasses compile (common/methodcache.py) is written beside the
    # installed bytecode, where the unit's ProtectSystem=strict keeps the service from writing it.
    cache = run(
        str(venv / "bin" / "python"), "-c", "from common import methodcache; print(methodcache.cache_path())"
    )
    assert cache.returncode == 0, cache.stderr
    assert cache.stdout.strip().startswith(str(venv)) and os.path.getsize(cache.stdout.strip()) > 0


def test_mig_overlay_asks_the_runtime_for_the_mig_monitor_devices() -> None:
    """mig: NVIDIA_MIG_MONITOR_DEVICES=all, as NVIDIA's chart sets it on MIG nodes; not elsewhere."""
    assert manifests.env_of(_container(_render("overlays/mig"))).get("NVIDIA_MIG_MONITOR_DEVICES") == "all"
    assert "NVIDIA_MIG_MONITOR_DEVICES" not in manifests.env_of(_container(_render("overlays/default")))
