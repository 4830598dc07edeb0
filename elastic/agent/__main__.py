"""``python -m elastic.agent``: the per-node agent process (started by ``elastic-launch``)."""

import sys

from elastic.agent.main import main

sys.exit(main())
