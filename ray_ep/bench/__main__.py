"""``python -m ray_ep.bench``: the same as ``ray-ep bench``."""

from .runner import main

raise SystemExit(main())
