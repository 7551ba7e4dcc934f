"""A hung worker's stacks, for the log of its timeout: the worker answers a request for its
Python stacks (outermost frame first, so a deep recursion keeps its callers), and the parent
asks before it kills it. No torch here, so a process can install the answer without importing
torch first.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import traceback

# asks a worker for its Python stacks (answer_stack_requests); ignored by default, so a worker
# that does not answer it is not killed by it (nothing else sends it to a process without a
# socket)
STACK_SIGNAL = signal.SIGURG
_ELIDE_OVER, _OUTERMOST, _INNERMOST = 80, 50, 15  # frames of a thread's stack written


def answer_stack_requests() -> None:
    """In a worker: on :data:`STACK_SIGNAL`, write every thread's Python stack to stderr,
    outermost frame first, the middle of a deep one left out (a recursion thousands of frames
    deep keeps its callers and its top). Python runs the handler between two bytecodes of the
    main thread, so a hang in Python code answers; one inside a C call does not, and
    faulthandler's dump (:func:`dump_stacks`' second request) covers it."""
    def write_stacks(signum, frame):
        main_thread = threading.main_thread().ident
        for thread_id, top in sys._current_frames().items():
            top = frame if thread_id == main_thread else top  # not this handler's frame
            frames = traceback.format_list(traceback.extract_stack(top))
            if len(frames) > _ELIDE_OVER:
                frames = (frames[:_OUTERMOST]
                          + [f"  ... {len(frames) - _OUTERMOST - _INNERMOST} frames ...\n"]
                          + frames[-_INNERMOST:])
            sys.stderr.write(f"Stack of thread {thread_id}, outermost first:\n" + "".join(frames))
        sys.stderr.flush()

    signal.signal(STACK_SIGNAL, write_stacks)


def dump_stacks(process: subprocess.Popen, answer_s: float = 3.0, wait_s: float = 5.0) -> None:
    """Ask a hung worker where it is before it is killed, so that a timeout row's log says
    where the time went (a compile, a synchronize behind a stuck kernel, a loop): first its
    own Python stacks, outermost first (:func:`answer_stack_requests`), then SIGABRT, on
    which Python's faulthandler (on in :func:`worker_env`) writes every thread's innermost
    frames, even from inside a C call, and ends it."""
    try:
        process.send_signal(STACK_SIGNAL)
        time.sleep(answer_s)
        process.send_signal(signal.SIGABRT)
        process.wait(timeout=wait_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
