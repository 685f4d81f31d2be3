"""Entry point for `python -m bench`."""

import sys

from bench.cli import main

sys.exit(main())
