"""Semi-synchronous training: LocalSGD and (Streaming) DiLoCo on top of the Manager.

``LocalSGD`` averages the model every ``sync_every`` steps; ``DiLoCo`` averages
pseudo-gradients of model fragments and applies them with an outer optimizer. Both hook the
inner optimizer's ``step`` and are used as context managers around the training loop.
"""

from torchheal.local_sgd.diloco import DiLoCo
from torchheal.local_sgd.localsgd import LocalSGD, extract_local_tensor

__all__ = ["DiLoCo", "LocalSGD", "extract_local_tensor"]
