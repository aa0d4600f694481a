import sys

from loadtests.rebalance.run import main

sys.exit(main())
