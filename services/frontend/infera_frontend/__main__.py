from infera_frontend.main import main

raise SystemExit(main())
