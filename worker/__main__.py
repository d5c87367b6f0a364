"""`python -m worker`: the worker process entry point."""

import sys

from worker.main import main

sys.exit(main())
