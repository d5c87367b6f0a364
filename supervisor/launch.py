"""What the `gpuvisor` command does first, with as few imports as it needs.

`check_import_root` makes sure `common` and `worker` are gpuvisor's (the design card's top-level
names could be another distribution's). `start_early_zygote` starts the worker zygote for
`gpuvisor run` (supervisor/workers/zygoteproc.py) before the CLI and the supervisor are
imported, so that the zygote's imports run beside theirs: on a small node the first worker's
fork waits for the zygote's own imports (docs/performance.md has the figures). The entry point
(`supervisor/__main__.py`: the console script and `python -m supervisor`) calls both, then
`supervisor.cli.launched`. Imports nothing of the supervisor's but the zygote's process start.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing itself is not imported before the zygote starts (mypy reads this)
if TYPE_CHECKING:
    import _socket
    from collections.abc import Mapping

    from supervisor.workers.zygoteproc import ZygoteProcess


def check_import_root() -> None:
    """`supervisor`, `worker` and `common` are top-level names (the design card's folders): make
    sure they are ours and not another distribution's (Supervisor ships a `supervisor` package).
    Found without importing them: the CLI must not pull the worker's modules in."""
    import importlib.util

    for name in ("common", "worker"):
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if not origin or not os.path.exists(os.path.join(os.path.dirname(origin), "py.typed")):
            raise SystemExit(
                f"gpuvisor: the module {name!r} at {origin} is not gpuvisor's; "
                "install gpuvisor into its own virtual environment (see the README)"
            )


def command_of(words: list[str]) -> str | None:
    """The subcommand a command line names: its first word that is not an option."""
    return next((w for w in words if not w.startswith("-")), None)


def start_early_zygote(
    words: list[str], environ: Mapping[str, str]
) -> tuple[ZygoteProcess, _socket.socket] | None:
    """The zygote's process and our end of its socket, for a command line that will use it
    (`gpuvisor run`, without help, version or `--zygote=false`); None otherwise, or when it
    cannot be started (the supervisor then starts one in its own time, and says so if it cannot)."""
    if command_of(words) != "run":
        return None
    from supervisor.workers.zygoteproc import start_process, wanted

    if not wanted(words, environ):
        return None
    try:
        return start_process(environ)
    except OSError:
        return None
