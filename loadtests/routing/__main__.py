"""`python -m loadtests.routing`: the routing-quality benchmark (loadtests/routing/run.py)."""

import sys

from loadtests.routing.run import main

sys.exit(main())
