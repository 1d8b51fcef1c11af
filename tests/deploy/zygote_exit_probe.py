"""A child for tests/deploy/test_zygote.py: ends as its first argument says, with an idle
thread pool (its worker thread waits on the pool's queue until the interpreter's exit wakes
it) and an atexit handler that must run first."""

import atexit
import sys
from concurrent.futures import ThreadPoolExecutor

pool = ThreadPoolExecutor(1)
pool.submit(print, "pool ran", flush=True).result()
sys.probe_pool = pool  # kept alive past the module's run, as a server's event loop keeps its
# executor (a pool collected earlier wakes its worker itself)
atexit.register(print, "atexit ran")  # flushed at exit
how = sys.argv[1]
if how == "raise":
    raise RuntimeError("probe failed")
if how == "interrupt":
    raise KeyboardInterrupt
sys.exit(None if how == "none" else int(how) if how.isdigit() else how)
