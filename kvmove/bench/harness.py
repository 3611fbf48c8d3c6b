"""One object in a child process, driven over a Pipe: how the benchmarks (and the tests) run
the far side of a transfer.

``Child(cls, *args, name=...)`` spawns a process (``multiprocessing``'s spawn context: a fork
would copy the parent's UCX worker threads and CUDA context, which do not survive it) that
builds ``cls(*args)`` and then runs its methods on command. ``cls`` must be importable by the
child: a module-level class of an importable module (spawn children inherit ``sys.path``).

The protocol, one pickled tuple per message::

    parent -> child   (method, args)         run ``obj.method(*args)``
                      None                   close the object and exit
    child  -> parent  ("ok", value)          the start, or a method, returned ``value``
                      ("err", kind, text)    it raised; ``kind`` is the exception's class name
                      ("event", value)       unasked: one of the object's ``work()`` events

Every reply is waited for with a deadline, polling every 50 ms whether the child still
lives: a dead child is a ``ChildError`` within 50 ms of its death, a wedged one at the
deadline, never a hang. A child that gets no command for ``idle_exit`` seconds assumes its
parent is gone and exits, so an orphan does not outlive a crashed run by more than that.

A hosted object may work between commands: if it has a ``work()`` method, the child calls it
whenever no command waits, and sends each event of the list it returns; ``None`` means
nothing to do, and the child then sleeps until the next command. ``close()``, if the object
has one, runs when the child ends, however it ends short of being killed.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
from collections import deque
from typing import Any

from kvmove.errors import KVMoveError

__all__ = ["Channel", "Child", "ChildError", "serve"]

_POLL_SECONDS = 0.05


class ChildError(KVMoveError):
    """A child process died, did not answer in time, or could not be sent a command; or a
    command raised in it, and then ``kind`` is the class name of what it raised and
    ``message`` its text (both empty otherwise)."""

    def __init__(self, text: str, kind: str = "", message: str = "") -> None:
        super().__init__(text)
        self.kind = kind
        self.message = message


class Channel:
    """Commands to an object hosted at the other end of ``conn`` (a ``multiprocessing``
    connection: a Pipe to a child, or a socket to another machine, ``kvmove.bench.remote``),
    every reply waited for with a deadline.

    Args:
        conn: the connection; this handle owns it.
        label: how errors name the other end.
        timeout: deadline in seconds of every reply (``timeout`` attribute: later calls see
            a change); ``call`` and ``reply`` may pass their own.
    """

    def __init__(self, conn: Any, label: str, timeout: float) -> None:
        self.conn = conn
        self.label = label
        self.timeout = timeout
        self.events: deque[Any] = deque()

    def call(self, command: str, *args: Any, timeout: float | None = None) -> Any:
        """``obj.command(*args)`` at the other end; its return value."""
        self.send(command, *args)
        return self.reply(command, timeout)

    def send(self, command: str, *args: Any) -> None:
        """Starts ``obj.command(*args)``; ``reply(command)`` collects its result later."""
        try:
            self.conn.send((command, args))
        except OSError as error:
            raise self.failure(f"{self.label} gone before {command!r}: {error}") from None

    def reply(self, command: str, timeout: float | None = None) -> Any:
        """The result of the command sent last; events that arrive first are kept."""
        seconds = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        while True:
            status, *rest = self._receive(command, deadline, seconds)
            if status == "ok":
                return rest[0]
            if status == "event":
                self.events.append(rest[0])
                continue
            kind, text = rest
            raise self.failure(f"{self.label} failed in {command!r}: {kind}: {text}", kind,
                               text)

    def event(self, what: str = "an event", timeout: float | None = None) -> Any:
        """The next event of the object's ``work()``: one kept already, or the next to come."""
        if self.events:
            return self.events.popleft()
        seconds = self.timeout if timeout is None else timeout
        status, *rest = self._receive(what, time.monotonic() + seconds, seconds)
        if status != "event":
            raise self.failure(f"{self.label} sent {status} {rest} while we waited for {what}")
        return rest[0]

    def _receive(self, what: str, deadline: float, seconds: float) -> tuple:
        while not self.conn.poll(_POLL_SECONDS):
            if not self._alive():
                raise self._died(what)
            if time.monotonic() > deadline:
                raise self.failure(f"{self.label} did not answer {what!r} within "
                                   f"{seconds:g} s")
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise self._died(what) from None

    def _alive(self) -> bool:
        """Whether the other end may still answer (a closed connection shows at ``recv``)."""
        return True

    def _died(self, what: str) -> Exception:
        return self.failure(f"{self.label} closed the connection during {what!r}")

    def failure(self, text: str, kind: str = "", message: str = "") -> Exception:
        """The exception this handle raises; a tool overrides it to raise its own class."""
        return ChildError(text, kind, message)


class Child(Channel):
    """Parent-side handle of a child process hosting ``cls(*args)``.

    Args:
        cls: the hosted class, importable in the child.
        *args: its constructor's arguments (pickled).
        name: the process's name.
        label: how errors name the child (default ``"child process 'NAME'"``).
        timeout: deadline in seconds of every reply (``timeout`` attribute: later calls see
            a change); ``call`` and ``reply`` may pass their own.
        start_timeout: deadline of the construction in the child (default ``timeout``).
        idle_exit: seconds without a command after which the child exits.

    Raises:
        ChildError (or what ``failure`` makes of it): the object could not be built in time.
    """

    def __init__(self, cls: type, *args: Any, name: str, label: str | None = None,
                 timeout: float = 30.0, start_timeout: float | None = None,
                 idle_exit: float = 300.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        conn, child = ctx.Pipe()
        super().__init__(conn, label or f"child process {name!r}", timeout)
        self.process = ctx.Process(target=_child_main, args=(child, cls, args, idle_exit),
                                   name=name, daemon=True)
        self.process.start()
        child.close()
        try:
            self.reply("start", start_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None  # started in __init__
        return pid

    def _alive(self) -> bool:
        return self.process.is_alive()

    def _died(self, what: str) -> Exception:
        self.process.join(1)
        return self.failure(f"{self.label} died during {what!r} (exit code "
                            f"{self.process.exitcode})")

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP: the child, its UCX progress thread included, stops until ``resume``.
        Returns once every thread of it has stopped (the signal is delivered asynchronously:
        a thread on another core can run on for a moment after ``kill`` returns)."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not _stopped(self.pid):
            if time.monotonic() > deadline:
                raise self.failure(f"{self.label} did not stop within {timeout} s of SIGSTOP")
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, then join: the object's ``close`` does not run."""
        self.process.kill()
        self.process.join(5)

    def stop(self, timeout: float = 10.0) -> None:
        """Asks the child to close its object and exit; kills it after ``timeout``. The child
        is dead and joined afterwards, whatever state it was in."""
        if self.process.is_alive():
            try:
                self.resume()  # a paused child could not read the request
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        self.conn.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the child ------------------------------------------------------------------------------

def _child_main(conn: Any, cls: type, args: tuple, idle_exit: float) -> None:
    """The child process: builds the object, answers commands until told to stop, the
    parent goes away or ``idle_exit`` passes without a command; then closes the object."""
    try:
        obj = cls(*args)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("err", type(error).__name__, str(error)))
        conn.close()
        return
    conn.send(("ok", None))
    try:
        serve(conn, obj, idle_exit)
    except (EOFError, OSError):  # the parent is gone
        pass
    finally:
        close = getattr(obj, "close", None)
        if close is not None:
            close()
        conn.close()


def serve(conn: Any, obj: Any, idle_exit: float) -> None:
    """Answers ``Channel`` commands on ``conn`` with ``obj``'s methods until told to stop, or
    ``idle_exit`` seconds pass without one. A closed connection raises (EOFError, OSError)."""
    work = getattr(obj, "work", None)
    busy = work is not None
    while True:
        if conn.poll(0 if busy else idle_exit):
            message = conn.recv()
            if message is None:
                return
            _answer(conn, obj, *message)
            busy = work is not None  # the command may have given it work
        elif busy and work is not None:  # (busy implies work: for the type checker)
            events = work()
            busy = events is not None
            for event in events or ():
                conn.send(("event", event))
        else:
            return  # no command for idle_exit seconds: the parent is gone or wedged


def _answer(conn: Any, obj: Any, command: str, args: tuple) -> None:
    """Runs one command and sends its reply; what it raises, or a result that cannot be
    pickled, goes back as an error and the child keeps serving."""
    reply: tuple[Any, ...]  # ("ok", value) or ("err", type name, message)
    try:
        method = None if command.startswith("_") else getattr(obj, command, None)
        if not callable(method):
            raise AttributeError(f"{type(obj).__name__} has no command {command!r}")
        reply = ("ok", method(*args))
    except Exception as error:  # noqa: BLE001 - any command's failure goes to the parent
        reply = ("err", type(error).__name__, str(error))
    try:
        conn.send(reply)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        conn.send(("err", type(error).__name__, f"cannot send the result of {command!r}: "
                   f"{error}"))


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (state T in /proc), or it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (FileNotFoundError, IndexError):
            continue  # the thread exited
        if state not in ("T", "t", "Z", "X"):
            return False
    return True
