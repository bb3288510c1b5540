"""The ``usbyte-opt`` command line: one small module per subcommand, thin over domain code."""
