"""CLI subcommands (each module: ``register(subparsers)``)."""
