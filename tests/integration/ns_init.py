"""PID 1 of a test host's PID namespace (tests/integration/hosts.py): reaps every
orphan (so a dead process's pid is free, never a zombie that kill(pid, 0) still finds),
and on SIGTERM kills everything else in the namespace and exits. Killing it with
SIGKILL is a host that vanished: the kernel kills every process of the namespace."""

import os
import signal
import sys
import time


def _halt(*_: object) -> None:
    try:
        os.kill(-1, signal.SIGKILL)  # in a PID namespace: every process of it but this one
    except ProcessLookupError:
        pass
    sys.exit(0)


signal.signal(signal.SIGTERM, _halt)
signal.signal(signal.SIGINT, _halt)
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
