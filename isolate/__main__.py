"""``python -m isolate VERB``: the same as the ``isolate`` command."""

from isolate.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
