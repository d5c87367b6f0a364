"""The `gpuvisor` command's entry point (the console script) and `python -m supervisor`.

The worker zygote is started before the CLI and the supervisor are imported (supervisor/launch.py),
and for `gpuvisor run` the code `@dataclass` compiles is taken from its cache while they are
(common/methodcache.py).
"""

import os
import sys

from supervisor.launch import check_import_root, command_of, start_early_zygote


def main() -> int:
    check_import_root()
    early = start_early_zygote(sys.argv[1:], os.environ)
    if command_of(sys.argv[1:]) == "run":
        from common import methodcache

        methodcache.install()  # released by cmd_run once the supervisor's modules are in
    try:
        from supervisor.cli import launched
    except BaseException:  # a broken install, or Ctrl-C in these ~26 ms: no zygote is left behind
        if early is not None:
            from supervisor.workers.zygoteproc import stop_process

            stop_process(*early)
        raise
    return launched(None, early)


if __name__ == "__main__":
    sys.exit(main())
