"""The `natsl` command line (Typer). Each subcommand lives in its own module."""
