from shared.planner.dryrun import main

raise SystemExit(main())
