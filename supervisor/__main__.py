"""The `gpuvisor` command's entry point (the console script) and `python -m supervisor`.

The worker zygote is started before the CLI and the supervisor are imported (supervisor/launch.py).
"""

import os
import sys

from supervisor.launch import check_import_root, start_early_zygote


def main() -> int:
    check_import_root()
    early = start_early_zygote(sys.argv[1:], os.environ)
    from supervisor.cli import main as cli_main

    return cli_main(early=early)


if __name__ == "__main__":
    sys.exit(main())
