"""Training and custom models on the EP communicator: autograd for dispatch and combine
(:mod:`ray_ep.nn.autograd`), the ``MoE`` layer (:mod:`ray_ep.nn.layer`) and a small MoE
transformer (:mod:`ray_ep.nn.transformer`)."""

from .autograd import Dispatched, combine, dispatch, moe, swiglu, swiglu_experts
from .layer import MoE, average_gradients
from .transformer import MoETransformer

__all__ = ["Dispatched", "MoE", "MoETransformer", "average_gradients", "combine", "dispatch", "moe", "swiglu",
           "swiglu_experts"]
