"""Entry point: `python -m backends.launcher --config topo.yaml [--dry-run]`."""

import sys

from backends.launcher.cli import main

sys.exit(main())
