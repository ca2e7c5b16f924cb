"""How a dspzoo process ends: cleanly after success, one line and status 2 on bad input, a
traceback and status 1 on a bug.

**Clean exit.** A gloo worker thread finishes a collective, wakes the caller, and only *then*
drops its references to the collective's work and tensors. In torch 2.13 a C++ reference count
going from 2 to 1 on a tensor that has a Python object decrefs that object, taking the GIL
(``c10/util/intrusive_ptr.h``, ``PyInterpreter::decref``). If the interpreter has meanwhile
begun to finalize, Python ends the thread with ``pthread_exit``, whose unwinding through a
``noexcept`` frame calls ``std::terminate``: "terminate called without an active exception",
SIGABRT, after a run that succeeded (an aborted rank's core: ``ProcessGroupGloo::runLoop`` →
``~AsyncAllreduceWork`` → ``TensorImpl::decref_pyobject`` → ``gil_scoped_acquire`` →
``take_gil`` → ``PyThread_exit_thread`` → ``std::terminate``, while the main thread is in
``Py_FinalizeEx``). The worker threads live as long as their process group,
and :func:`torch.distributed.destroy_process_group` does not end them while anything (a mesh,
a DDP model, a ``DeviceMesh``'s reference cycles) still holds the group.
:func:`release_communicators` destroys every group and collects those references, which joins
the threads while the interpreter can still hand them the GIL (except for the group of a
``DistributedDataParallel`` model: torch keeps it referenced from C++ after the module is freed,
so its threads outlive the release, idle: DDP waits for its all-reduces inside ``backward``);
:func:`run_entry_point` calls it as soon as the entry point returns, and
:func:`dspzoo.core.parallel.mesh.build_mesh` registers it to run at exit for other callers.

**Bad input under a launcher.** :func:`run_entry_point` turns a
:class:`~dspzoo.core.errors.UsageError` (bad flags, files, shapes, configs: the raise sites
say so) into one line on stderr and exit status 2. With several ranks, the ranks that saw the
error post it on the default group's store; the lowest of them prints it (once), every rank
exits with status 2 (a rank whose collective failed because a peer left, or that the launcher
stops with SIGTERM after that exit, too), and none prints a traceback. The launcher then prints
its own report of the failed ranks; the printing rank writes its line into the launcher's error
file (``TORCHELASTIC_ERROR_FILE``, set by ``torchrun`` and ``accelerate launch``), so that the
report's root cause repeats it at the end of the output.

**Bugs.** Any other exception is an internal error. On one process it propagates (Python prints
its traceback, status 1). Under a launch with a process group, the first rank that fails posts
its rank on the store, prints its full traceback once and exits with status 1; every other
rank (its own exception, a collective broken by the failed peer, or the launcher's SIGTERM)
prints one line naming that rank, without a traceback, and exits with status 1 too.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import torch.distributed as dist

from .errors import UsageError

__all__ = [
    "BAD_INPUT_STATUS",
    "INTERNAL_ERROR_STATUS",
    "USER_ERRORS",
    "UsageError",
    "error_message",
    "release_communicators",
    "release_communicators_at_exit",
    "report_bad_input",
    "report_internal_error",
    "run_entry_point",
    "tell_launcher",
]

BAD_INPUT_STATUS = 2
INTERNAL_ERROR_STATUS = 1
REPORT_GRACE_S = 3.0
"""How long a rank that saw bad input waits for the others (lower ranks to claim the message,
every rank to report) before it exits anyway."""

_KEY = "dspzoo/bad_input/"
_BUG = "dspzoo/internal_error/"

USER_ERRORS: tuple[type[BaseException], ...] = (UsageError,)
"""Exceptions that mean bad input: printed as one line, exit status 2, no traceback. Anything
else (a ``KeyError``, a ``ValueError`` that is not a ``UsageError``, ...) is a bug."""


def error_message(exc: BaseException) -> str:
    """The message of an exception (``str(KeyError)`` would be the repr of its message)."""
    return str(exc.args[0]) if len(exc.args) == 1 else str(exc)


def release_communicators() -> None:
    """Destroy every process group and wait until their communication threads have exited.

    Safe to call more than once, without ``torch.distributed``, and after the caller destroyed
    the groups itself. Run it only when no collective is in flight on this rank (a group's
    destructor waits for its queued work).
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # groups destroyed earlier but held in reference cycles go now, not at exit


_registered = False
_prog = "dspzoo"  # the running entry point's name, for the line of a rank the launcher stops


def release_communicators_at_exit() -> None:
    """Run :func:`release_communicators` at interpreter exit (registered once per process),
    unless the interpreter exits on an uncaught exception: a collective may then be in flight,
    and a group's destructor would wait for it until the collective timeout."""
    global _registered
    if not _registered:
        atexit.register(_release_unless_failed)
        _registered = True


def _release_unless_failed() -> None:
    if getattr(sys, "last_value", None) is None:  # set when an uncaught exception was printed
        release_communicators()


def run_entry_point(main: Callable[[], Any], prog: str) -> int:
    """Run an entry point's ``main()``; return its exit status (``main``'s int result, or 0).

    Bad input (:data:`USER_ERRORS`) prints ``"<prog>: error: <message>"`` once and gives status
    2 (under a multi-rank launch every rank exits with 2 here, see the module docstring). Any
    other exception is a bug: it propagates on one process; under a launch its rank prints the
    traceback, the others one line naming that rank, and every rank exits with status 1. After
    success the communicators are released before returning. A reader that closed the pipe
    early (``script.py | head``) ends the run quietly, status 0 (:func:`reader_gone`).
    """
    global _prog
    _prog = prog
    launched = _launched_with_peers()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if launched else None
    try:
        result = main()
        sys.stdout.flush()  # a closed pipe raises here, not in the interpreter's exit
    except BrokenPipeError:
        return reader_gone()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except USER_ERRORS as exc:
        return report_bad_input(prog, exc)
    except Exception as exc:
        if launched and _board_says_bad_input():
            _hard_exit(BAD_INPUT_STATUS)  # a peer's bad input broke this rank's collective
        if launched:
            report_internal_error(prog, exc)  # returns only without a process group
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    release_communicators()
    return result if isinstance(result, int) else 0


def reader_gone() -> int:
    """Status 0 with stdout pointed at ``os.devnull``: the reader of a pipe left early
    (``dspzoo list | head``) and had what it wanted; the exit's flush of what is still
    buffered then cannot raise ``BrokenPipeError`` again (Python's documented recipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0


def report_bad_input(prog: str, exc: BaseException) -> int:
    """Print bad input as one line (once across the ranks) and return status 2.

    With several ranks this does not return: every rank that saw the error exits with status 2
    once all ranks have reported it (or after :data:`REPORT_GRACE_S`).
    """
    line = f"{prog}: error: {error_message(exc)}"
    store = _store()
    if store is None:
        print(line, file=sys.stderr, flush=True)
        return BAD_INPUT_STATUS
    rank, world = dist.get_rank(), dist.get_world_size()
    signal.signal(signal.SIGTERM, lambda *_: _hard_exit(BAD_INPUT_STATUS))
    try:
        store.set(f"{_KEY}{rank}", line)
        store.add(f"{_KEY}count", 1)
        deadline = time.monotonic() + REPORT_GRACE_S
        while rank > 0 and not _any_reported(store, range(rank)):
            if time.monotonic() > deadline or store.add(f"{_KEY}count", 0) >= world:
                break
            time.sleep(0.02)
        if not _any_reported(store, range(rank)) and store.add(f"{_KEY}printed", 1) == 1:
            print(line, file=sys.stderr, flush=True)
            tell_launcher(line)
        while store.add(f"{_KEY}count", 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # the store is gone (its host exited): say it here rather than nowhere
        print(line, file=sys.stderr, flush=True)
    _hard_exit(BAD_INPUT_STATUS)


def report_internal_error(prog: str, exc: BaseException) -> None:
    """Report a bug (any exception but bad input) under a launch, once, and exit with status 1.

    The first rank to fail posts its rank on the store, prints ``exc``'s traceback and exits;
    a rank failing after it (its own exception, or a collective the failed rank broke) prints
    one line naming it. Returns (for the caller to re-raise) when there is no process group
    to agree on: each process then prints its own traceback.
    """
    try:
        store = _store()
    except Exception:
        store = None
    if store is None:
        return
    rank = dist.get_rank()
    signal.signal(signal.SIGTERM, lambda *_: _hard_exit(INTERNAL_ERROR_STATUS))
    try:
        first = store.add(f"{_BUG}count", 1) == 1
        if first:
            store.set(f"{_BUG}rank", str(rank))
        failed = rank if first else int(store.get(f"{_BUG}rank"))
    except Exception:  # the store is gone: this rank's traceback, rather than nothing
        first = True
        failed = rank
    if first:
        traceback.print_exception(exc)
        tell_launcher(
            f"{prog}: internal error on rank {rank}: {type(exc).__name__}: "
            f"{error_message(exc)} (its traceback is in the ranks' output above)"
        )
    else:
        print(_peer_failed_line(prog, rank, failed), file=sys.stderr, flush=True)
    _hard_exit(INTERNAL_ERROR_STATUS)


def _peer_failed_line(prog: str, rank: int, failed: int) -> str:
    return (
        f"{prog}: rank {rank} stopped: rank {failed} failed with an internal error; its "
        f"traceback is above (or in rank {failed}'s log)"
    )


def _board_says_internal_error() -> int | None:
    """The rank that reported a bug, or ``None`` (also when that cannot be known)."""
    try:
        store = _store()
        if store is None or store.add(f"{_BUG}count", 0) == 0:
            return None
        return int(store.get(f"{_BUG}rank"))
    except Exception:
        return None


def tell_launcher(line: str) -> None:
    """Write ``line`` as this rank's error for the launcher's report of failed ranks.

    ``torchrun`` (and ``accelerate launch``, which runs it) names a file per rank in
    ``TORCHELASTIC_ERROR_FILE`` and shows its message as the root cause at the end of its
    report, after this rank's own output: the last thing the user reads is then this line.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            # torch's own record format (a message with its "call stack": here the line), so
            # the launcher neither warns about the format nor fails to set the exit code
            info = {"py_callstack": line, "timestamp": str(int(time.time()))}
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
    except OSError:
        pass  # the report then says "error_file: <N/A>": the line above still stands


def _any_reported(store: Any, ranks: range) -> bool:
    return any(store.check([f"{_KEY}{r}"]) for r in ranks)


def _store() -> Any:
    """The default group's store, or ``None`` on one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()


def _board_says_bad_input() -> bool:
    """Whether some rank has reported bad input (``False`` when that cannot be known)."""
    try:
        store = _store()
        return store is not None and store.add(f"{_KEY}count", 0) > 0
    except Exception:
        return False


def _launched_with_peers() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _on_sigterm(signum: int, frame: Any) -> None:
    """The launcher stops the other ranks when one exits: exit 2 if that was bad input, 1 with
    a line naming the failed rank if that was a bug."""
    if _board_says_bad_input():
        _hard_exit(BAD_INPUT_STATUS)
    failed = _board_says_internal_error()
    if failed is not None and failed != dist.get_rank():
        print(_peer_failed_line(_prog, dist.get_rank(), failed), file=sys.stderr, flush=True)
        _hard_exit(INTERNAL_ERROR_STATUS)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _hard_exit(status: int) -> NoReturn:
    """Exit now, without interpreter finalization.

    After bad input a collective may still be in flight (a peer left in the middle of it), and
    a process group's destructor would wait for it until the collective timeout; the
    interpreter's finalization would meet the communication threads described above.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)
