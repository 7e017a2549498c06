"""The old home of the contract and the factory, kept so `from ds4py.model import ...` still works (tests, user
scripts): the contract is ds4py.contract (imports no backend), the factory ds4py.backends, the errors ds4py.errors.
Nothing in ds4py imports this module (tests/test_import_graph.py keeps the layers pointing down)."""

from ds4py.backends import BACKENDS, backend_options, open_model  # noqa: F401
from ds4py.contract import (DEFAULT_ROLLBACK_HORIZON, KV_DTYPES, MTP_SHAPE_KEYS, Capabilities, Model,  # noqa: F401
                            ModelBase, Mtp, MtpBase, Numerics, State, WeightBytes, check_mtp_file, device_generation,
                            host_copy_bandwidth_gbps, open_mtp)
from ds4py.errors import UnsupportedByBackend  # noqa: F401
