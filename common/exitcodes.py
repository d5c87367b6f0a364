"""The exit statuses of gpuvisor's processes, defined once for both roles.

The supervisor reads a worker's status to decide what its death means (a worker that cannot use
its plan is FATAL, not restarted in a loop), and systemd's `RestartPreventExitStatus=` and the
tests read the supervisor's: so each number has one definition, here.
"""

from __future__ import annotations

from typing import Final

EXIT_FAILURE: Final = 1  # a bug, or the run dir belongs to a running supervisor / cannot be made
EXIT_NVML_ERROR: Final = 3  # NVML could not be initialised and --fail-on-init-error is set
EXIT_CONFIG_ERROR: Final = 78  # EX_CONFIG from sysexits.h: a bad flag, env var, config file or plan
