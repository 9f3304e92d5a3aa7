from __future__ import annotations

from supervisor.cli import main

raise SystemExit(main())
