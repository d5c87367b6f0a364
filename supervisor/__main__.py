"""`python -m supervisor`: the gpuvisor command."""

import sys

from supervisor.cli import main

sys.exit(main())
