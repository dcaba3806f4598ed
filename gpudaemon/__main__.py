from gpudaemon.cli import main

raise SystemExit(main())
