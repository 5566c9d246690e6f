"""What a precision means to the memory model: the parameters' dtype, autocast's, and the scaler's bytes."""

from __future__ import annotations

import torch

PRECISION_DTYPES = {
    "32-true": (None, None),
    "bf16-mixed": (None, torch.bfloat16),
    "16-mixed": (None, torch.float16),
    "bf16-true": (torch.bfloat16, None),
    "16-true": (torch.float16, None),
}
"""precision -> (parameter dtype, autocast dtype); ``None``: the model's own dtype / no autocast."""

LOSS_SCALER_BYTES = {"16-mixed": 4 * 4}
"""The GradScaler's state per rank (``16-mixed``): the scale, its growth tracker, 1/scale and the
optimizer's found_inf, one 4-byte scalar each; every rank holds it (the pipeline keeps it identical)."""
