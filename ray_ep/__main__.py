"""``python -m ray_ep``: the same as the ``ray-ep`` command."""

from .cli import main

raise SystemExit(main())
