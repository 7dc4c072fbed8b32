"""``python -m pgque.demo`` (what ``make demo`` runs); see :mod:`pgque.demo.command`."""

import sys

from pgque.demo.command import main

if __name__ == "__main__":
    sys.exit(main())
