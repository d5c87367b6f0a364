"""The Helm chart deploy/helm/gpuvisor: NVIDIA's chart values, rendered into gpuvisor's DaemonSet.

The chart is rendered and linted by Helm's own Go SDK (`helm_python`, PyPI helm-python-sdk: no helm
binary, no cluster; `lookup` returns nothing, as under `helm template`), and every rendered object
goes through `kubernetes-validate --strict` as the kustomize manifests do in test_deploy.py.

Values are written the way NVIDIA's chart documentation writes them (its README, "Deployment via
helm" and "Shared Access to GPUs", and docs/cdi.md at v0.20.0). A value's meaning is checked
where it lands: the env var, mount or privilege in the rendered pod, and, for everything gpuvisor
reads, gpuvisor's own config loader run under the pod's env with the ConfigMap's files, so a
misspelt env var name or a config key the chart points at wrongly fails here.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import helpers, manifests

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (test extra)")

REPO = Path(helpers.REPO)
CHART = REPO / "deploy" / "helm" / "gpuvisor"
BASE_DAEMONSET = REPO / "deploy" / "kubernetes" / "base" / "daemonset.yaml"
RELEASE = "gpuvisor"
NAMESPACE = "gpu-system"
CONFIG_DIR = "/etc/gpuvisor"
PLUGINS = "/var/lib/kubelet/device-plugins"
FEATURES_D = "/etc/kubernetes/node-feature-discovery/features.d"

# --- values files, as NVIDIA's documentation writes them -----------------------------------------

# README "Multiple Config File Example": two configs and config.default.
NODE = "gpu-node-1"

CONFIG0 = """\
version: v1
flags:
  migStrategy: "none"
  failOnInitError: true
  nvidiaDriverRoot: "/"
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: envvar
    deviceIDStrategy: uuid
"""
CONFIG1 = CONFIG0.replace('migStrategy: "none"', 'migStrategy: "mixed" # Only change from config0.yaml')

VALUES_FILES: dict[str, str] = {
    "default": "",
    # README "With CUDA Time-Slicing", passed as the README's single config (`config.map.config`).
    "time-slicing": """
config:
  map:
    config: |-
      version: v1
      sharing:
        timeSlicing:
          resources:
          - name: nvidia.com/gpu
            replicas: 10
""",
    # README "With CUDA MPS".
    "mps": """
config:
  map:
    default: |-
      version: v1
      sharing:
        mps:
          resources:
          - name: nvidia.com/gpu
            replicas: 10
""",
    # README "Setting other helm chart values": the CPU manager and the mixed MIG strategy.
    "mig-mixed": """
compatWithCPUManager: true
migStrategy: mixed
""",
    # docs/cdi.md "Configuration".
    "cdi": """
runtimeClassName: nvidia
nvidiaDriverRoot: /
deviceListStrategy: cdi-annotations
""",
    "several-configs": "config:\n  default: config0\n  map:\n    config0: |-\n"
    + "".join(f"      {line}\n" for line in CONFIG0.splitlines())
    + "    config1: |-\n"
    + "".join(f"      {line}\n" for line in CONFIG1.splitlines()),
    # README "Deploying with gpu-feature-discovery for automatic node labels".
    "gfd": "gfd:\n  enabled: true\n",
    # Standalone labeller writing NFD's features.d file, as GFD with --use-node-feature-api=false.
    "gfd-file": """
devicePlugin:
  enabled: false
gfd:
  enabled: true
  useNodeFeatureAPI: false
migStrategy: single
""",
    # gpuvisor's DRA mode: every node the DRA driver gpu.nvidia.com.
    "dra": "gpuvisor:\n  mode: dra\n",
    # A node moved to DRA by its label: one named config chooses mode dra.
    "dra-by-label": """
config:
  default: plugin
  map:
    plugin: |-
      version: v1
    dra: |-
      version: v1
      gpuvisor:
        mode: dra
""",
    "service-monitor": """
gpuvisor:
  metrics:
    port: 9500
    serviceMonitor:
      enabled: true
      interval: 30s
      labels:
        release: prometheus
""",
}


def _values(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(VALUES_FILES[name]) or {}
    return loaded


# --- rendering -----------------------------------------------------------------------------------


@functools.cache
def _chart() -> Any:
    return helm_python.Chart.load(str(CHART))


def _render_raw(values: dict[str, Any], namespace: str = NAMESPACE) -> dict[str, str]:
    rendered: dict[str, str] = _chart().render(values, name=RELEASE, namespace=namespace)
    return rendered


def _render(values: dict[str, Any], namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    return [
        doc
        for path, text in sorted(_render_raw(values, namespace).items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def _notes(values: dict[str, Any]) -> str:
    return _render_raw(values)[f"{RELEASE}/templates/NOTES.txt"]


def _refusal(values: dict[str, Any], namespace: str = NAMESPACE) -> str:
    with pytest.raises(helm_python.HelmError) as caught:
        _render_raw(values, namespace)
    return str(caught.value)


def _plugin(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return manifests.daemonset(docs, "gpuvisor")


def _labeller(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return manifests.daemonset(docs, "gpuvisor-gpu-feature-discovery")


def _env(daemonset: dict[str, Any]) -> dict[str, str]:
    """Plain env values; downward-API entries appear as `fieldRef:<path>`."""
    return manifests.env_of(manifests.container(daemonset))


def _mounts(daemonset: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mountPath -> (mount, volume)."""
    volumes = {v["name"]: v for v in manifests.pod(daemonset).get("volumes", [])}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in manifests.container(daemonset)["volumeMounts"]}


def _host_paths(daemonset: dict[str, Any]) -> dict[str, str]:
    """mountPath -> host path, for the hostPath volumes only."""
    return {
        path: vol["hostPath"]["path"] for path, (_, vol) in _mounts(daemonset).items() if "hostPath" in vol
    }


def _capabilities_added(daemonset: dict[str, Any]) -> list[str]:
    added: list[str] = manifests.container(daemonset)["securityContext"]["capabilities"].get("add", [])
    return added


def _canon(items: list[Any]) -> list[str]:
    """A list compared as a set of objects (key order inside each object does not matter)."""
    return sorted(json.dumps(item, sort_keys=True) for item in items)


def _loaded_config(
    docs: list[dict[str, Any]], daemonset: dict[str, Any], tmp_path: Path, node_label: str | None = ""
) -> Any:
    """gpuvisor's own loader run under the container's env, its ConfigMap's files in tmp_path, on
    a node whose label nvidia.com/device-plugin.config is `node_label` ("": none)."""
    from supervisor.config import load_config

    config = load_config(None, _container_env(docs, daemonset, tmp_path), node_label=node_label)
    assert config.unknown_keys == ()
    return config


def _labeller_settings(
    docs: list[dict[str, Any]], labeller: dict[str, Any], tmp_path: Path, node_label: str = ""
) -> tuple[str, Any]:
    """The config `gpuvisor labels` chooses under the container's env on a node whose label is
    `node_label` ("": none), and its settings with that config, as the labeller loads them."""
    from supervisor.config.named import choose_config
    from supervisor.labels.settings import load_label_settings

    tmp_path.mkdir(exist_ok=True)
    env = _container_env(docs, labeller, tmp_path)
    settings = load_label_settings({}, env)
    if not settings.config_file_srcdir:
        return "", settings
    choice = choose_config(
        settings.config_file_srcdir, node_label, settings.default_config, settings.fallback_strategies
    )
    return choice.name, load_label_settings({}, env, choice.path)


def _container_env(docs: list[dict[str, Any]], daemonset: dict[str, Any], tmp_path: Path) -> dict[str, str]:
    """The container's env on node NODE (the downward API's spec.nodeName; other fieldRefs left
    out), its ConfigMap's files written to tmp_path."""
    env = {k: NODE if v == "fieldRef:spec.nodeName" else v for k, v in _env(daemonset).items()}
    env = {k: v for k, v in env.items() if not v.startswith("fieldRef:")}
    mounts = _mounts(daemonset)
    if CONFIG_DIR in mounts:
        config_map = manifests.find(docs, "ConfigMap", mounts[CONFIG_DIR][1]["configMap"]["name"])
        for key, text in config_map["data"].items():
            (tmp_path / key).write_text(text)
        for name in ("CONFIG_FILE", "CONFIG_FILE_SRCDIR"):
            if name in env:
                env[name] = env[name].replace(CONFIG_DIR, str(tmp_path))
    return env


# --- lint, schema validation --------------------------------------------------------------------


def test_chart_lints_clean_with_every_values_file() -> None:
    """`helm lint --strict` finds no warning or error, with the defaults and with each values file."""
    for name in VALUES_FILES:
        report = helm_python.lint(str(CHART), _values(name), strict=True, namespace=NAMESPACE)
        assert report["errors"] == [], name
        # Severity 1 is informational ("icon is recommended"); 2 warning, 3 error.
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], name


def test_every_rendered_object_validates_strictly(tmp_path: Path) -> None:
    """Every object of every values file passes kubernetes-validate --strict, with no kind left unchecked."""
    paths = []
    for name in VALUES_FILES:
        # ServiceMonitor is a CRD kind the validator has no schema for; it is checked below.
        docs = [d for d in _render(_values(name)) if d["kind"] != "ServiceMonitor"]
        assert docs, name
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(docs))
        paths.append(path)
    proc = manifests.validate_strict(paths)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    # A kind without a schema is only a WARN (exit 0): none may slip through unvalidated.
    assert "WARN" not in output and "ERROR" not in output, output
    assert output.count(" passed for resource ") == sum(
        len(list(yaml.safe_load_all(p.read_text()))) for p in paths
    )


def test_strict_validation_rejects_a_misspelt_field(tmp_path: Path) -> None:
    """The validator run above fails a rendered DaemonSet with a misspelt field (a pass means something)."""
    docs = _render({})
    manifests.container(_plugin(docs))["securityContext"]["readOnlyRootFilesytem"] = True
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    proc = manifests.validate_strict([path])
    assert proc.returncode != 0
    assert "readOnlyRootFilesytem" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"migStrategy": "mixd"}, "/migStrategy"),
        ({"failOnInitError": "false"}, "/failOnInitError"),  # NVIDIA's chart drops a non-bool silently
        ({"deviceListStrategy": "envvar,cdi"}, "/deviceListStrategy"),
        ({"gpuvisor": {"metrcs": {}}}, "metrcs"),
        ({"gpuvisor": {"metrics": {"port": 70000}}}, "/gpuvisor/metrics/port"),
    ],
)
def test_schema_refuses_values_nvidias_chart_would_drop_or_the_plugin_refuse(
    values: dict[str, Any], message: str
) -> None:
    """values.schema.json names the bad key of a mistyped value (Helm checks it on install/template/lint)."""
    assert message in _refusal(values)


# --- the default install mirrors the kustomize base ---------------------------------------------


def test_default_install_is_the_kustomize_base() -> None:
    """Default values give the base's pod: probes, port, env, mounts, security, resources, scheduling."""
    base = yaml.safe_load(BASE_DAEMONSET.read_text())
    docs = _render({})
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ClusterRole", "gpuvisor"),  # health on the Node, as rbac.yaml grants it
        ("ClusterRoleBinding", "gpuvisor"),
        ("DaemonSet", "gpuvisor"),
        ("ServiceAccount", "gpuvisor"),
        ("ValidatingAdmissionPolicy", "gpuvisor-node-restriction"),  # as base/node-restriction.yaml
        ("ValidatingAdmissionPolicyBinding", "gpuvisor-node-restriction"),
    ]
    chart, kustomize = _plugin(docs), base
    for key in (
        "args",
        "ports",
        "startupProbe",
        "livenessProbe",
        "readinessProbe",
        "resources",
        "securityContext",
    ):
        assert manifests.container(chart)[key] == manifests.container(kustomize)[key], key
    base_env = {k: v for k, v in _env(kustomize).items() if k != "CONFIG_FILE"}
    assert _env(chart) == base_env  # no config.map/config.name: no config file, as NVIDIA's chart
    base_mounts = {p: (m, v) for p, (m, v) in _mounts(kustomize).items() if p != CONFIG_DIR}
    assert _mounts(chart) == base_mounts
    for key in (
        "priorityClassName",
        "automountServiceAccountToken",
        "enableServiceLinks",
        "terminationGracePeriodSeconds",
    ):
        assert manifests.pod(chart)[key] == manifests.pod(kustomize)[key], key
    assert _canon(manifests.pod(chart)["tolerations"]) == _canon(manifests.pod(kustomize)["tolerations"])
    terms = manifests.pod(chart)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    base_terms = manifests.pod(kustomize)["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert _canon(terms["nodeSelectorTerms"]) == _canon(base_terms["nodeSelectorTerms"])
    assert (
        chart["spec"]["template"]["metadata"]["annotations"]
        == kustomize["spec"]["template"]["metadata"]["annotations"]
    )
    for key in ("hostNetwork", "hostIPC", "hostPID", "runtimeClassName"):
        assert key not in manifests.pod(chart), key
    assert manifests.find(docs, "ServiceAccount", "gpuvisor")["automountServiceAccountToken"] is True
    kustomize_rules = next(iter(yaml.safe_load_all((BASE_DAEMONSET.parent / "rbac.yaml").read_text())))[
        "rules"
    ]
    assert manifests.find(docs, "ClusterRole", "gpuvisor")["rules"] == kustomize_rules


def test_image_is_gpuvisor_at_the_app_version_unless_set() -> None:
    """image.repository/tag/pullPolicy and imagePullSecrets land on the container and pod."""
    assert manifests.container(_plugin(_render({})))["image"] == "gpuvisor:0.1.0"
    values = {
        "image": {"repository": "registry.example/gpuvisor", "tag": "1.2.3", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "pull"}],
    }
    daemonset = _plugin(_render(values))
    assert manifests.container(daemonset)["image"] == "registry.example/gpuvisor:1.2.3"
    assert manifests.container(daemonset)["imagePullPolicy"] == "Always"
    assert manifests.pod(daemonset)["imagePullSecrets"] == [{"name": "pull"}]


# --- each NVIDIA value's meaning ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "env", "attribute", "expected"),
    [
        ({"migStrategy": "single"}, {"MIG_STRATEGY": "single"}, "mig_strategy", "single"),
        ({"failOnInitError": False}, {"FAIL_ON_INIT_ERROR": "false"}, "fail_on_init_error", False),
        ({"compatWithCPUManager": True}, {"PASS_DEVICE_SPECS": "true"}, "pass_device_specs", True),
        (
            {"deviceListStrategy": "volume-mounts"},
            {"DEVICE_LIST_STRATEGY": "volume-mounts"},
            "device_list_strategy",
            ("volume-mounts",),
        ),
        ({"deviceIDStrategy": "index"}, {"DEVICE_ID_STRATEGY": "index"}, "device_id_strategy", "index"),
        (
            {"nvidiaDriverRoot": "/run/nvidia/driver"},
            {"NVIDIA_DRIVER_ROOT": "/run/nvidia/driver"},
            "driver_root",
            "/run/nvidia/driver",
        ),
        ({"nvidiaDevRoot": "/host-dev"}, {"NVIDIA_DEV_ROOT": "/host-dev"}, "dev_root", "/host-dev"),
        ({"gdrcopyEnabled": True}, {"GDRCOPY_ENABLED": "true"}, "gdrcopy_enabled", True),
        ({"gdsEnabled": True}, {"GDS_ENABLED": "true"}, "gds_enabled", True),
        ({"mofedEnabled": True}, {"MOFED_ENABLED": "true"}, "mofed_enabled", True),
        (
            {"deviceDiscoveryStrategy": "nvml"},
            {"DEVICE_DISCOVERY_STRATEGY": "nvml"},
            "device_discovery_strategy",
            "nvml",
        ),
        (
            {"cdi": {"nvidiaHookPath": "/usr/local/bin/nvidia-cdi-hook"}},
            {"NVIDIA_CDI_HOOK_PATH": "/usr/local/bin/nvidia-cdi-hook"},
            "nvidia_cdi_hook_path",
            "/usr/local/bin/nvidia-cdi-hook",
        ),
        (
            {"cdi": {"featureFlags": "disable-gds,enable-hooks"}},
            {"CDI_FEATURE_FLAGS": "disable-gds,enable-hooks"},
            "cdi_feature_flags",
            ("disable-gds", "enable-hooks"),
        ),
        ({"gpuvisor": {"logLevel": "debug"}}, {"GPUVISOR_LOG_LEVEL": "debug"}, "log_level", "debug"),
        (
            {"gpuvisor": {"metrics": {"host": "127.0.0.1", "port": 9100}}},
            {"GPUVISOR_METRICS_ADDRESS": "127.0.0.1:9100"},
            "metrics_address",
            "127.0.0.1:9100",
        ),
    ],
)
def test_value_becomes_the_env_var_gpuvisor_reads(
    values: dict[str, Any], env: dict[str, str], attribute: str, expected: object, tmp_path: Path
) -> None:
    """Each value sets NVIDIA's env var (templates/daemonset-device-plugin.yml:140-205) and gpuvisor reads it so."""
    docs = _render(values)
    plugin = _plugin(docs)
    assert env.items() <= _env(plugin).items()
    assert getattr(_loaded_config(docs, plugin, tmp_path), attribute) == expected
    # The default leaves the setting to the config file or gpuvisor's default, as null does in NVIDIA's chart.
    assert not env.keys() & _env(_plugin(_render({}))).keys() - {"GPUVISOR_METRICS_ADDRESS"}


def test_driver_root_is_mounted_read_only_at_driver_root() -> None:
    """nvidiaDriverRoot: the host's driver root at /driver-root (DRIVER_ROOT_CTR_PATH's default), read-only."""
    plugin = _plugin(_render({"nvidiaDriverRoot": "/run/nvidia/driver"}))
    mount, volume = _mounts(plugin)["/driver-root"]
    assert mount["readOnly"] is True
    assert volume["hostPath"] == {"path": "/run/nvidia/driver", "type": "Directory"}


@pytest.mark.parametrize(
    ("name", "check"),
    [
        ("time-slicing", "time-slicing"),
        ("mps", "mps"),
        ("mig-mixed", "mig"),
        ("cdi", "cdi"),
        ("several-configs", "several"),
    ],
)
def test_values_file_means_what_it_means_for_nvidia(name: str, check: str, tmp_path: Path) -> None:
    """Each documented values file gives gpuvisor the same resources, sharing and strategies as NVIDIA's plugin."""
    docs = _render(_values(name))
    plugin = _plugin(docs)
    config = _loaded_config(docs, plugin, tmp_path)
    env, host_paths = _env(plugin), _host_paths(plugin)
    if check == "time-slicing":
        assert config.config_name == "config"  # the only config ("single" fallback)
        assert config.sharing.strategy == "time-slicing"
        assert [(r.name, r.replicas) for r in config.sharing.resources] == [("nvidia.com/gpu", 10)]
    elif check == "mps":
        assert config.sharing.strategy == "mps"
        assert config.mps_root == "/run/nvidia/mps"
        assert host_paths["/run/nvidia/mps"] == "/run/nvidia/mps"  # same path: clients mount it too
        assert host_paths["/dev/shm"] == "/run/nvidia/mps/shm"
        assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"  # the MPS binaries gpuvisor runs
        assert manifests.pod(plugin)["hostIPC"] is True
        assert manifests.pod(plugin)["hostPID"] is True  # mps.enableHostPID, NVIDIA's default
    elif check == "mig":
        assert (config.mig_strategy, config.pass_device_specs) == ("mixed", True)
        assert env["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
        assert _capabilities_added(plugin) == ["SYS_ADMIN"]
        # NVIDIA's chart makes compatWithCPUManager privileged; gpuvisor needs no privilege for it.
        assert "privileged" not in manifests.container(plugin)["securityContext"]
    elif check == "cdi":
        assert config.device_list_strategy == ("cdi-annotations",)
        assert config.driver_root == "/"
        assert config.cdi_spec_dir == "/var/run/cdi"
        assert host_paths["/var/run/cdi"] == "/var/run/cdi"
        assert host_paths["/driver-root"] == "/"
        assert manifests.pod(plugin)["runtimeClassName"] == "nvidia"
        assert not _mounts(plugin)["/var/run/cdi"][0].get("readOnly", False)
    else:
        assert (config.config_name, config.config_source) == ("config0", "default")
        assert config.mig_strategy == "none"
        assert config.device_list_strategy == ("envvar",)
        assert set(manifests.find(docs, "ConfigMap", "gpuvisor-configs")["data"]) == {"config0", "config1"}
        # A node labelled nvidia.com/device-plugin.config=config1 runs the mixed strategy, so the
        # pods get what MIG needs, as NVIDIA's chart grants it for any config of the map.
        labelled = _loaded_config(docs, plugin, tmp_path, node_label="config1")
        assert (labelled.config_name, labelled.mig_strategy) == ("config1", "mixed")
        assert _capabilities_added(plugin) == ["SYS_ADMIN"]
        assert env["NVIDIA_MIG_MONITOR_DEVICES"] == "all"


def test_config_map_is_kept_verbatim_and_mounted_for_live_reload() -> None:
    """The ConfigMap holds each config.map entry verbatim, mounted as a read-only directory (no subPath)."""
    values = _values("several-configs")
    docs = _render(values)
    config_map = manifests.find(docs, "ConfigMap", "gpuvisor-configs")
    assert config_map["data"] == values["config"]["map"]
    mount, volume = _mounts(_plugin(docs))[CONFIG_DIR]
    assert mount["readOnly"] is True and "subPath" not in mount
    assert volume["configMap"] == {"name": "gpuvisor-configs"}
    # No checksum/config annotation: an edit must reach the pods by the kubelet's file swap and
    # gpuvisor's live reload, not by rolling every pod (which drops allocatable to 0).
    assert "checksum/config" not in _plugin(docs)["spec"]["template"]["metadata"]["annotations"]


@pytest.mark.parametrize(
    ("keys", "default", "fallbacks", "chosen"),
    [
        (["a", "default"], None, None, "default"),  # "named" first
        (["only"], None, None, "only"),  # "single"
        (["a", "default"], "a", None, "a"),  # config.default wins
        (["a", "b"], None, ["named", "single", "empty"], ""),  # "empty": no config file
        (["a", "default"], None, ["single", "named"], "default"),  # in order: single fails (2 keys)
        (["default"], None, ["empty", "named"], ""),  # the first that succeeds
    ],
)
def test_config_choice_follows_nvidias_config_manager_without_a_node_label(
    keys: list[str], default: str | None, fallbacks: list[str] | None, chosen: str, tmp_path: Path
) -> None:
    """config.default, then the fallbacks in order, as cmd/config-manager/main.go:359-392 chooses for
    an unlabelled node: the plugin gets config-manager's inputs and makes that choice itself; the
    labeller runs the chosen file."""
    config: dict[str, Any] = {"map": {key: "version: v1\n" for key in keys}}
    if default is not None:
        config["default"] = default
    if fallbacks is not None:
        config["fallbackStrategies"] = fallbacks
    docs = _render({"config": config, "gfd": {"enabled": True}})
    plugin, labeller = _plugin(docs), _labeller(docs)
    env = _env(plugin)
    assert env["CONFIG_FILE_SRCDIR"] == CONFIG_DIR and "CONFIG_FILE" not in env
    assert env["DEFAULT_CONFIG"] == (default or "")
    assert env["FALLBACK_STRATEGIES"] == ",".join(fallbacks or ["named", "single"])
    assert (env["NODE_LABEL"], env["NODE_NAME"]) == (
        "nvidia.com/device-plugin.config",
        "fieldRef:spec.nodeName",
    )
    assert _mounts(plugin)[CONFIG_DIR][1]["configMap"]["name"] == "gpuvisor-configs"
    assert _loaded_config(docs, plugin, tmp_path).config_name == chosen
    # The labeller gets the same inputs and makes the same choice (supervisor/labels/nodeconfig.py).
    names = ("CONFIG_FILE_SRCDIR", "NODE_LABEL", "DEFAULT_CONFIG", "FALLBACK_STRATEGIES", "NODE_NAME")
    assert {n: _env(labeller)[n] for n in names} == {n: env[n] for n in names}
    assert "CONFIG_FILE" not in _env(labeller)
    assert _labeller_settings(docs, labeller, tmp_path / "labeller")[0] == chosen
    assert manifests.pod(labeller)["automountServiceAccountToken"] is True
    role = manifests.find(docs, "ClusterRole", "gpuvisor-gpu-feature-discovery")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]


def test_the_plugin_may_read_nodes_only_where_it_chooses_by_label() -> None:
    """With configs the plugin watches its Node (get/list/watch nodes, NVIDIA's verbs); with health on
    the Node it patches nodes/status and writes Events; with neither it has no token and no RBAC."""

    def rules(values: dict[str, Any]) -> list[tuple[str, tuple[str, ...]]] | None:
        docs = _render(values)
        roles = [d for d in docs if d["kind"] == "ClusterRole"]
        token = manifests.pod(_plugin(docs))["automountServiceAccountToken"]
        assert token is bool(roles)
        assert manifests.find(docs, "ServiceAccount", "gpuvisor")["automountServiceAccountToken"] is token
        return [(r["resources"][0], tuple(r["verbs"])) for r in roles[0]["rules"]] if roles else None

    configs = {"config": {"map": {"default": "version: v1\n", "ts": "version: v1\n"}}}
    off = {"gpuvisor": {"nodeHealth": False}}
    assert rules(off) is None
    assert rules(configs | off) == [("nodes", ("get", "list", "watch"))]
    assert rules(configs) == [
        ("nodes", ("get", "list", "watch")),
        ("nodes/status", ("patch",)),
        ("events", ("create", "patch")),
    ]
    assert "GPUVISOR_NODE_HEALTH" not in _env(_plugin(_render(off)))


def test_external_config_map_is_mounted_with_its_default() -> None:
    """config.name + config.default: that ConfigMap, its default for unlabelled nodes, and every
    feature it might enable is granted; without config.default the plugin and the labeller still
    choose per node."""
    docs = _render({"config": {"name": "nvidia-plugin-configs", "default": "config0"}})
    plugin = _plugin(docs)
    assert not [d for d in docs if d["kind"] == "ConfigMap"]
    assert (_env(plugin)["CONFIG_FILE_SRCDIR"], _env(plugin)["DEFAULT_CONFIG"]) == (CONFIG_DIR, "config0")
    assert (
        _env(_plugin(_render({"config": {"name": "nvidia-plugin-configs"}})))["CONFIG_FILE_SRCDIR"]
        == CONFIG_DIR
    )
    assert _mounts(plugin)[CONFIG_DIR][1]["configMap"] == {"name": "nvidia-plugin-configs"}
    # The labeller too chooses per node from that ConfigMap, default or not (its keys are unknown here).
    labeller = _labeller(_render({"config": {"name": "nvidia-plugin-configs"}, "gfd": {"enabled": True}}))
    assert _env(labeller)["CONFIG_FILE_SRCDIR"] == CONFIG_DIR
    assert _mounts(labeller)[CONFIG_DIR][1]["configMap"] == {"name": "nvidia-plugin-configs"}
    # Its contents are unknown at render time: MIG, MPS and CDI are all possible (NVIDIA's chart
    # likewise assumes MIG for an external ConfigMap: _helpers.tpl:146).
    assert _capabilities_added(plugin) == ["SYS_ADMIN"]
    assert {"/var/run/cdi", "/run/nvidia/mps", "/dev/shm"} <= _host_paths(plugin).keys()
    # ... unless the operator says which it never uses.
    narrowed = {"mig": False, "mps": False, "cdi": False, "volumeMounts": False, "dra": False}
    plugin = _plugin(_render({"config": {"name": "c", "default": "k"}, "gpuvisor": {"features": narrowed}}))
    assert _capabilities_added(plugin) == []
    assert set(_host_paths(plugin)) == {PLUGINS, "/var/lib/kubelet/pod-resources"}
    assert "hostIPC" not in manifests.pod(plugin)


# --- render-time refusals -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "namespace", "message"),
    [
        # NVIDIA's templates/validation.yml:22-48.
        ({}, "default", "refusing to install into the 'default' namespace"),
        ({"config": {"name": "x", "map": {"a": "version: v1"}}}, NAMESPACE, "only one of config.name"),
        ({"namespace": "gpu"}, NAMESPACE, "the value 'namespace'"),
        (
            {"config": {"map": {"a": "version: v1", "b": "version: v1"}}},
            NAMESPACE,
            "holds 2 configs (a, b) and none is the default",
        ),
        # What NVIDIA's config-manager refuses only on the node (main.go:362, 388), refused at once.
        (
            {"config": {"map": {"a": "version: v1"}, "default": "b"}},
            NAMESPACE,
            'config.default "b" is not a key',
        ),
        (
            {"config": {"map": {"a": "version: v1", "b": "v: 1"}, "fallbackStrategies": ["nearest"]}},
            NAMESPACE,
            'unknown strategy "nearest"',
        ),
        # gpuvisor's own.
        ({"config": {"map": {"a": {"version": "v1"}}}}, NAMESPACE, "config.map.a must be a string"),
        ({"config": {"map": {"a": "version: [v1"}}}, NAMESPACE, "config.map.a is not a YAML mapping"),
        ({"config": {"map": {"my config": "version: v1"}}}, NAMESPACE, 'key "my config" is not a valid'),
        (
            {"image": {"repository": "nvcr.io/nvidia/k8s-device-plugin", "tag": "v0.17.1"}},
            NAMESPACE,
            "is NVIDIA's image",
        ),
        (
            {"gpuvisor": {"extraEnv": [{"name": "MIG_STRATEGY", "value": "x"}]}},
            NAMESPACE,
            "extraEnv sets MIG_STRATEGY",
        ),
    ],
)
def test_render_refuses_with_one_clear_line(values: dict[str, Any], namespace: str, message: str) -> None:
    """Values NVIDIA's chart refuses, or that would fail on the node, stop the render with one line naming the key."""
    error = _refusal(values, namespace)
    assert message in error
    assert "\n" not in error.strip(), error


def test_several_configs_error_says_why_and_how() -> None:
    """The no-default error (NVIDIA's chart refuses the same map) names the fallbacks tried and the
    unlabelled nodes it is about."""
    error = _refusal({"config": {"map": {"a": "version: v1", "b": "version: v1"}}})
    assert "set config.default" in error
    assert "[named, single]" in error
    assert "without the label nvidia.com/device-plugin.config" in error


def test_allow_default_namespace_lifts_the_refusal() -> None:
    """allowDefaultNamespace=true renders into `default`, as in NVIDIA's chart."""
    docs = _render({"allowDefaultNamespace": True}, namespace="default")
    assert _plugin(docs)["metadata"]["namespace"] == "default"


# --- least privilege ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "sys_admin"),
    [
        ({}, False),
        ({"migStrategy": "none"}, False),
        ({"migStrategy": "single"}, True),
        (
            {"deviceListStrategy": "volume-mounts"},
            True,
        ),  # NVIDIA #856: runtime ignores the envvar unprivileged
        ({"deviceListStrategy": "envvar,cdi-cri"}, False),
        ({"config": {"map": {"c": "version: v1\nflags:\n  migStrategy: mixed\n"}}}, True),
        # The value's env var wins over the file on the node, so it decides here too.
        (
            {"migStrategy": "none", "config": {"map": {"c": "version: v1\nflags:\n  migStrategy: mixed\n"}}},
            False,
        ),
        (
            {
                "config": {
                    "map": {
                        "c": "version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, volume-mounts]\n"
                    }
                }
            },
            True,
        ),
    ],
)
def test_sys_admin_only_where_nvidia_adds_it(values: dict[str, Any], sys_admin: bool) -> None:
    """SYS_ADMIN is added back (everything else stays dropped) only for MIG or volume-mounts (NVIDIA _helpers.tpl:127-135)."""
    docs = _render({**values, "gfd": {"enabled": True}})
    for daemonset in (_plugin(docs), _labeller(docs)):
        context = manifests.container(daemonset)["securityContext"]
        assert context["capabilities"]["drop"] == ["ALL"]
        assert _capabilities_added(daemonset) == (["SYS_ADMIN"] if sys_admin else [])
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert ("NVIDIA_MIG_MONITOR_DEVICES" in _env(daemonset)) is (
            sys_admin and "volume" not in str(values)
        )


def test_security_context_values_replace_the_chart_context() -> None:
    """securityContext / gfd.securityContext, when set, are used verbatim (NVIDIA's rule); podSecurityContext lands on the pod."""
    values = {
        "securityContext": {"privileged": True},
        "podSecurityContext": {"fsGroup": 0},
        "gfd": {"enabled": True, "securityContext": {"runAsUser": 1000}},
    }
    docs = _render(values)
    assert manifests.container(_plugin(docs))["securityContext"] == {"privileged": True}
    assert manifests.container(_labeller(docs))["securityContext"] == {"runAsUser": 1000}
    assert manifests.pod(_plugin(docs))["securityContext"] == {"fsGroup": 0}


def test_mps_host_pid_follows_mps_enable_host_pid() -> None:
    """mps.enableHostPID=false keeps the MPS pod in its own PID namespace; mps.root moves every MPS path."""
    values = _values("mps") | {"mps": {"enableHostPID": False, "root": "/var/run/mps"}}
    plugin = _plugin(_render(values))
    assert "hostPID" not in manifests.pod(plugin) and manifests.pod(plugin)["hostIPC"] is True
    assert _env(plugin)["MPS_ROOT"] == "/var/run/mps"
    assert _host_paths(plugin)["/var/run/mps"] == "/var/run/mps"
    assert _host_paths(plugin)["/dev/shm"] == "/var/run/mps/shm"


# --- scheduling, names, the rest of NVIDIA's pod values -----------------------------------------


def test_pod_values_land_where_nvidias_chart_puts_them() -> None:
    """nodeSelector, affinity, tolerations, priority/runtime class, annotations, update strategy, resources, hostNetwork."""
    values = {
        "nodeSelector": {"gpu": "yes"},
        "affinity": None,  # null removes a default (Helm's coalescing; an empty map would merge)
        "tolerations": [{"operator": "Exists"}],
        "priorityClassName": "high",
        "runtimeClassName": "nvidia",
        "podAnnotations": {"team": "ml"},
        "updateStrategy": {"type": "OnDelete"},
        "resources": {"limits": {"memory": "1Gi"}},
        "devicePlugin": {"enableHostNetwork": True},
    }
    plugin = _plugin(_render(values))
    pod = manifests.pod(plugin)
    assert pod["nodeSelector"] == {"gpu": "yes"}
    assert "affinity" not in pod
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("high", "nvidia")
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    assert plugin["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert manifests.container(plugin)["resources"] == {"limits": {"memory": "1Gi"}}  # verbatim, not merged
    assert plugin["spec"]["template"]["metadata"]["annotations"]["team"] == "ml"


def test_name_and_namespace_overrides() -> None:
    """fullnameOverride names every object, namespaceOverride moves them, nameOverride renames the app label."""
    docs = _render({"fullnameOverride": "nvdp", "namespaceOverride": "other", "gfd": {"enabled": True}})
    names = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert ("DaemonSet", "nvdp") in names and ("DaemonSet", "nvdp-gpu-feature-discovery") in names
    cluster_scoped = (
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    )
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] not in cluster_scoped} == {"other"}
    binding = manifests.find(docs, "ClusterRoleBinding", "nvdp")
    assert binding["subjects"][0]["namespace"] == "other" and ("ClusterRole", "nvdp") in names
    policy = manifests.find(docs, "ValidatingAdmissionPolicy", "nvdp-node-restriction")
    assert policy["spec"]["matchConditions"][0]["expression"] == (
        'request.userInfo.username in ["system:serviceaccount:other:nvdp",'
        '"system:serviceaccount:other:nvdp-gpu-feature-discovery"]'
    )  # the policy follows the service accounts it holds
    docs = _render({"nameOverride": "nvidia-device-plugin"})
    plugin = manifests.find(docs, "DaemonSet", "gpuvisor-nvidia-device-plugin")
    assert plugin["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "nvidia-device-plugin"


def test_the_two_daemonsets_never_select_each_others_pods() -> None:
    """Each DaemonSet's selector matches its own pod labels only, selectorLabelsOverride included."""
    for values in ({}, {"selectorLabelsOverride": {"app": "nvdp"}}):
        docs = _render({**values, "gfd": {"enabled": True}})
        plugin, labeller = _plugin(docs), _labeller(docs)
        for own, other in ((plugin, labeller), (labeller, plugin)):
            selector = own["spec"]["selector"]["matchLabels"]
            assert selector.items() <= own["spec"]["template"]["metadata"]["labels"].items()
            assert not selector.items() <= other["spec"]["template"]["metadata"]["labels"].items()
        assert (
            values.get("selectorLabelsOverride", {}).items()
            <= plugin["spec"]["selector"]["matchLabels"].items()
        )


def test_device_plugin_disabled_renders_no_plugin() -> None:
    """devicePlugin.enabled=false: no plugin DaemonSet or service account (the labeller alone, standalone)."""
    docs = _render(_values("gfd-file"))
    assert sorted(d["kind"] for d in docs) == ["DaemonSet", "ServiceAccount"]
    _labeller(docs)


def test_extra_env_reaches_the_plugin(tmp_path: Path) -> None:
    """gpuvisor.extraEnv adds env vars gpuvisor reads (e.g. NVIDIA's DP_DISABLE_HEALTHCHECKS, no chart value)."""
    docs = _render({"gpuvisor": {"extraEnv": [{"name": "DP_DISABLE_HEALTHCHECKS", "value": "xids"}]}})
    config = _loaded_config(docs, _plugin(docs), tmp_path)
    assert config.disable_healthchecks == ("xids",)


# --- the node labeller (gfd.enabled) -------------------------------------------------------------


def test_labeller_runs_gpuvisor_labels_with_gfds_env() -> None:
    """gfd.enabled: `gpuvisor labels` with NODE_NAME/POD_NAME/NAMESPACE from the downward API and the shared settings."""
    values = _values("gfd") | {
        "migStrategy": "mixed",
        "failOnInitError": False,
        "deviceDiscoveryStrategy": "nvml",
        "nvidiaDriverRoot": "/run/nvidia/driver",
    }
    labeller = _labeller(_render(values))
    assert manifests.container(labeller)["args"] == ["labels"]
    assert manifests.container(labeller)["image"] == "gpuvisor:0.1.0"
    env = _env(labeller)
    assert {
        "NODE_NAME": "fieldRef:spec.nodeName",
        "POD_NAME": "fieldRef:metadata.name",
        "NAMESPACE": "fieldRef:metadata.namespace",
        "MIG_STRATEGY": "mixed",
        "FAIL_ON_INIT_ERROR": "false",
        "DEVICE_DISCOVERY_STRATEGY": "nvml",
        "NVIDIA_MIG_MONITOR_DEVICES": "all",
    }.items() <= env.items()
    assert _host_paths(labeller) == {"/driver-root": "/run/nvidia/driver"}
    assert "ports" not in manifests.container(labeller)


@pytest.mark.parametrize("name", ["time-slicing", "mps", "mig-mixed", "cdi", "several-configs"])
def test_labeller_reads_the_config_the_plugin_runs(name: str, tmp_path: Path) -> None:
    """With gfd.enabled, `gpuvisor labels`' own loader under the labeller's env resolves what the
    plugin's loader resolves under the plugin's env: the config chosen, the MIG strategy,
    discovery, init-error rule and the sharing the labels describe; on a labelled node too."""
    from supervisor.labels import SharingView

    docs = _render(_values(name) | {"gfd": {"enabled": True}})
    (tmp_path / "plugin").mkdir()
    labels = ["", "config1"] if name == "several-configs" else [""]
    for node_label in labels:
        plugin = _loaded_config(docs, _plugin(docs), tmp_path / "plugin", node_label=node_label)
        chosen, labeller = _labeller_settings(docs, _labeller(docs), tmp_path / "labeller", node_label)
        assert chosen == plugin.config_name
        for attribute in ("mig_strategy", "device_discovery_strategy", "fail_on_init_error"):
            assert getattr(labeller, attribute) == getattr(plugin, attribute), attribute
        assert labeller.sharing == SharingView.from_config(plugin.sharing)


def test_labeller_uses_the_node_feature_api_by_default() -> None:
    """GFD's default output: a token and a Role for NodeFeature objects (nfd.k8s-sigs.io) and its own pod."""
    docs = _render(_values("gfd"))
    labeller = _labeller(docs)
    assert "GFD_USE_NODE_FEATURE_API" not in _env(labeller)  # the command's default, true
    assert manifests.pod(labeller)["automountServiceAccountToken"] is True
    account = manifests.find(docs, "ServiceAccount", "gpuvisor-gpu-feature-discovery")
    assert manifests.pod(labeller)["serviceAccountName"] == account["metadata"]["name"]
    role = manifests.find(docs, "Role", "gpuvisor-gpu-feature-discovery")
    # NVIDIA's verbs (templates/role.yml:13-18), namespaced: the objects live in $NAMESPACE.
    assert role["rules"] == [
        {
            "apiGroups": ["nfd.k8s-sigs.io"],
            "resources": ["nodefeatures"],
            "verbs": ["get", "list", "watch", "create", "update"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
    ]
    binding = manifests.find(docs, "RoleBinding", "gpuvisor-gpu-feature-discovery")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert FEATURES_D not in _mounts(labeller)
    # The labeller's rights are namespaced; the only ClusterRole is the plugin's (health on the Node).
    assert [d["metadata"]["name"] for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")] == [
        "gpuvisor",
        "gpuvisor",
    ]


def test_labeller_writes_features_d_without_the_api() -> None:
    """gfd.useNodeFeatureAPI=false: GFD_OUTPUT_FILE in NFD's features.d from the host; no token, no Role."""
    docs = _render(_values("gfd-file"))
    labeller = _labeller(docs)
    env = _env(labeller)
    assert env["GFD_USE_NODE_FEATURE_API"] == "false"
    assert env["GFD_OUTPUT_FILE"] == f"{FEATURES_D}/gfd"
    assert _host_paths(labeller)[FEATURES_D] == FEATURES_D
    assert manifests.pod(labeller)["automountServiceAccountToken"] is False
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]


@pytest.mark.parametrize(
    ("values", "no_timestamp", "sleep"),
    [
        ({"gfd": {"noTimestamp": True, "sleepInterval": "30s"}}, "true", "30s"),
        # NVIDIA's template reads these top-level names (daemonset-gfd.yml:162-169).
        ({"noTimestamp": False, "sleepInterval": "2m"}, "false", "2m"),
        (
            {
                "noTimestamp": False,
                "sleepInterval": "2m",
                "gfd": {"noTimestamp": True, "sleepInterval": "5s"},
            },
            "true",
            "5s",
        ),
        ({}, None, None),
    ],
)
def test_labeller_timestamp_and_interval(
    values: dict[str, Any], no_timestamp: str | None, sleep: str | None
) -> None:
    """GFD_NO_TIMESTAMP and GFD_SLEEP_INTERVAL come from gfd.* or, as NVIDIA's template reads them, the top level."""
    gfd = {"enabled": True} | values.get("gfd", {})
    env = _env(_labeller(_render(values | {"gfd": gfd})))
    assert env.get("GFD_NO_TIMESTAMP") == no_timestamp
    assert env.get("GFD_SLEEP_INTERVAL") == sleep


# --- metrics --------------------------------------------------------------------------------------


def test_service_monitor_scrapes_the_plugins_metrics_port() -> None:
    """serviceMonitor: a headless Service on the plugin pods' metrics port, and a ServiceMonitor selecting it."""
    docs = _render(_values("service-monitor"))
    plugin = _plugin(docs)
    assert manifests.container(plugin)["ports"] == [
        {"name": "metrics", "containerPort": 9500, "protocol": "TCP"}
    ]
    assert _env(plugin)["GPUVISOR_METRICS_ADDRESS"] == "0.0.0.0:9500"
    assert plugin["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9500"
    service = manifests.find(docs, "Service", "gpuvisor-metrics")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= plugin["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9500, "targetPort": "metrics", "protocol": "TCP"}
    ]
    monitor = manifests.find(docs, "ServiceMonitor", "gpuvisor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "30s")


# --- NOTES: what the chart does instead of NVIDIA's sidecar and subchart -------------------------


def test_notes_say_how_a_node_chooses_its_config() -> None:
    """NOTES say how a node chooses its config (its label, else the default), that health is on
    the Node, and that NFD is not installed."""
    notes = _notes(_values("several-configs") | {"gfd": {"enabled": True}})
    assert "Configs: ConfigMap gpuvisor-configs (config0, config1)." in notes
    assert "nvidia.com/device-plugin.config=NAME" in notes
    assert 'A node without the label runs "config0".' in notes
    assert "condition GPUUnhealthy" in notes
    assert "does not install node-feature-discovery" in notes
    assert "GPUUnhealthy" not in _notes({"gpuvisor": {"nodeHealth": False}})


# --- docs/deploy.md's example ---------------------------------------------------------------------


def _documented_helm_yaml_blocks() -> list[str]:
    text = (REPO / "docs" / "deploy.md").read_text(encoding="utf-8")
    section = text[text.index("## Install with Helm") :]
    section = section[: section.index("\n## ", 1)]
    return [block.split("```", 1)[0] for block in section.split("```yaml\n")[1:]]


def test_documented_per_node_configs_render_as_described(tmp_path: Path) -> None:
    """docs/deploy.md's example: unlabelled nodes run `default`, a node labelled mig-mixed the mixed
    strategy and one labelled ts4 four time-slicing replicas; MIG's privileges are granted."""
    [block] = _documented_helm_yaml_blocks()
    docs = _render(yaml.safe_load(block))
    plugin = _plugin(docs)
    assert _loaded_config(docs, plugin, tmp_path).config_name == "default"
    assert _loaded_config(docs, plugin, tmp_path, node_label="mig-mixed").mig_strategy == "mixed"
    sliced = _loaded_config(docs, plugin, tmp_path, node_label="ts4").sharing
    assert [(r.name, r.replicas) for r in sliced.resources] == [("nvidia.com/gpu", 4)]
    assert _capabilities_added(plugin) == ["SYS_ADMIN"]


# --- DRA -----------------------------------------------------------------------------------------

DRA_PLUGINS = "/var/lib/kubelet/plugins"
DRA_REGISTRY = "/var/lib/kubelet/plugins_registry"


def test_dra_mode_makes_the_device_classes_nvidias_driver_makes(tmp_path: Path) -> None:
    """gpuvisor.mode dra: DeviceClasses gpu.nvidia.com (type 'gpu', extendedResourceName
    nvidia.com/gpu) and mig.nvidia.com (type 'mig'), each valid against resource.k8s.io/v1 as the
    1.34 API server serves it (kubernetes-validate, strict)."""
    docs = _render(_values("dra"))
    classes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "DeviceClass"}
    assert sorted(classes) == ["gpu.nvidia.com", "mig.nvidia.com"]
    for name, kind in (("gpu.nvidia.com", "gpu"), ("mig.nvidia.com", "mig")):
        spec = classes[name]["spec"]
        assert spec["selectors"] == [
            {"cel": {"expression": f"device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == '{kind}'"}}
        ]  # fmt: skip
    assert classes["gpu.nvidia.com"]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert "extendedResourceName" not in classes["mig.nvidia.com"]["spec"]
    path = tmp_path / "classes.yaml"
    path.write_text(yaml.safe_dump_all(list(classes.values())))
    proc = manifests.validate_strict([path], "--kubernetes-version", "1.34.0")
    assert proc.returncode == 0 and proc.stdout.count(" passed for resource ") == 2, proc.stdout + proc.stderr


def test_dra_mode_grants_the_plugin_dirs_cdi_rbac_and_its_node_name(tmp_path: Path) -> None:
    """The kubelet's plugins and plugins_registry dirs are host paths at the same place, CDI's spec
    dir too; NODE_NAME from the downward API; RBAC for resourceslices (create/get/list/watch/update/
    patch/delete), resourceclaims (get/list/watch) and their status (update: device health), get
    nodes and patch nodes/status (a released device-plugin resource); gpuvisor's own loader reads
    the pod's env as mode dra with those dirs."""
    docs = _render(_values("dra"))
    plugin = _plugin(docs)
    paths = _host_paths(plugin)
    assert paths[DRA_PLUGINS] == DRA_PLUGINS and paths[DRA_REGISTRY] == DRA_REGISTRY
    assert "/var/run/cdi" in paths
    env = _env(plugin)
    assert env["NODE_NAME"] == "fieldRef:spec.nodeName" and env["GPUVISOR_MODE"] == "dra"
    rules = {(tuple(r["apiGroups"]), r["resources"][0]): r["verbs"] for r in manifests.find(docs, "ClusterRole", "gpuvisor")["rules"]}  # fmt: skip
    assert rules[(("resource.k8s.io",), "resourceslices")] == [
        "create", "get", "list", "watch", "update", "patch", "delete"
    ]  # fmt: skip
    assert rules[(("resource.k8s.io",), "resourceclaims")] == ["get", "list", "watch"]
    assert rules[(("resource.k8s.io",), "resourceclaims/status")] == ["update"]
    assert rules[(("",), "nodes/status")] == ["patch"]
    assert "get" in rules[(("",), "nodes")]
    assert manifests.pod(plugin)["automountServiceAccountToken"] is True
    config = _loaded_config(docs, plugin, tmp_path)
    assert (config.mode, config.node_name) == ("dra", NODE)
    assert (config.kubelet_plugins_dir, config.kubelet_registry_dir) == (DRA_PLUGINS, DRA_REGISTRY)
    assert config.cdi_spec_dir == "/var/run/cdi" and config.dra_claims_dir == ""


def test_a_named_config_may_choose_dra_for_its_nodes(tmp_path: Path) -> None:
    """One config of config.map says mode dra: the chart grants what DRA needs (dirs, RBAC, the
    DeviceClasses) but sets no GPUVISOR_MODE, which would override the node's choice: a node
    labelled with that config runs mode dra, the others the device plugin."""
    docs = _render(_values("dra-by-label"))
    plugin = _plugin(docs)
    assert "GPUVISOR_MODE" not in _env(plugin)
    assert DRA_PLUGINS in _host_paths(plugin)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "DeviceClass"] == [
        "gpu.nvidia.com",
        "mig.nvidia.com",
    ]
    assert _loaded_config(docs, plugin, tmp_path).mode == "device-plugin"
    assert _loaded_config(docs, plugin, tmp_path, node_label="dra").mode == "dra"


def test_a_config_with_mig_on_demand_grants_what_mig_needs(tmp_path: Path) -> None:
    """A config of config.map with gpuvisor.dra.migOnDemand: the plugin may create and destroy MIG
    instances, so it gets what a MIG strategy gets (SYS_ADMIN, NVIDIA_MIG_MONITOR_DEVICES), and the
    node labelled with it loads the setting."""
    text = "version: v1\ngpuvisor:\n  mode: dra\n  dra: {migOnDemand: true}\n"
    docs = _render({"config": {"map": {"migs": text}, "default": "migs"}})
    plugin = _plugin(docs)
    assert _capabilities_added(plugin) == ["SYS_ADMIN"]
    assert _env(plugin)["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
    assert _loaded_config(docs, plugin, tmp_path).dra_mig_on_demand is True
    plain = _render(
        {"config": {"map": {"plain": "version: v1\ngpuvisor: {mode: dra}\n"}, "default": "plain"}}
    )
    assert _capabilities_added(_plugin(plain)) == []


def test_device_plugin_mode_has_nothing_of_dra() -> None:
    """The default install (and configs that never say dra) mounts no plugin dir, grants nothing of
    resource.k8s.io and makes no DeviceClass."""
    for name in ("default", "several-configs", "time-slicing"):
        docs = _render(_values(name))
        assert not [d for d in docs if d["kind"] == "DeviceClass"], name
        assert DRA_PLUGINS not in _host_paths(_plugin(docs)), name
        roles = [d for d in docs if d["kind"] == "ClusterRole"]
        assert not [r for role in roles for r in role["rules"] if "resource.k8s.io" in r["apiGroups"]], name


def test_device_classes_can_be_left_to_another_chart() -> None:
    """gpuvisor.dra.deviceClasses false: none (NVIDIA's DRA chart makes them); an empty
    extendedResourceName leaves the field out; other plugin dirs are mounted and passed on."""
    values = {"gpuvisor": {"mode": "dra", "dra": {"deviceClasses": False}}}
    assert not [d for d in _render(values) if d["kind"] == "DeviceClass"]
    values = {"gpuvisor": {"mode": "dra", "dra": {"extendedResourceName": ""}}}
    gpu = manifests.find(_render(values), "DeviceClass", "gpu.nvidia.com")
    assert "extendedResourceName" not in gpu["spec"]
    values = {"gpuvisor": {"mode": "dra", "dra": {"kubeletPluginsDir": "/data/kubelet/plugins"}}}
    plugin = _plugin(_render(values))
    assert _host_paths(plugin)["/data/kubelet/plugins"] == "/data/kubelet/plugins"
    assert _env(plugin)["GPUVISOR_KUBELET_PLUGINS_DIR"] == "/data/kubelet/plugins"
    assert "/gpuvisor/mode" in _refusal({"gpuvisor": {"mode": "both"}})
