"""A module whose import starts a thread: a zygote that imported it must refuse to fork
(tests/test_spare_zygote.py)."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
