"""Which draft a model speculates with: V4.1's DSpark draft in its own file (ds4py.dspark) or V4's MTP block
(ds4py.mtp_spec), both a ds4py.spec.SpecModel; the one choice `run`, `chat`, `serve` and `bench` make (above both modules, so neither imports the
other's wrapper)."""

from __future__ import annotations

from ds4py.dspark import DSparkSpec
from ds4py.errors import Ds4Error
from ds4py.mtp_spec import MtpSpec


def speculative(model, mtp_path: str | None = None, enabled: bool = True, fixed_k: int | None = None):
    """`model` wrapped for speculative decoding when it is on and the model has a draft: V4.1's DSpark draft in its
    file (ds4py.dspark.DSparkSpec), or V4's MTP block (the --mtp file, or mtp.0.* tensors in its own GGUF);
    otherwise `model` itself. On by default: --no-spec sets enabled=False. A backend without speculation
    (capabilities) decodes plainly unless an --mtp file asks for it (refused)."""
    if enabled and model.config.has_dspark:       # V4.1: its DSpark draft, in the model file (ds4py.dspark)
        if mtp_path is not None:
            raise Ds4Error(f"--mtp {mtp_path}: this V4.1 model drafts with its own DSpark draft (in the model file); "
                           "drop --mtp")
        return DSparkSpec(model, model.open_dspark(), fixed_k)
    if not enabled or (mtp_path is None and not (model.capabilities.speculation and model.has_mtp_block())):
        return model
    return MtpSpec(model, model.open_mtp(mtp_path), fixed_k)
