"""The gRPC server on an event loop of its own, and what its handlers await.

    loop_server = LoopServer(options, interceptors, pool_threads=8)   # grpc.aio, started thread
    port = loop_server.add_insecure_port("127.0.0.1:0")
    loop_server.start(); ...; loop_server.stop(grace).wait(); loop_server.close()

    result = await settled(ticket)               # a core Ticket, without a thread
    await budget.acquire(nbytes, timeout)        # room for a push's bytes, on the loop
    budget.release(nbytes)                       # from any thread

Why: a server whose handlers block holds one thread per worker waiting at a sync
barrier (a thousand workers, a thousand threads, and their memory). Here the gRPC
server is ``grpc.aio``: a handler that waits (a sync round, the SSP bound, a
broadcast) awaits a ``core.modes.Ticket`` and holds no thread; the work of a call
(decoding, the core's checks, folding a push, an optimizer step, serializing a
pull) runs on a fixed pool of ``pool_threads`` threads (for a small store on the loop
itself: ``service.INLINE_BYTES``), and every handler that never waits is the plain
synchronous one run there (``grpc.aio``'s migration pool). The thread count does not
grow with the workers. An operator's Status runs on a thread of its own, ``control``,
never queued behind the pushes' and pulls' work on the pool (the health check is
answered on the loop itself).

``LoopServer`` gives ``RunningServer`` the calls of a ``grpc.Server`` (start, stop,
ports) from any thread; the loop runs on the thread "ps-aio".
"""

from __future__ import annotations

import asyncio
import collections
import threading
from concurrent import futures
from typing import Any, Callable

import grpc

from ps_server.core.modes.base import Ticket


class LoopServer:
    def __init__(self, options, interceptors, pool_threads: int):
        self.pool = futures.ThreadPoolExecutor(max_workers=pool_threads, thread_name_prefix="ps-rpc")
        self.control = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-control")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="ps-aio", daemon=True)
        self._thread.start()
        self.server = self.call(self._make(list(options), list(interceptors or ())))

    async def _make(self, options, interceptors) -> grpc.aio.Server:
        return grpc.aio.server(migration_thread_pool=self.pool, options=options, interceptors=interceptors)

    def call(self, coro, timeout: float | None = None) -> Any:
        """Run ``coro`` on the loop and return its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn: Callable[[], Any]) -> Any:
        async def on_loop():
            return fn()
        return self.call(on_loop())

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.run(lambda: self.server.add_generic_rpc_handlers(handlers))

    def add_insecure_port(self, address: str) -> int:
        return self.run(lambda: self.server.add_insecure_port(address))

    def add_secure_port(self, address: str, credentials) -> int:
        return self.run(lambda: self.server.add_secure_port(address, credentials))

    def start(self) -> None:
        self.call(self.server.start())

    def stop(self, grace: float | None) -> threading.Event:
        """Stop serving (calls still running get ``grace`` seconds); the event is set when done."""
        stopped = threading.Event()
        if self.loop.is_closed():
            stopped.set()
            return stopped
        future = asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop)
        future.add_done_callback(lambda _: stopped.set())
        return stopped

    def close(self) -> None:
        """Stop the loop and the pool (after ``stop``)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self.loop.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.control.shutdown(wait=False, cancel_futures=True)


async def settled(ticket: Ticket) -> Any:
    """The ticket's result (or its exception), awaited: no thread waits for it."""
    if not ticket.done():
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake(_: Ticket) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
        ticket.add_done_callback(wake)
        await done
    return ticket.result()


class AsyncBudget:
    """Bytes of pushes being received at once (``ps_server.buffers``), on the loop: ``acquire``
    awaits room (holding no thread), one push is always let in however large, waiters are
    served first come first served, and ``release`` may be called from any thread."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_use = 0
        self.peak = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: collections.deque[tuple[int, int, asyncio.Future]] = collections.deque()

    async def acquire(self, nbytes: int, timeout: float, limit: int | None = None) -> bool:
        self._loop = asyncio.get_running_loop()
        limit = self.limit if limit is None else limit
        if self._fits(nbytes, limit) and not self._waiters:
            self._take(nbytes)
            return True
        waiter = self._loop.create_future()
        entry = (nbytes, limit, waiter)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
            return True
        except asyncio.TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return True  # granted as the time ran out: it is ours
            waiter.cancel()
            self._forget(entry)
            return False
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release(nbytes)
            else:
                waiter.cancel()
                self._forget(entry)
            raise

    def release(self, nbytes: int) -> None:
        loop = self._loop
        if loop is None:
            self.in_use -= nbytes
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._give(nbytes)
        else:
            loop.call_soon_threadsafe(self._give, nbytes)

    def _fits(self, nbytes: int, limit: int) -> bool:
        return self.in_use == 0 or self.in_use + nbytes <= limit

    def _take(self, nbytes: int) -> None:
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)

    def _give(self, nbytes: int) -> None:
        self.in_use -= nbytes
        while self._waiters:  # first come, first served
            size, limit, waiter = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if not self._fits(size, limit):
                break
            self._waiters.popleft()
            self._take(size)
            waiter.set_result(None)

    def _forget(self, entry) -> None:
        try:
            self._waiters.remove(entry)
        except ValueError:
            pass
        if self.in_use == 0 or self._waiters:
            self._give(0)  # a waiter behind the one that left may fit now
