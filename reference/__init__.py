"""Float64 ground truth of attention, and the definitions every part of the project shares.

    from reference import attention, attention_tiled, attention_lowp, merge
    from reference import attention_backward, attention_backward_tiled, attention_backward_lowp
    from reference import score_sensitivity   # what rounding the scores can do to out
    from reference import lse_sensitivity     # what summing the scores can do to lse
"""
from .backward import attention_backward
from .contract import Problem, check_attention_args, dtype_name, key_range
from .lowp import attention_backward_lowp, attention_lowp, round_to
from .merge import merge
from .naive import attention, lse_sensitivity, score_sensitivity
from .tiled import attention_tiled
from .tiled_backward import attention_backward_tiled

__all__ = ["attention", "attention_tiled", "attention_lowp", "merge", "round_to", "key_range",
           "attention_backward", "attention_backward_tiled", "attention_backward_lowp",
           "check_attention_args", "dtype_name", "Problem", "score_sensitivity",
           "lse_sensitivity"]
