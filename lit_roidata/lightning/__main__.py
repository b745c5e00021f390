"""``python -m lit_roidata.lightning``: ``lit-roidata`` with ``lightning.pytorch``."""

import sys

from lit_roidata.lightning import main

if __name__ == "__main__":
    sys.exit(main())
