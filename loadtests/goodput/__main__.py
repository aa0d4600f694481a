"""`python -m loadtests.goodput`: the SLO goodput benchmark (loadtests/goodput/run.py)."""

import sys

from loadtests.goodput.run import main

sys.exit(main())
