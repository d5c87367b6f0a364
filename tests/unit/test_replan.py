"""Tests of reload and rediscovery (supervisor/desired/replan.py): what is wanted, handed to a reconciler
over a fake run dir, with the simulator as NVML and a fake clock."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from common.exitcodes import EXIT_CONFIG_ERROR
from supervisor.config import Config
from supervisor.desired.discovery import NvmlSession, StartupError
from supervisor.desired.reconcile import Desired, Reconciler
from supervisor.desired.replan import CONFIG_DEBOUNCE_S, Replanner
from supervisor.mps.wiring import MpsWiring
from supervisor.observe.metrics import Metrics
from supervisor.scheduler import Scheduler
from supervisor.workers.lifecycle import WorkerSet
from tests.fakes import FakeClock, FakeRunDir, FakeSpawner, bookless_hub, sim_config

GPU = "nvidia.com/gpu"
SLICED = (
    "version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - {name: nvidia.com/gpu, replicas: 2}\n"
)


class Setup:
    def __init__(self, tmp: Path, text: str = "version: v1\n", *, named: bool = False, **env: str) -> None:
        self.file = tmp / "config.yaml"
        self.file.write_text(text)
        own = {} if named else {"CONFIG_FILE": str(self.file)}  # named: env names the configs' dir
        self.environ = {"GPUVISOR_SIMULATE": "pcie-l4", **own, **env}
        self.clock = FakeClock()
        self.timers = Scheduler(self.clock)
        self.metrics = Metrics(version="test")
        config = sim_config(**own, **env)
        self.adopted: list[Config] = []
        self.fatal: list[StartupError] = []
        self.recalled: str | None = None  # the label the run dir kept from an earlier run
        self.nvml = NvmlSession(config, self.environ)
        hub = bookless_hub(self.metrics, self.clock)
        self.rundir = FakeRunDir()
        self.reconciler = Reconciler(
            config=config,
            plan_files=self.rundir,
            workers=WorkerSet(spawner=FakeSpawner()),
            tell=lambda r, u: False,
            snapshot=hub.snapshot,
            follow=self,
            timers=self.timers,
            on_refused=self.metrics.reload_refused,
        )
        mps = MpsWiring(config=config, environ=self.environ, nvml_module=None, hub=hub, post=lambda fn: None)
        self.replan = Replanner(
            argv_flags=None,
            environ=self.environ,
            nvml=self.nvml,
            reconciler=self.reconciler,
            mps=mps,
            timers=self.timers,
            on_fatal=self.fatal.append,
            recalled_label=lambda: self.recalled,
        )

    @property
    def config(self) -> Config:
        return self.reconciler.config

    def take_config(self, old: Config, new: Config) -> None:
        self.adopted.append(new)

    def take_plans(self, desired: Desired) -> None:
        pass

    def bring_up(self) -> None:
        node, _ = self.nvml.attempt(fail_on_init_error=True)
        assert node is not None
        self.replan.reload("start")

    def refusals(self, kind: str) -> float:
        return self.metrics.registry.get_sample_value("gpuvisor_reloads_refused_total", {"kind": kind}) or 0.0


def test_the_start_tries_nvml_again_on_its_backoff_and_then_plans(tmp_path: Path) -> None:
    """NVML down at the start (--fail-on-init-error=false): no plans, a retry on the scheduler at
    the backoff's first step; the try that finds NVML up plans the node."""
    s = Setup(tmp_path, GPUVISOR_SIM_FAIL_INIT="1", FAIL_ON_INIT_ERROR="false")
    s.replan.begin()
    assert s.reconciler.plans == {} and s.timers.when("nvml-retry") == s.clock.now + 1.0
    s.clock.advance(1.0)
    s.timers.run_due()
    assert GPU in s.reconciler.plans and s.timers.when("nvml-retry") is None and s.fatal == []


def test_a_later_start_that_cannot_plan_the_node_ends_the_run(tmp_path: Path) -> None:
    """NVML comes up on a retry to a node the config cannot plan (one MIG profile asked of mixed
    ones): the loop is told, with the config error a first try would have raised, exit 78."""
    s = Setup(
        tmp_path,
        GPUVISOR_SIMULATE="mig-a100",
        MIG_STRATEGY="single",
        GPUVISOR_SIM_FAIL_INIT="1",
        FAIL_ON_INIT_ERROR="false",
    )
    s.replan.begin()
    assert s.fatal == []
    s.clock.advance(1.0)
    s.timers.run_due()
    assert [(e.code, "MIG strategy single" in str(e)) for e in s.fatal] == [(EXIT_CONFIG_ERROR, True)]
    assert s.reconciler.plans == {}


def test_a_reload_with_a_new_config_plans_it_and_applies_it(tmp_path: Path) -> None:
    """SIGHUP with two replicas: the reconciler applies plans with replica IDs."""
    s = Setup(tmp_path)
    s.bring_up()
    s.file.write_text(SLICED)
    assert s.replan.reload("SIGHUP")
    assert "::1" in s.reconciler.plan_json[GPU] and s.config.sharing.strategy == "time-slicing"


def test_an_invalid_config_is_refused_and_stays_in_status_until_a_valid_one(tmp_path: Path) -> None:
    """A config that does not load is refused, counted, and shown until a valid one arrives."""
    s = Setup(tmp_path)
    s.bring_up()
    before = s.reconciler.plan_json[GPU]
    s.file.write_text("version: v1\nsharing: {timeSlicing: {resources: [{name: gpu, replicas: 1}]}}\n")
    assert not s.replan.reload("SIGHUP")
    refused = s.reconciler.status()["refused"]
    assert isinstance(refused, str) and "replicas" in refused and "(SIGHUP)" in refused
    assert s.refusals("reload") == 1.0 and s.reconciler.plan_json[GPU] == before
    assert s.replan.rediscover("periodic rediscovery")  # nothing changed: the refusal stays
    assert s.reconciler.status()["refused"] == refused
    s.file.write_text(SLICED)
    assert s.replan.reload("SIGHUP")
    assert s.reconciler.status()["refused"] is None


def test_a_periodic_rediscovery_with_nothing_new_changes_nothing(tmp_path: Path) -> None:
    """The common case: same node, same config, no plan write, true."""
    s = Setup(tmp_path)
    s.bring_up()
    writes = s.rundir.writes
    assert s.replan.rediscover("periodic rediscovery")
    assert s.rundir.writes == writes and s.replan.rediscoveries == 1, "a reload is not a rediscovery"


def test_settings_a_running_supervisor_cannot_take_keep_their_values(tmp_path: Path) -> None:
    """A reload that changes --run-dir keeps the running one (a restart takes it)."""
    s = Setup(tmp_path)
    s.bring_up()
    s.environ["GPUVISOR_RUN_DIR"] = "/elsewhere"
    assert s.replan.reload("SIGHUP")
    assert s.config.run_dir == "/run/gpuvisor"


def test_a_reload_before_nvml_is_up_only_takes_the_config(tmp_path: Path) -> None:
    """NVML down: the config is taken (it applies once NVML is up); nothing is planned."""
    s = Setup(tmp_path, GPUVISOR_SIM_FAIL_INIT="1")
    s.file.write_text(SLICED)
    assert s.replan.reload("SIGHUP")
    assert s.adopted and s.adopted[-1].sharing.strategy == "time-slicing" and s.reconciler.plans == {}


def test_config_file_events_are_debounced_and_judged_by_content(tmp_path: Path) -> None:
    """A burst of events is one check after the debounce; an unchanged file reloads nothing."""
    s = Setup(tmp_path)
    s.bring_up()
    reloads = s.replan.reloads
    s.replan.config_event()
    s.replan.config_event()
    s.clock.advance(CONFIG_DEBOUNCE_S)
    s.timers.run_due()
    assert s.replan.reloads == reloads  # same bytes: nothing to do
    s.file.write_text(SLICED)
    s.replan.config_event()
    s.clock.advance(CONFIG_DEBOUNCE_S)
    s.timers.run_due()
    assert s.replan.reloads == reloads + 1 and "::1" in s.reconciler.plan_json[GPU]


def test_rediscovery_is_rescheduled_at_the_configured_interval(tmp_path: Path) -> None:
    """Each replan arms the next periodic rediscovery; interval 0 disables it."""
    s = Setup(tmp_path, GPUVISOR_REDISCOVERY_INTERVAL="30")
    s.bring_up()
    assert s.timers.when("rediscovery") == s.clock.now + 30
    s.replan.schedule_rediscovery(sim_config(GPUVISOR_REDISCOVERY_INTERVAL="0"))
    assert s.timers.when("rediscovery") is None


def test_a_rediscovery_refusal_leaves_status_once_a_rediscovery_goes_through(tmp_path: Path) -> None:
    """NVML failing during a rediscovery is refused and shown; the next rediscovery that works
    clears it, without a reload."""
    s = Setup(tmp_path)
    s.bring_up()
    sim = s.nvml.simulator
    assert sim is not None
    sim.fail("nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN, count=1)
    assert not s.replan.rediscover("periodic rediscovery")
    refused = s.reconciler.status()["refused"]
    assert isinstance(refused, str) and refused.startswith("rediscovery refused: discovery failed")
    assert s.replan.rediscover("periodic rediscovery")
    assert s.reconciler.status()["refused"] is None


def test_a_refused_reload_drops_a_reload_still_pending(tmp_path: Path) -> None:
    """A reload kept pending (the run dir full) is not applied later once the user has written a
    newer config that is refused: the running config stays, and nothing is pending."""
    s = Setup(tmp_path)
    s.bring_up()
    before = s.reconciler.plan_json[GPU]
    s.rundir.broken = True
    s.file.write_text(SLICED)
    assert not s.replan.reload("SIGHUP")
    assert s.reconciler.pending is not None
    s.file.write_text("version: v1\nsharing: {timeSlicing: {resources: [{name: gpu, replicas: 1}]}}\n")
    assert not s.replan.reload("SIGHUP")
    assert s.reconciler.pending is None and s.timers.when("pending-reload") is None
    s.rundir.broken = False
    s.clock.advance(600)
    s.timers.run_due()
    assert s.reconciler.plan_json[GPU] == before


def test_a_rediscovery_that_fails_while_applying_keeps_periodic_rediscovery_armed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while the reconciler takes a rediscovered plan fails that one timer (the scheduler
    logs it); the next periodic rediscovery is still armed, so the node's devices keep being
    followed."""
    s = Setup(tmp_path, GPUVISOR_REDISCOVERY_INTERVAL="30")
    s.bring_up()
    s.file.write_text(SLICED)  # a change, so the rediscovery has a plan to hand over
    s.replan.reload("SIGHUP")

    def broken(outcome: object) -> bool:
        raise RuntimeError("bug in take")

    monkeypatch.setattr(s.reconciler, "take", broken)
    s.clock.advance(30)
    assert s.timers.run_due() == 1
    assert s.timers.when("rediscovery") == s.clock.now + 30


def test_a_reload_refused_as_it_loads_does_not_push_back_rediscovery(tmp_path: Path) -> None:
    """A config that does not even load reads no devices, so the periodic rediscovery keeps its
    deadline: a user retrying a bad config cannot postpone it forever."""
    s = Setup(tmp_path, GPUVISOR_REDISCOVERY_INTERVAL="30")
    s.bring_up()
    due = s.timers.when("rediscovery")
    s.clock.advance(20)
    s.file.write_text("version: v1\nsharing: {timeSlicing: {resources: [{name: gpu, replicas: 1}]}}\n")
    assert not s.replan.reload("SIGHUP")
    assert s.timers.when("rediscovery") == due


# --- the node's config chosen by its label -------------------------------------------------------


def named(tmp_path: Path, **env: str) -> Setup:
    """A node whose configs are the named files of a directory: `plain` and `sliced`."""
    srcdir = tmp_path / "configs"
    srcdir.mkdir()
    (srcdir / "plain").write_text("version: v1\n")
    (srcdir / "sliced").write_text(SLICED)
    return Setup(tmp_path, named=True, CONFIG_FILE_SRCDIR=str(srcdir), NODE_NAME="gpu-1", **env)


def test_a_label_change_is_a_reload_into_the_named_config(tmp_path: Path) -> None:
    """Default `plain`; the label names `sliced`: replicas, in place; the label removed: `plain` again."""
    s = named(tmp_path, DEFAULT_CONFIG="plain")
    s.bring_up()
    assert (s.config.config_name, s.config.config_source) == ("plain", "default")
    assert s.replan.node_label("sliced")
    assert (s.config.config_name, s.config.config_source) == ("sliced", "label")
    assert "::1" in s.reconciler.plan_json[GPU]
    reloads = s.replan.reloads
    assert s.replan.node_label("sliced") and s.replan.reloads == reloads  # the same value: nothing
    assert s.replan.node_label("")
    assert (s.config.config_name, "::1" in s.reconciler.plan_json[GPU]) == ("plain", False)


def test_a_label_naming_no_config_is_refused_and_the_running_one_stays(tmp_path: Path) -> None:
    """A typo in the label: refused with config-manager's words, the running config keeps serving."""
    s = named(tmp_path, DEFAULT_CONFIG="plain")
    s.bring_up()
    before = s.reconciler.plan_json[GPU]
    assert not s.replan.node_label("slcied")
    refused = str(s.reconciler.status()["refused"])
    assert "specified config slcied does not exist" in refused and "node label" in refused
    assert s.reconciler.plan_json[GPU] == before and s.config.config_name == "plain"


def test_a_start_recalls_the_label_an_earlier_run_kept_only_with_named_configs(tmp_path: Path) -> None:
    """With named configs, the label an earlier run in this run dir kept chooses the first config;
    with none kept, or without named configs, nothing is recalled."""
    s = named(tmp_path, DEFAULT_CONFIG="plain")
    assert not s.replan.recall_label() and s.config.config_name == "plain"
    s.recalled = "sliced"
    assert s.replan.recall_label()
    assert (s.config.config_name, s.config.config_source, s.replan.label) == ("sliced", "label", "sliced")
    (tmp_path / "single").mkdir()
    single = Setup(tmp_path / "single")
    single.recalled = "sliced"
    assert not single.replan.recall_label() and single.replan.label is None


def test_without_a_usable_default_nothing_is_planned_until_the_label(tmp_path: Path) -> None:
    """Two configs, no default, fallbacks that fail: nothing is planned at start; the label's config
    applies once it is read."""
    s = named(tmp_path, FALLBACK_STRATEGIES="named,single")
    assert s.config.awaiting_label
    node, _ = s.nvml.attempt(fail_on_init_error=True)
    assert node is not None
    assert not s.replan.start(node) and s.reconciler.plans == {}
    assert s.replan.node_label("sliced")
    assert "::1" in s.reconciler.plan_json[GPU] and not s.config.awaiting_label


def test_a_config_added_to_the_directory_applies_when_the_label_names_it(tmp_path: Path) -> None:
    """The label names a config the ConfigMap lacks (refused); when the file appears, the directory
    watch's check applies it without another label change."""
    s = named(tmp_path, DEFAULT_CONFIG="plain")
    s.bring_up()
    assert not s.replan.node_label("later")
    (tmp_path / "configs" / "later").write_text(SLICED)
    s.replan.config_event()
    s.clock.advance(CONFIG_DEBOUNCE_S)
    s.timers.run_due()
    assert s.config.config_name == "later" and "::1" in s.reconciler.plan_json[GPU]
