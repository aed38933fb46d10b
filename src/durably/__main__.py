"""``python -m durably``: the same command line as the ``durably`` script."""

from durably.cli import main

if __name__ == "__main__":
    main()
