from rollstream.trainer.service import main

raise SystemExit(main())
