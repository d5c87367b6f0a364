"""The `gpuvisor` command: the console script's entry point, `python -m supervisor`, and what a
test calls to run a command in-process.

`main` runs the command inside `supervisor.launch.Launch`, which starts the worker zygote (for
`gpuvisor run`) before the CLI and the supervisor are imported, and cleans up after it
(supervisor/launch.py); `supervisor.cli.dispatch` then parses the command line and runs it.
"""

import os
import sys

from supervisor.launch import Launch


def main(argv: list[str] | None = None) -> int:
    """Run the `gpuvisor` command `argv` (default: this process's arguments); its exit status."""
    words = list(sys.argv[1:] if argv is None else argv)
    with Launch(words, os.environ) as launch:
        from supervisor.cli import dispatch

        return dispatch(words, launch)


if __name__ == "__main__":
    sys.exit(main())
