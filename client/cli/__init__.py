"""The `ckptstore` command line: the parser and exit codes (`main`), and what each subcommand does."""

__all__: list[str] = []
