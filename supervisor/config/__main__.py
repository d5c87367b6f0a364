"""`python -m supervisor.config --markdown`: print the README's settings table."""

import sys

from supervisor.config.docs import main

sys.exit(main())
