"""``python -m hermes_store``: the ``hermes-store`` command line."""

from hermes_store.cli import main

if __name__ == "__main__":
    main()
