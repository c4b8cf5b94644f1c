"""Frontend shards as processes of this machine, without Ray: the local launcher's shards.

``ppipe serve --shards N`` under the local launcher runs shards 1..N-1 each in a Python
process of its own (``python -m ppipe.runtime.launch.local_shards``, a fresh interpreter:
a shard imports the HTTP server, the scheduler and the planner, which a fork of the
server's process would share copy-on-write only until the first collection). Each one is
a :class:`~ppipe.runtime.launch.shards.ShardServer`, the code a Ray shard runs: it starts
the workers of its own models with the local launcher (:mod:`ppipe.runtime.launch.local`;
they are its children, and a plan switch's new workers too), binds the shared port
(``SO_REUSEPORT``) and answers shard 0.

Shard 0 reaches a shard through a :class:`LocalShard` over a private socket pair (no port,
nothing another user can reach), as the local launcher reaches its workers: the first
frame is the shard's :class:`ShardStart`, answered by the router's address (or the error
that stopped it); then each frame is ``(id, request)``, a typed request of
:mod:`ppipe.runtime.control.shard_control` (peers, plan switches), answered by
``(id, ok, value)``. Frames are pickled (both ends are this program).

The pair is also the shard's lifeline. A shard whose server is gone (killed, crashed) sees
it end and stops, and with it its workers, whose pairs end in turn. A shard that dies is
restarted by shard 0's :class:`~ppipe.runtime.launch.shards.ShardSupervisor`, as a worker is: meanwhile every router
has it down (``None`` among its peers), so its models' requests get an explicit 503 at
once and those waiting for it get one too (nothing waits for an answer that cannot come);
once it is back, with the models, plan part and owners its :class:`LocalShard` last saw
committed, every router learns its new address. Each shard leads a process group of its own
(its workers, fork server, JSON decode pool): what a dead shard leaves in it is killed.
SIGTERM of ``ppipe serve`` stops every shard (SIGTERM: each drains as shard 0 does), then
kills what is left of each group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any

from ppipe.errors import UserError
from ppipe.runtime.control.shard_control import LogArrivals, ServedPart, ShardRequest
from ppipe.runtime.launch.local import PairCalls, _frame, _portable, _read_frame, _read_frame_blocking, _rebuilt, serve_child
from ppipe.runtime.launch.shards import ShardStart

log = logging.getLogger("ppipe.runtime")
PROCESS_NAME = "ppipe-shard"  # a shard process's name in ps and top


# ---- the shard's process -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """``python -m ppipe.runtime.launch.local_shards FD``: serve as the shard that the frame on
    the socket ``FD`` describes, until its server says stop or is gone."""
    serve_child(argv, PROCESS_NAME, _serve)


async def _serve(sock: socket.socket, start: ShardStart) -> None:
    from ppipe.runtime.launch.shards import ShardServer

    workers: dict[str, Any] = {}
    server = None
    try:
        workers = await asyncio.to_thread(_start_workers, start)
        server = ShardServer(start.index, start.dep, start.models, workers, {}, start.settings, start.owner, start.host, start.port)
        address = await server.start()
        if start.log_arrivals:
            await server.control(LogArrivals(True))
    except BaseException as exc:  # the server reports it (a missing sub-model is the user's to fix)
        if not isinstance(exc, UserError):
            traceback.print_exc()  # a bug: its traceback where the server's log is
        sock.sendall(_frame((0, False, _portable(exc))))
        if server is not None:
            await server.stop()
        _kill(workers)
        return
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(_frame((0, True, address)))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    calls = asyncio.ensure_future(_answer_calls(reader, writer, server))
    told = asyncio.ensure_future(stop.wait())
    await asyncio.wait([calls, told], return_when=asyncio.FIRST_COMPLETED)
    calls.cancel()
    await server.stop()  # drains as the server's shard 0 does (--shutdown-timeout-s)
    _kill(workers)  # a plan switch's workers end with this process: their pairs close


def _start_workers(start: ShardStart) -> dict[str, Any]:
    """The workers of the shard's models, as children of this process (the local launcher)."""
    from ppipe.runtime.control.shard_plan import sub_plan
    from ppipe.runtime.launch.local import start_local_workers

    options = start.settings.workers
    mine = {p.vgpu_id for p in sub_plan(start.dep.plan, start.models).placement}
    return start_local_workers(start.dep, options.get("backend", "ort"), options.get("backend_options"),
                               start.start_timeout_s, only=mine)


def _kill(workers: dict[str, Any]) -> None:
    for h in workers.values():
        h.kill()


async def _answer_calls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Any) -> None:
    """Answer the server's requests, each as its own task (a commit may wait on a drain)."""
    tasks: set[asyncio.Task] = set()
    try:
        while True:
            call_id, request = await _read_frame(reader)
            task = asyncio.ensure_future(_answer(writer, server, call_id, request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the server closed the pair or died: this shard ends with it


async def _answer(writer: asyncio.StreamWriter, server: Any, call_id: int, request: ShardRequest) -> None:
    try:
        reply = (call_id, True, await server.control(request))
    except Exception as exc:
        reply = (call_id, False, _portable(exc))
    writer.write(_frame(reply))


# ---- the server's side -------------------------------------------------------------------------------------
class LocalShard(ServedPart):
    """A :class:`~ppipe.runtime.control.shard_control.ShardHandle` on a shard process of
    this machine, and what starts it again.

    Requests are answered in any order (each frame carries its id). The handle keeps what
    the shard serves as the requests through it commit it
    (:class:`~ppipe.runtime.control.shard_control.ServedPart`), so that :meth:`restart`
    starts the shard that was serving.
    """

    def __init__(self, start: ShardStart):
        self.spec = start
        self.index = start.index
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.why_gone: str | None = None
        self.down: str | None = None  # why requests are refused: its process is gone and not yet restarted
        self._sock: socket.socket | None = None
        self._calls: PairCalls | None = None  # requests over the pair of the current process
        self._prepared: Any = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def describe(self) -> str:
        return f"shard {self.index} ({', '.join(self.spec.models)}; pid {self.pid})"

    # starting (blocking: the server's start-up, or a thread)
    def launch(self) -> None:
        """Start the shard's process and send it its :class:`ShardStart`; returns at once."""
        ours, theirs = socket.socketpair()
        try:
            # a session of its own: the terminal's Ctrl-C is the server's to pass on, and the
            # shard's group (its workers, fork server, decode pool) can be ended together
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self._sock = ours
        self._calls = PairCalls(ours, self._ended)
        self.why_gone = None
        ours.sendall(_frame(self.spec))

    def wait_started(self, timeout_s: float | None = None) -> str:
        """Wait for the shard to serve; its router address.

        Raises:
            UserError: it exited or refused to start (its error), or did not start in time.
        """
        assert self._sock is not None and self.proc is not None
        timeout_s = self.spec.start_timeout_s + 60.0 if timeout_s is None else timeout_s
        self._sock.settimeout(timeout_s)
        try:
            _, ok, value = _read_frame_blocking(self._sock)
        except socket.timeout:
            self.kill()
            raise UserError(f"{self.describe()} did not start within {timeout_s:.0f} s",
                            fix="a larger --start-timeout, or a lighter backend") from None
        except (EOFError, OSError):
            code = self.proc.wait()
            raise UserError(f"{self.describe()} exited while starting (exit code {code})", fix="see its error above") from None
        self._sock.settimeout(None)
        if not ok:
            self.kill()
            err = _rebuilt(value)
            if isinstance(err, UserError):
                raise err
            raise UserError(f"{self.describe()} did not start: {err}", fix="see its error above")
        self.address = value
        return value

    def restart(self) -> str:
        """Start the shard anew (its process is gone), as it served last; its new router address."""
        self._release()
        self.launch()
        return self.wait_started()

    # shard 0's requests (on the server's loop)
    async def call(self, request: ShardRequest) -> Any:
        if self.down is not None:  # checked first: a restart's new pair is not to be read here yet
            raise ConnectionError(self.down)
        assert self._calls is not None
        answer = await self._calls.call(request)
        self._note(request)
        return answer

    async def lifeline(self) -> None:
        """Returns once the shard's process is gone (:attr:`why_gone` says how)."""
        assert self._calls is not None
        await self._calls.wait_gone()

    async def _ended(self) -> tuple[str, type[Exception]]:
        code = await asyncio.to_thread(_reap, self.proc)
        self.why_gone = self.down = f"{self.describe()} is gone: exit code {code}"
        return self.why_gone, ConnectionError

    def reset(self) -> None:
        """Forget the last process's pair (on the server's loop, before :meth:`restart`; the
        shard stays :attr:`down` until :meth:`up`)."""
        if self._calls is not None:
            self._calls.close()
        self._calls = None
        self._prepared = None  # a switch it had prepared failed with it

    def up(self) -> None:
        """The restarted shard serves: requests go to it again (on the server's loop)."""
        self.down = None

    def _release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # stopping
    def terminate(self) -> None:
        """SIGTERM the shard (no wait): it drains and stops, as ``ppipe serve`` does."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the shard's process and every process of its group (no wait)."""
        if self.proc is not None:
            _kill_group(self.proc)

    def __repr__(self) -> str:
        return f"LocalShard({self.index}, pid {self.pid})"


def _reap(proc: subprocess.Popen | None) -> int | None:
    """Wait for a shard's process whose pair ended; its exit code. What its group still
    holds (a worker, the JSON decode pool, which outlive a killed parent) is killed."""
    if proc is None:
        return None
    try:
        code = proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:  # the pair ended but the process lingers: it is of no use
        proc.kill()
        code = proc.wait()
    _kill_group(proc)
    return code


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group that the shard's process leads (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing of it is left


def launch_local_shards(deps: list[Any], parts: list[list[str]], settings: Any, owner: dict[str, Any], host: str, port: int,
                        start_timeout_s: float = 300.0) -> list[LocalShard]:
    """Start the processes of shards 1.. (the calling process is shard 0); returns at once.
    ``deps[i]``: shard i's deployment (its plan holds its part). Their workers load while
    shard 0's do; :func:`wait_local_shards` waits for them."""
    shards: list[LocalShard] = []
    try:
        for i, models in enumerate(parts):
            if i > 0:
                shards.append(LocalShard(ShardStart(i, deps[i], list(models), settings, dict(owner), host, port,
                                                    start_timeout_s=start_timeout_s)))
                shards[-1].launch()
    except BaseException:
        kill_local_shards(shards)
        raise
    return shards


def wait_local_shards(shards: list[LocalShard]) -> list[str]:
    """Wait for every shard to serve; their router addresses.

    Raises:
        UserError: a shard did not start (every shard is then stopped).
    """
    try:
        return [s.wait_started() for s in shards]
    except BaseException:
        kill_local_shards(shards)
        raise


def kill_local_shards(shards: list[LocalShard]) -> None:
    for s in shards:
        s.kill()
    for s in shards:
        _reap(s.proc)


def stop_local_shards(shards: list[LocalShard], timeout_s: float) -> None:
    """SIGTERM every shard, wait up to ``timeout_s`` for all to stop, SIGKILL the rest."""
    for s in shards:
        s.terminate()
    deadline = time.monotonic() + timeout_s
    for s in shards:
        if s.proc is None:
            continue
        try:
            s.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s: killed", s.describe(), timeout_s)
        _kill_group(s.proc)
        s.proc.wait()


if __name__ == "__main__":
    main()
