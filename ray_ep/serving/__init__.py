"""The example MoE serving app: a small MoE transformer (:mod:`.model`) and its Ray Serve /
HTTP front (:mod:`.server`). An application of the library, not part of it.

``ray-ep serve`` and ``examples/serve_moe.py`` start it (see docs/serving.md). Importing this
package does not import ``ray.serve`` (that happens only when a server is built), so it works
without ``ray[serve]`` installed.
"""

from .model import (LOGIT_TOLERANCE, EPModel, ModelWeights, MoEModelConfig, NextTokens, check_checkpoint,
                    checkpoint_shapes, forward_reference, generate_reference, init_model_weights, load_checkpoint,
                    moe_layer_reference, pack_sequences, read_checkpoint_config, save_checkpoint)
from .server import (MoEServer, ServeOptions, add_arguments, build_app, main, options_from_args, run_from_args,
                     start_server)

__all__ = [
    # the model
    "EPModel", "LOGIT_TOLERANCE", "ModelWeights", "MoEModelConfig", "NextTokens", "check_checkpoint",
    "checkpoint_shapes", "forward_reference", "generate_reference", "init_model_weights", "load_checkpoint",
    "moe_layer_reference", "pack_sequences", "read_checkpoint_config", "save_checkpoint",
    # the server
    "MoEServer", "ServeOptions", "add_arguments", "build_app", "main", "options_from_args", "run_from_args",
    "start_server",
]
