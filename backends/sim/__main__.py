"""`python -m backends.sim --mode prefill|decode|null --port P ...`"""

from __future__ import annotations

from backends.sim.app import run
from backends.sim.config import config_from_args


def main() -> None:
    run(config_from_args())


if __name__ == "__main__":
    main()
