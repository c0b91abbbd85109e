"""``python -m kiln.sim``."""

from . import main

if __name__ == "__main__":
    main()
