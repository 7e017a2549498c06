"""One module per sub-command of `python -m ds4py`.

Each module defines NAME (the sub-command), HELP (one line), `add_arguments(parser)` and `run(args) -> int`.
`ds4py.__main__` discovers them, so adding a command never touches a shared file. Keep heavy imports inside
`run` so that `python -m ds4py --help` stays instant.
"""
