"""``python -m shared.planner`` (``make plan``): the command line lives in ``cli.py``."""

from shared.planner.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
