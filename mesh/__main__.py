"""``python -m mesh``: the same as the ``mesh`` command."""

from mesh.cli import main

raise SystemExit(main())
