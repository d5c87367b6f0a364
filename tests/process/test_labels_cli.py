"""`gpuvisor labels` as a process: the oneshot file, the refresh loop, signals, and clear errors.

Each test runs the real command (`python -m supervisor labels`) on a simulated node (or on the
real binding with no NVML library, for the NVML failure) in a temp dir, and waits on what it
writes and logs with poll-until-true helpers.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.labelsrun import labels_env, run_labels, start_labels

TIMEOUT = 60.0


def lines(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


FILE_MODE = ("--use-node-feature-api=false", "--machine-type-file", "")


def test_oneshot_writes_the_file_once_and_exits_0(tmp_path: Path) -> None:
    """--oneshot: the features.d file (0644, sorted key=value lines, a timestamp) and exit 0, no temp file left."""
    out = tmp_path / "features.d" / "gfd"
    out.parent.mkdir()
    proc = run_labels("--simulate", "pcie-l4", "--oneshot", *FILE_MODE, "--output-file", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text.splitlines() == sorted(text.splitlines()) and text.endswith("\n")
    labels = lines(out)
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-L4" and labels["nvidia.com/gpu.count"] == "4"
    assert int(labels["nvidia.com/gfd.timestamp"]) > 1_600_000_000
    assert os.stat(out).st_mode & 0o777 == 0o644
    assert os.listdir(out.parent) == ["gfd"]  # the hidden temp file was renamed, not left behind


def test_env_vars_work_like_flags(tmp_path: Path) -> None:
    """GFD's env names: GFD_ONESHOT, GFD_OUTPUT_FILE, GFD_NO_TIMESTAMP, MIG_STRATEGY, USE_NODE_FEATURE_API."""
    out = tmp_path / "gfd"
    env = labels_env(
        GFD_ONESHOT="true", GFD_OUTPUT_FILE=str(out), GFD_NO_TIMESTAMP="TRUE", MIG_STRATEGY="mixed",
        USE_NODE_FEATURE_API="false", GFD_MACHINE_TYPE_FILE="", GPUVISOR_SIMULATE="mig-a100",
    )  # fmt: skip
    proc = run_labels(env=env)
    assert proc.returncode == 0, proc.stderr
    labels = lines(out)
    assert "nvidia.com/gfd.timestamp" not in labels
    assert labels["nvidia.com/mig.strategy"] == "mixed" and labels["nvidia.com/mig-1g.10gb.count"] == "9"


def test_empty_output_file_writes_to_stdout(tmp_path: Path) -> None:
    """--output-file "" prints the labels on stdout, as GFD does."""
    proc = run_labels(
        "--simulate", "dgx-a100", "--oneshot", "--no-timestamp", *FILE_MODE, "--output-file", ""
    )
    assert proc.returncode == 0, proc.stderr
    assert "nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB\n" in proc.stdout


def test_machine_type_file_is_read_and_a_bad_one_falls_back_to_unknown(tmp_path: Path) -> None:
    """A readable machine-type file names the machine (sanitised); a missing or unreadable one gives "unknown"."""
    machine = tmp_path / "product_name"
    machine.write_text("DGX A100 (rev 2)\n")
    out = tmp_path / "gfd"
    common = (
        "--simulate",
        "dgx-a100",
        "--oneshot",
        "--use-node-feature-api=false",
        "--output-file",
        str(out),
    )
    assert run_labels(*common, "--machine-type-file", str(machine)).returncode == 0
    assert lines(out)["nvidia.com/gpu.machine"] == "DGX-A100-rev-2"
    for bad in (tmp_path / "missing", tmp_path):  # a file that is not there, a directory
        proc = run_labels(*common, "--machine-type-file", str(bad))
        assert proc.returncode == 0, proc.stderr
        assert lines(out)["nvidia.com/gpu.machine"] == "unknown"
        assert f"cannot read the machine type from {bad}" in proc.stderr


def test_missing_output_directory_is_a_clear_error(tmp_path: Path) -> None:
    """An output file whose directory does not exist: exit 1 and one line naming the file and the directory."""
    out = tmp_path / "no-such-dir" / "gfd"
    proc = run_labels("--simulate", "pcie-l4", "--oneshot", *FILE_MODE, "--output-file", str(out))
    assert proc.returncode == 1
    assert f"the directory {out.parent} does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def _nvml_loads() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def test_nvml_failure_is_a_clear_error_or_gfds_fallback(tmp_path: Path) -> None:
    """No NVML library: exit 1 with what to check; --fail-on-init-error=false labels without GPU labels."""
    if _nvml_loads():
        pytest.skip("NVML loads on this machine: this test needs a node without libnvidia-ml")
    out = tmp_path / "gfd"
    proc = run_labels("--oneshot", *FILE_MODE, "--output-file", str(out))
    assert proc.returncode == 1
    assert "NVML could not be initialised" in proc.stderr and "NVIDIA driver is loaded" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    proc = run_labels("--oneshot", "--fail-on-init-error=false", *FILE_MODE, "--output-file", str(out))
    assert proc.returncode == 0, proc.stderr
    # GFD's null manager: no device, so only the timestamp and the vGPU labels (lm/nvml.go:49-51)
    assert set(lines(out)) <= {"nvidia.com/gfd.timestamp", "nvidia.com/vgpu.present"}
    assert "nvidia.com/gfd.timestamp" in lines(out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--mig-strategy", "triple"), 'flag --mig-strategy: invalid value "triple"'),
        (("--sleep-interval", "10"), "flag --sleep-interval: invalid duration '10'"),
        (("--sleep-interval", "100ms"), "must be at least 1s or infinite"),
        (("--oneshot=maybe",), "flag --oneshot"),
        (("--device-discovery-strategy", "tegra"), "gpuvisor does not implement"),
        (("--simulate", "no-such-profile"), "no such built-in profile"),
    ],
)
def test_bad_settings_exit_78_with_one_line(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    """A bad flag value or profile ends with status 78 (EX_CONFIG) and a line saying where and why."""
    proc = run_labels(
        "--simulate", "pcie-l4", "--oneshot", *FILE_MODE, "--output-file", str(tmp_path / "gfd"), *args
    )
    assert proc.returncode == 78, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bad_config_file_is_refused(tmp_path: Path) -> None:
    """A config file with replicas < 2 is refused with the file, the key and GFD's reason."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: nvidia.com/gpu, replicas: 1}]\n"
    )
    proc = run_labels("--simulate", "pcie-l4", "--oneshot", *FILE_MODE, "--config-file", str(config))
    assert proc.returncode == 78
    assert (
        f"{config}: sharing.timeSlicing.resources[0].replicas: number of replicas must be >= 2" in proc.stderr
    )


def test_loop_rewrites_only_on_change_reloads_on_sighup_and_cleans_up_on_sigterm(tmp_path: Path) -> None:
    """The loop: same labels leave the file untouched; SIGHUP applies a new config (and timestamp);
    SIGTERM exits 0 and removes the file so NFD drops the labels (GFD's cleanup)."""
    out, log, config = tmp_path / "gfd", tmp_path / "log", tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    proc = start_labels("--simulate", "dgx-h100", "--sleep-interval", "1s", *FILE_MODE, "--output-file", str(out),
                        "--config-file", str(config), "--log-level", "debug", log=log)  # fmt: skip
    try:
        assert wait_until(out.exists, timeout=TIMEOUT), log.read_text()
        inode = os.stat(out).st_ino
        assert lines(out)["nvidia.com/gpu.replicas"] == "1"
        assert wait_until(lambda: log.read_text().count("labels unchanged") >= 2, timeout=TIMEOUT), (
            log.read_text()
        )
        assert os.stat(out).st_ino == inode  # not rewritten: same inode, same content
        config.write_text(
            "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: nvidia.com/gpu, replicas: 3}]\n"
        )
        proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: lines(out).get("nvidia.com/gpu.replicas") == "3", timeout=TIMEOUT), (
            log.read_text()
        )
        assert lines(out)["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"
        config.write_text("version: v1\nsharing: {timeSlicing: {resources: []}}\n")  # bad: refused at reload
        proc.send_signal(signal.SIGHUP)
        assert wait_until(
            lambda: "reload refused, keeping the running config" in log.read_text(), timeout=TIMEOUT
        )
        assert lines(out)["nvidia.com/gpu.replicas"] == "3"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "log"]  # no temp file left behind either


def test_infinite_interval_labels_once_and_keeps_the_file(tmp_path: Path) -> None:
    """--sleep-interval infinite labels once and waits; SIGTERM then leaves the file (GFD keeps it too)."""
    out, log = tmp_path / "gfd", tmp_path / "log"
    proc = start_labels(
        "--simulate",
        "pcie-l4",
        "--sleep-interval",
        "infinite",
        *FILE_MODE,
        "--output-file",
        str(out),
        log=log,
    )
    try:
        assert wait_until(lambda: "waiting for a signal" in log.read_text(), timeout=TIMEOUT), log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert lines(out)["nvidia.com/gpu.product"] == "NVIDIA-L4"
