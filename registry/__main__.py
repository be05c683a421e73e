from .edge.server import main

raise SystemExit(main())
