"""`python -m gyre_base`: the `gyre-base` command."""

import sys

from gyre_base.cli import main

sys.exit(main())
