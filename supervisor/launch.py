"""What the `gpuvisor` command does first and undoes last, with as few imports as it needs.

`Launch` is one context manager, entered by the entry point (`supervisor/__main__.py`: the
console script and `python -m supervisor`) before the CLI is imported. On entry it checks that
`common` and `worker` are gpuvisor's (`check_import_root`: the design card's top-level names
could be another distribution's), starts the worker zygote for `gpuvisor run`
(`start_early_zygote`, supervisor/workers/zygoteproc.py) and installs the dataclass code cache
(common/methodcache.py) for the CLI's and the supervisor's imports. The zygote starts here,
before the CLI and the supervisor are imported, because on a small node the first worker's fork
waits for the zygote's own imports (docs/performance.md has the figures). On exit, whatever the command did, the cache is
released and the zygote, unless the supervisor already ended it, is ended by its PID. Imports
nothing of the supervisor's but the zygote's process start, and so is no `contextlib` function:
that import (`collections`, `functools`) would come before the start.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing itself is not imported before the zygote starts (mypy reads this)
if TYPE_CHECKING:
    import _socket
    from collections.abc import Mapping

    from supervisor.workers.zygoteproc import ZygoteProcess


class Launch:
    """`with Launch(words, environ) as launch:` around the whole `gpuvisor` command (`words`, its
    arguments). `zygote` is the early zygote's process and our end of its socket, for the
    supervisor to take over (`Zygote.taking`), or None; `imports_done()` releases the cache as
    soon as the supervisor's modules are in. Exit releases the cache if that was not done, and
    ends the zygote if it still runs: one the supervisor never took over (a config error, a
    broken install, Ctrl-C); one it took, it has stopped by then."""

    def __init__(self, words: list[str], environ: Mapping[str, str]) -> None:
        self.words = words
        self.environ = environ
        self.zygote: tuple[ZygoteProcess, _socket.socket] | None = None
        self.caching = False  # the dataclass code cache is installed, by us

    def __enter__(self) -> Launch:
        check_import_root()
        self.zygote = start_early_zygote(self.words, self.environ)
        try:
            if command_of(self.words) == "run":  # after the zygote's start: it imports dataclasses
                from common import methodcache

                methodcache.install()
                self.caching = True
        except BaseException:  # Ctrl-C in that import: no zygote is left behind
            self.__exit__()
            raise
        return self

    def imports_done(self) -> tuple[int, int]:
        """Release the dataclass code cache (its table is ~0.5 MB): (texts taken from its file,
        texts compiled), or (0, 0) where it was not installed or is released already."""
        if not self.caching:
            return 0, 0
        from common import methodcache

        self.caching = False
        return methodcache.release()

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.imports_done()
        finally:
            if self.zygote is not None:
                from supervisor.workers.zygoteproc import stop_process

                stop_process(*self.zygote)  # a no-op on a process already reaped


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
