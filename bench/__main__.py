"""Entry point for `python -m bench`."""

import sys

from bench.cli.main import main

sys.exit(main())
