"""One module per sub-command of `python -m ds4py`.

Each module defines NAME (the sub-command), HELP (one line), `add_arguments(parser)` and `run(args) -> int`.
`ds4py.__main__` discovers them, so adding a command never touches a shared file. Keep heavy imports inside
`run` so that `python -m ds4py --help` stays instant.
"""

# The --backend choices: ds4py.model.BACKENDS, repeated here so that building the parser imports no numpy
# (tests/test_cuda_engine.py checks that the two agree).
BACKENDS = ("ref", "cuda", "cuda-emu", "auto")
