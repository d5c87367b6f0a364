"""`python -m worker`: the worker process entry point."""

import sys

from worker.process import leave_out_ssl

leave_out_ssl()  # before worker.main imports gRPC (and, through it, asyncio)

from worker.main import main  # noqa: E402

sys.exit(main())
