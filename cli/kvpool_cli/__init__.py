"""kvpool's umbrella CLI (`kvpool`, `python -m kvpool_cli`): one command line over the connector,
the operator and the dev tooling, in a package of its own so that neither of them depends on
the others to offer it (kvpool_cli.main dispatches by name, importing a part only when used)."""
