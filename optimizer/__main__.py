"""`python -m optimizer` is the same as the `optimize` console script."""

import sys

from optimizer.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
