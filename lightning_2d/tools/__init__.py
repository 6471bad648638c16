"""The command-line tools (``lightning-2d …``): ``cli`` (fit/validate/test/predict and the subcommands),
``planner`` (plan), ``benchmark``, ``prepare`` (prepare-data), ``export``, ``launch`` (local processes) and
``options_table`` (the docs' table of the strategy options), ``docs`` (the docs' generated parts).
The top layer: each may use everything below; nothing below imports a tool."""
