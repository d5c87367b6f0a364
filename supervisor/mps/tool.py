"""`nvidia-cuda-mps-control` as the supervisor drives it: start a daemon, send it a command, end it.

Every call runs the tool with the daemon's pipe and log directories in its environment (the MPS
docs' `CUDA_MPS_PIPE_DIRECTORY` / `CUDA_MPS_LOG_DIRECTORY`), bounded by `command_timeout`; a
failure comes back as a text for the caller's log and status, never an exception. The daemons'
supervision (supervisor/mps/daemons.py) decides when; this module only knows how.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from typing import Any

from supervisor.mps.layout import (
    LOG_ENV,
    MPS_CONTROL_BINARY,
    PIPE_ENV,
    START_LOG,
    DaemonSpec,
    _alive,
    daemon_comm,
    find_control_binary,
)

log = logging.getLogger("gpuvisor.mps")
MIG_PREFIX = "MIG-"  # an NVML MIG device UUID (MIG-<uuid>, or MIG-GPU-<uuid>/<gi>/<ci> before R470)


class ControlTool:
    def __init__(
        self,
        *,
        binary_name: str,
        driver_root: str,
        environ: Mapping[str, str],
        nvml_module: Any,
        command_timeout: float,
        quit_timeout: float,
    ) -> None:
        self._binary_name = binary_name
        self._driver_root = driver_root
        self._environ = dict(environ)
        self._nvml = nvml_module
        self._command_timeout = command_timeout
        self._quit_timeout = quit_timeout
        self.binary: str | None = None  # found by `find`, when a plan first needs it

    def find(self) -> str:
        """Find the binary (on PATH or under the driver root); raises MpsError naming where it looked."""
        self.binary = find_control_binary(
            self._binary_name, self._driver_root, self._environ.get("PATH", os.defpath)
        )
        return self.binary

    def launch(self, s: DaemonSpec) -> str:
        """Run `<binary> -d`; returns an error text, empty on success."""
        binary = self.binary or MPS_CONTROL_BINARY
        start_log = os.path.join(s.log_dir, START_LOG)
        try:
            # Output to a file, never a pipe: a daemon that inherited our pipe would keep it open.
            with open(start_log, "a+", encoding="utf-8") as out:
                offset = out.tell()
                done = subprocess.run(
                    [binary, "-d"],
                    env=self.env(s),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=self._command_timeout,
                    check=False,
                )
                out.seek(offset)
                output = out.read().strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"cannot start {binary} -d: {exc}"
        if done.returncode != 0:
            last = output.splitlines()[-1] if output else "no output"
            return f"{binary} -d exited with status {done.returncode}: {last}"
        return ""

    def end(self, s: DaemonSpec, pid: int) -> None:
        """`quit` the daemon (SIGTERM if it does not take it), then SIGKILL what is left after
        `quit_timeout`."""
        ok, answer = self.command(s, "quit")
        if not ok:
            log.warning(
                "MPS daemon for %s did not take quit (%s): terminating pid %d", s.resource, answer, pid
            )
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self._quit_timeout
        while self.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.alive(pid):
            log.warning("MPS daemon for %s (pid %d) still running after quit: killing it", s.resource, pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def alive(self, pid: int) -> bool:
        """`_alive` knowing the names our daemons run under: the default, and the binary in use."""
        names = {daemon_comm(MPS_CONTROL_BINARY), daemon_comm(self.binary or self._binary_name)}
        return _alive(pid, frozenset(names))

    def env(self, s: DaemonSpec) -> dict[str, str]:
        env = dict(self._environ)
        env[PIPE_ENV] = s.pipe_dir
        env[LOG_ENV] = s.log_dir
        env.update(s.extra_env())
        return env

    def command(self, s: DaemonSpec, command: str) -> tuple[bool, str]:
        """Send one command as the tool takes it (`echo <command> | nvidia-cuda-mps-control`)."""
        binary = self.binary or MPS_CONTROL_BINARY
        try:
            done = subprocess.run(
                [binary],
                input=command + "\n",
                env=self.env(s),
                capture_output=True,
                text=True,
                timeout=self._command_timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False, f"no answer within {self._command_timeout:g}s"
        except OSError as exc:
            return False, f"cannot run {binary}: {exc.strerror or exc}"
        if done.returncode != 0:
            text = (done.stderr or done.stdout or "").strip().splitlines()
            return False, f"exit status {done.returncode}: {text[-1] if text else 'no output'}"
        return True, done.stdout.strip()

    def set_compute_mode(self, s: DaemonSpec, *, exclusive: bool) -> str:
        """EXCLUSIVE_PROCESS (or back to DEFAULT) on every full GPU of the resource; an error text
        or "". A MIG device has no compute mode of its own (NVML answers NotSupported): NVIDIA's
        kubelet plugin sets it on the daemon's full GPUs only (v0.4.1 sharing.go
        `MpsControlDaemon.Start`: `setComputeMode(m.devices.GpuUUIDs(), ...)`), so a claim of
        MIG devices under MPS changes no compute mode."""
        module = self._nvml
        name = "EXCLUSIVE_PROCESS" if exclusive else "DEFAULT"
        mode = getattr(module, f"NVML_COMPUTEMODE_{name}")
        for uuid in s.gpu_uuids:
            if uuid.startswith(MIG_PREFIX):
                continue
            try:
                handle = module.nvmlDeviceGetHandleByUUID(uuid)
                module.nvmlDeviceSetComputeMode(handle, mode)
            except Exception as exc:  # any NVML error: name the GPU and the mode
                return f"cannot set compute mode {name} on GPU {uuid} for {s.resource}: {exc}"
        return ""
