"""`python -m worker`: the worker process entry point."""

import sys

from common import methodcache
from worker.process import leave_out_ssl

leave_out_ssl()  # before worker.main imports gRPC (and, through it, asyncio)
methodcache.install()  # the code @dataclass compiles, from its cache

from worker.main import main  # noqa: E402

methodcache.release()
sys.exit(main())
