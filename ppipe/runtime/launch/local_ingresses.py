"""Ingress processes of this machine: ``ppipe serve --ingress N`` under the local launcher.

The ``ppipe serve`` process is then the scheduler's host alone: its
:class:`~ppipe.runtime.scheduler.host.Runtime` takes requests from ingress processes
(``accept_ingresses``), and its own HTTP app listens on a loopback port only. N ingress
processes (``python -m ppipe.runtime.launch.local_ingresses FD``, fresh interpreters named
``ppipe-ingress``) each bind the server's ``--port`` (and ``--grpc-port``) with
``SO_REUSEPORT``, so the kernel spreads the clients' connections over them. Each one reads,
authenticates, validates and decodes its requests, sends the scheduler their metadata, sends
each request's tensor to its batch's first worker when the scheduler says, and answers its
client with the rows the last worker sends it
(:class:`~ppipe.runtime.ingress.remote.IngressRuntime`).

Each ingress is reached over a private socket pair, as the local launcher's workers and
shards are: the first frame is its :class:`IngressStart`, answered ``(0, True, inbox
address)`` once the scheduler has told it which models are ready (or ``(0, False, error)``);
after that the pair carries nothing and is the lifeline both ways. An ingress whose server
is gone (SIGKILLed, crashed) sees the pair end and stops; one that dies is seen by the
server's :class:`IngressSupervisor`, which answers its requests ``ingress-gone`` in the
scheduler (:meth:`~ppipe.runtime.scheduler.ingresses.IngressesMixin.ingress_gone`: its
clients' connections died with it) and starts it again. SIGTERM of ``ppipe serve`` stops
the ingresses first (each drains its requests while the scheduler and the workers still
serve them), then the scheduler.

Plan switches are the scheduler's (``ppipe apply``, SIGHUP, ``--replan auto``): an ingress
passes ``/v2/admin/plan`` to the scheduler's own API on loopback
(:mod:`ppipe.runtime.ingress.admin_proxy`), and the scheduler tells every ingress the plan it
serves at its hello and after each switch, so that one restarted after a switch serves the
new plan too.

With ``--shards K`` every shard's host takes ingresses (each schedules its own models, or
servers); each ingress learns the schedulers from shard 0 at its hello
(:class:`~ppipe.runtime.scheduler.ingresses.IngressDirectory`), and an ingress that dies is
forgotten by every shard (the supervisor's ``on_gone``).

Under Ray, ingresses run on every node (:mod:`ppipe.runtime.launch.ray_ingresses`), each
one such a process that a Ray actor of its node starts; the supervisor is the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from ppipe.errors import UserError
from ppipe.runtime.launch.local import _frame, _loop_factory, _portable, _read_frame_blocking, _rebuilt, serve_child
from ppipe.runtime.wire.datapath import LOOPBACK

log = logging.getLogger("ppipe.runtime")
PROCESS_NAME = "ppipe-ingress"  # an ingress process's name in ps and top
RESTART_DELAYS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # between tries to restart an ingress; the last repeats
READY_POLL_S = 0.01
ON_GONE_TIMEOUT_S = 10.0  # the other schedulers hear of a dead ingress within this, or its restart goes on


@dataclass(frozen=True)
class IngressStart:
    """What ingress ``index`` is started with: the first frame on its pair.

    Attributes:
        index: the ingress's number (0..N-1).
        scheduler_address: the scheduler's ingress inbox (``Runtime.ingress_address``).
        dep: the :class:`~ppipe.runtime.launch.deploy.Deployment` served (plan, profiles).
        settings: the server's :class:`~ppipe.runtime.launch.shards.ServeSettings` (the
            ingress takes ``app``, ``server``, ``grpc`` and the data-path secret of ``runtime``).
        host, port: the shared address it binds (``SO_REUSEPORT``).
        admin_url: the scheduler's own HTTP API (``http://127.0.0.1:PORT``), where the ingress
            passes its admin requests (plan switches).
        start_timeout_s: it must serve, and have heard from the scheduler, within this.
        data_host: the address its inbox binds (workers and the scheduler reach it there).
    """

    index: int
    scheduler_address: str
    dep: Any
    settings: Any
    host: str
    port: int
    admin_url: str
    start_timeout_s: float = 60.0
    data_host: str = LOOPBACK


# ---- the ingress's process ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """``python -m ppipe.runtime.launch.local_ingresses FD``: serve as the ingress that the
    frame on the socket ``FD`` describes, until the server stops it or is gone."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # uvicorn takes it while serving, and re-raises it after: then ignored
    serve_child(argv, PROCESS_NAME, _serve, _loop_factory())


def _build(start: IngressStart):
    """The ingress's runtime, app and uvicorn server (nothing runs yet)."""
    import uvicorn

    from ppipe.runtime.ingress.admin_proxy import AdminProxy
    from ppipe.runtime.ingress.http_server import create_app
    from ppipe.runtime.ingress.http_transport import uvicorn_config
    from ppipe.runtime.ingress.remote import IngressRuntime

    settings = start.settings
    rt = IngressRuntime(start.index, start.scheduler_address, start.dep.plan, start.dep.profiles,
                        secret=settings.runtime.get("data_secret"), host=start.data_host)
    companions = []
    if settings.grpc:
        from ppipe.runtime.ingress.grpc_server import GrpcServer

        companions.append(GrpcServer(rt, shared_port=True, **settings.grpc))
    app = create_app(rt, companions=companions, **settings.app)
    app.fe.admin_proxy = AdminProxy(start.admin_url)
    server = uvicorn.Server(uvicorn_config(app, start.host, start.port, **settings.server))
    return rt, server


async def _serve(sock: socket.socket, start: IngressStart) -> None:
    from ppipe.runtime.launch.shards import reuseport_socket

    try:
        rt, server = _build(start)
        # listened on by uvicorn once its start-up (the scheduler's answer) is done: no connection waits on it before
        serving = asyncio.ensure_future(server.serve(sockets=[reuseport_socket(start.host, start.port, listen=False)]))
        await _until_ready(rt, server, serving, start.start_timeout_s)
    except BaseException as exc:
        if not isinstance(exc, UserError):
            traceback.print_exc()  # a bug: its traceback where the server's log is
        sock.sendall(_frame((0, False, _portable(exc))))
        return
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(_frame((0, True, rt.address)))
    lifeline = asyncio.ensure_future(reader.read())  # b"" once the server closes the pair or dies
    await asyncio.wait([serving, lifeline], return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True  # the server is gone: stop (a no-op if SIGTERM did already)
    await serving


async def _until_ready(rt: Any, server: Any, serving: asyncio.Future, timeout_s: float) -> None:
    """Wait until uvicorn serves (its start-up has waited for the scheduler's answer:
    :meth:`~ppipe.runtime.ingress.remote.IngressRuntime.start`).

    Raises:
        UserError: uvicorn stopped while starting (its error is logged above: a port taken,
            no answer from the scheduler), or did not serve within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if serving.done():
            serving.result()  # an exception of its own, if any
            raise UserError(f"ingress {rt.index} did not start: its HTTP or gRPC server stopped while starting",
                            fix="see its error above (a port taken by another program, or no answer from the scheduler?)")
        if time.monotonic() > deadline:
            raise UserError(f"ingress {rt.index} did not serve within {timeout_s:.0f} s")
        await asyncio.sleep(READY_POLL_S)


# ---- the server's side -------------------------------------------------------------------------------------
class LocalIngress:
    """One ingress process of this machine, and what starts it again."""

    def __init__(self, start: IngressStart):
        self.spec = start
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self._sock: socket.socket | None = None

    def describe(self) -> str:
        return f"ingress {self.spec.index} (pid {None if self.proc is None else self.proc.pid})"

    def launch(self) -> None:
        """Start the process and send it its :class:`IngressStart`; returns at once."""
        ours, theirs = socket.socketpair()
        try:  # a session of its own: the terminal's Ctrl-C is the server's to pass on
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self._sock = ours
        ours.sendall(_frame(self.spec))

    def wait_started(self) -> str:
        """Wait for the ingress to serve (blocking); its inbox address.

        Raises:
            UserError: it exited or refused to start (its error), or did not start in time.
        """
        assert self._sock is not None and self.proc is not None
        self._sock.settimeout(self.spec.start_timeout_s + 30.0)
        try:
            _, ok, value = _read_frame_blocking(self._sock)
        except socket.timeout:
            self.kill()
            raise UserError(f"{self.describe()} did not start within {self.spec.start_timeout_s + 30.0:.0f} s") from None
        except (EOFError, OSError):
            raise UserError(f"{self.describe()} exited while starting (exit code {self.proc.wait()})", fix="see its error above") from None
        self._sock.settimeout(None)
        if not ok:
            self.kill()
            err = _rebuilt(value)
            raise err if isinstance(err, UserError) else UserError(f"{self.describe()} did not start: {err}", fix="see its error above")
        self.address = value
        return value

    async def lifeline(self) -> int | None:
        """Returns once the process is gone (the pair ended); its exit code."""
        assert self._sock is not None
        reader, writer = await asyncio.open_connection(sock=self._sock)
        with contextlib.suppress(ConnectionError):
            await reader.read()
        writer.close()
        self._sock = None
        return await asyncio.to_thread(self._reap)

    def _reap(self) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # the pair ended but the process lingers: it is of no use
            self.kill()
            return self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM (no wait): it stops taking connections and answers what it holds."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float) -> None:
        """Wait (blocking) up to ``timeout_s`` for the process to exit."""
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)

    def again(self) -> "LocalIngress":
        """A fresh handle for the same ingress (not launched)."""
        return LocalIngress(self.spec)

    def kill(self) -> None:
        """SIGKILL its process group (its JSON decode pool too; no wait)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


class IngressSupervisor:
    """A companion of the scheduler process's app: starts the ingress processes once the
    runtime listens for them, restarts one that dies, and stops them at shutdown.

    Args:
        runtime: the :class:`~ppipe.runtime.scheduler.host.Runtime` (``accept_ingresses``).
        ingresses: ``ingresses(scheduler_address)``: the ingresses to start, not launched
            (:class:`LocalIngress`, or :class:`~ppipe.runtime.launch.ray_ingresses.RayIngress`
            under Ray), ingress ``i`` at index ``i``.
        stop_timeout_s: at shutdown, an ingress that has not drained within this is killed.
        on_gone: ``await on_gone(index)`` after ingress ``index`` died and this runtime
            forgot it: the other schedulers' turn (``--shards``), or None.
    """

    def __init__(self, runtime: Any, ingresses: Any, stop_timeout_s: float = 10.0, on_gone: Any = None):
        self.runtime, self._make, self.stop_timeout_s = runtime, ingresses, stop_timeout_s
        self.on_gone = on_gone
        self.ingresses: list[Any] = []
        self.restarts = 0
        self._watching: list[asyncio.Task] = []

    async def start(self) -> None:
        """Start every ingress and wait for them to serve.

        Raises:
            UserError: one did not start (the others are killed).
        """
        self.ingresses = self._make(self.runtime.ingress_address)
        try:
            for ing in self.ingresses:
                ing.launch()
            for ing in self.ingresses:
                await asyncio.to_thread(ing.wait_started)
        except BaseException:
            for ing in self.ingresses:
                ing.kill()
            raise
        self._watching = [asyncio.ensure_future(self._watch(i)) for i in range(len(self.ingresses))]

    async def _watch(self, index: int) -> None:
        """While serving: when ingress ``index`` dies, fail what it held and start it again."""
        tries = 0
        while True:
            ing = self.ingresses[index]
            code = await ing.lifeline()
            log.error("%s is gone (exit code %s); its requests are answered ingress-gone, and it is restarted", ing.describe(), code)
            try:
                self.runtime.ingress_gone(index)
            except Exception:  # a bug: said, and the ingress is restarted all the same
                log.exception("the scheduler could not forget %s", ing.describe())
            if self.on_gone is not None:  # before the restart: the new ingress's hello must not be forgotten with it
                try:
                    await asyncio.wait_for(self.on_gone(index), ON_GONE_TIMEOUT_S)
                except asyncio.TimeoutError:
                    log.warning("the other schedulers did not hear within %.0f s that ingress %d is gone; restarting it anyway "
                                "(they fail its batches by their report grace)", ON_GONE_TIMEOUT_S, index)
            ing.kill()  # what its group still holds (the JSON decode pool)
            while True:
                await asyncio.sleep(RESTART_DELAYS_S[min(tries, len(RESTART_DELAYS_S) - 1)])
                tries += 1
                fresh = ing.again()
                try:
                    fresh.launch()
                    await asyncio.to_thread(fresh.wait_started)
                except UserError as exc:
                    log.error("%s could not be restarted: %s", fresh.describe(), exc.render())
                    fresh.kill()
                    continue
                self.ingresses[index], tries = fresh, 0
                self.restarts += 1
                log.warning("%s serves again", fresh.describe())
                break

    async def stop(self) -> None:
        """SIGTERM every ingress, wait for them to drain (up to ``stop_timeout_s``), kill what is left."""
        for t in self._watching:
            t.cancel()
        for ing in self.ingresses:
            ing.terminate()
        deadline = time.monotonic() + self.stop_timeout_s
        for ing in self.ingresses:
            await asyncio.to_thread(ing.wait_exit, max(0.0, deadline - time.monotonic()))
            ing.kill()


if __name__ == "__main__":
    main()
