"""`python -m tests.chaos`: run the chaos suite (see tests/chaos/runner.py)."""

import sys

from tests.chaos.runner import main

sys.exit(main())
