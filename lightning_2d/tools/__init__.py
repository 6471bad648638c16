"""The command-line tools (``lightning-2d …``): ``cli`` (fit/validate/test/predict and the subcommands),
``planner`` (plan), ``benchmark``, ``prepare`` (prepare-data), ``export``, and ``launch`` (local processes).
The top layer: each may use everything below; nothing below imports a tool."""
