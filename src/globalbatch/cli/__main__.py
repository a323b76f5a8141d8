"""``python -m globalbatch.cli``."""

from globalbatch.cli import main

main()
