"""`python -m metrale` is `met`."""

import sys

from metrale.entrypoints.cli import main

sys.exit(main())
