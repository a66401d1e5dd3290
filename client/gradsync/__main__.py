"""`python -m gradsync` runs the same command line as the `gradsync` script."""

from gradsync.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
