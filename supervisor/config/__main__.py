"""`python -m supervisor.config --markdown`: print the settings table of docs/configuration.md."""

import sys

from supervisor.config.docs import main

sys.exit(main())
