"""Serve a small MoE transformer over HTTP: Ray Serve in front, ray_ep workers behind.

The model (ray_ep.serving.model) has an embedding, a few decoder layers whose MLP is an
expert-parallel MoE layer run by the EP workers (one per GPU, or CPU workers), and an output
head. Requests are batched continuously; greedy generation.

    python examples/serve_moe.py --workers 2 --port 8000      # the same flags as `ray-ep serve`
    curl -s localhost:8000/v1/generate -d '{"prompt_ids": [1, 2, 3], "max_new_tokens": 4}'
    curl -s localhost:8000/health
    curl -s localhost:8000/stats

Sizes come from flags (--hidden-size, --n-layers, ...) or --config YAML; weights are seeded
(--seed) or a safetensors --checkpoint in the layout documented in
ray_ep.serving.model. Quiet by default (the ready line, then "shutting down", "stopped");
--verbose shows Ray's and Serve's INFO lines, --access-log one line per request. Needs the
serve extra: pip install 'ray-ep[serve]'. See docs/serving.md.
"""

from __future__ import annotations

import sys

from ray_ep.serving import server

if __name__ == "__main__":
    sys.exit(server.main(sys.argv[1:]))
