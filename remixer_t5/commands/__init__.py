"""The `remixer-t5` commands, one module each. A command module has `add_arguments(parser)`, which adds the
flags that command reads and no other, and `main(args) -> int`; `remixer_t5/cli.py` names it in its table of
commands and imports it only when it is the command given, so what it imports is loaded by that command alone.
`common.py` holds what several commands share: the gin flags, the run they configure, checkpoint arguments.
The `bench` and `repro` groups' subcommands follow the same contract in bench/ and repro/.
"""
