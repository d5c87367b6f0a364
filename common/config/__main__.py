"""`python -m common.config --markdown`: print the README's settings table."""

import sys

from common.config.docs import main

sys.exit(main())
