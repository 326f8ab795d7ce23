from mesh.cli import main

raise SystemExit(main())
