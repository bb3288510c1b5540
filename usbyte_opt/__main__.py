"""``python -m usbyte_opt`` runs the CLI."""

from .cli.main import main

if __name__ == "__main__":
    main()
