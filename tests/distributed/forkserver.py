"""A fork server for the distributed tests: torch, Lightning and the worker are imported once, every rank
of every job is forked from that process.

Importing torch + Lightning (+ torchmetrics, which imports transformers) costs each rank ~5 s of CPU: on
2 cores a 4-rank job spent ~10 s starting before its first line of work, about a third of the suite.
A forked rank is still a process of its own: its own PID and session (the launcher kills a job as one
process group, a test can SIGSTOP or SIGKILL a rank), its own environment (the cluster variables set
after the fork), its own process group and log file. What it shares with the other ranks and jobs is
only the state of the imported modules at fork time: the server imports and never runs anything.

The server (``python forkserver.py``) reads one JSON request per line on stdin and answers on stdout:

- ``{"spawn": ID, "env": {...}, "log": PATH, "scenario": NAME, "config": PATH}`` → ``{"spawned": ID, "pid": PID}``;
- whenever a rank ends → ``{"exited": PID, "returncode": CODE}`` (negative: the signal, as ``Popen``).

The server is single-threaded and starts no threads, so ``fork`` is safe (torch's thread pools start on
first use, in the ranks). It freezes its objects before the first fork (``gc.freeze``, what the ``gc`` docs advise
for a server that forks): a rank's full collections then skip the ~400,000 imported objects instead of touching each
one's header, which copied the pages holding them (copy-on-write) and held the GIL for ~1-2 s each on a loaded machine.

Each rank reports a stall of its threads (``STALL_S`` or more without running: the GIL held, the process starved)
with where its main thread is when it runs again, so a watchdog test that names a rank for not beating can tell
the cause from its log.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: A rank's threads not running for this long is printed to its log.
STALL_S = 2.0


def report_stalls() -> None:
    """A daemon thread that wakes every 0.1 s; when it could not run for ``STALL_S`` or more, it prints how long and
    the main thread's innermost frames."""
    main = threading.main_thread().ident

    def watch() -> None:
        last = time.monotonic()
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            if now - last - 0.1 >= STALL_S:
                frame = sys._current_frames().get(main)
                where = "".join(traceback.format_stack(frame)[-4:]) if frame is not None else "  (gone)\n"
                print(f"[forkserver] this rank's threads could not run for {now - last - 0.1:.1f} s (the GIL held or"
                      f" the process starved); its main thread is now at:\n{where}", file=sys.stderr, flush=True)
            last = now

    threading.Thread(target=watch, daemon=True, name="forkserver-stall-report").start()


def run_rank(request: dict) -> None:
    """In the forked child: become the rank, run the scenario, exit (never returns)."""
    import atexit
    import faulthandler

    os.setsid()  # its own session: the launcher kills the job's processes as one group
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [str(Path(__file__).with_name("worker.py")), request["scenario"], request["config"]]
    faulthandler.enable(all_threads=True)
    report_stalls()
    code = 0
    try:
        from tests.distributed import worker

        worker.SCENARIOS[request["scenario"]](json.loads(Path(request["config"]).read_text()))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 — the rank's failure, printed as the interpreter would
        traceback.print_exc()
        code = 1
    # What a normal exit runs (the strategy's process-group teardown is an atexit handler), then leave
    # without unwinding into the server's loop.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve() -> None:
    # The heavy imports, once: every rank forked below starts with them done.
    sys.path.insert(0, str(REPO))
    from tests.distributed import worker  # noqa: F401

    gc.freeze()  # (module docstring)

    out = sys.stdout
    pending = b""
    stdin = sys.stdin.fileno()
    children: set[int] = set()
    open_ = True
    while open_ or children:
        ready, _, _ = select.select([stdin] if open_ else [], [], [], 0.05)
        if ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                open_ = False
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(stdin)
                    run_rank(request)
                children.add(pid)
                out.write(json.dumps({"spawned": request["spawn"], "pid": pid}) + "\n")
                out.flush()
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            out.write(json.dumps({"exited": pid, "returncode": code}) + "\n")
            out.flush()


if __name__ == "__main__":
    serve()
