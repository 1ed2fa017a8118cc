"""``python -m asyncdbo demo`` == ``asyncdbo demo``."""

from .cli import main

raise SystemExit(main())
