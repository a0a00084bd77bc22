"""The synchronous twin of the async client: the same names, blocking.

    with SyncClient(url, token) as c:
        with c.sandbox(pool="default", template="base") as sb:
            print(sb.exec(["echo", "hi"]).stdout)
            sb.files.write("/work/a.txt", b"hello")
            for chunk in sb.exec_stream(["sh", "-c", "echo out; echo err >&2"]):
                print(chunk.stream, chunk.data)

Each SyncClient runs one async Client (dsec/client.py) on a private event loop in a
thread of its own; every call hands its coroutine to that loop and waits for it. The
loop being elsewhere is what makes it work where one already runs in the calling thread
(a Jupyter notebook), where asyncio.run would refuse. Callbacks (`on_chunk`) run on the
client's thread and must not call the SyncClient, which would wait on itself.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from dsec.client import Client, ExecChunk, ExecStream, Sandbox, SandboxFiles

T = TypeVar("T")
SHUTDOWN_GRACE_S = 10.0


class _Blocking:
    """A method of a sync twin: runs the async method of the same name on the twin's
    loop and waits for it; `wrap` turns what it returns into its sync twin."""

    def __init__(self, wrap: Callable[[SyncClient, Any], Any] | None = None) -> None:
        self.wrap = wrap

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, twin: Any, owner: type | None = None) -> Any:
        if twin is None:
            return self
        method = getattr(twin._target, self.name)
        runner: SyncClient = twin._runner

        @functools.wraps(method)  # the async method's signature and documentation
        def blocking(*args: Any, **kwargs: Any) -> Any:
            result = runner._run(method(*args, **kwargs))
            return self.wrap(runner, result) if self.wrap else result

        return blocking


def _forwarded(name: str) -> property:
    return property(lambda twin: getattr(twin._target, name))


class SyncExecStream:
    """A streaming exec, blocking: a plain iterator of ExecChunk and a context manager,
    with write, close_stdin, resize, wait and the exit's fields once it ended."""

    write = _Blocking()
    close_stdin = _Blocking()
    resize = _Blocking()
    wait = _Blocking()
    close = _Blocking()
    exit = _forwarded("exit")
    exit_code = _forwarded("exit_code")
    timed_out = _forwarded("timed_out")
    truncated = _forwarded("truncated")
    duration_ms = _forwarded("duration_ms")

    def __init__(self, runner: SyncClient, stream: ExecStream) -> None:
        self._runner, self._target = runner, stream

    def __enter__(self) -> SyncExecStream:
        self._runner._run(self._target.__aenter__())
        return self

    def __exit__(self, *exc: object) -> None:
        self._runner._run(self._target.__aexit__(*exc))

    def __iter__(self) -> Iterator[ExecChunk]:
        return self

    def __next__(self) -> ExecChunk:
        chunk = self._runner._run(_next_chunk(self._target))
        if chunk is None:
            raise StopIteration
        return chunk


async def _next_chunk(stream: ExecStream) -> ExecChunk | None:
    # StopAsyncIteration must not cross into the waiting thread's future
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


class SyncSandboxFiles:
    """`sb.files`, blocking: write, read, list, remove, write_tar, read_tar, is_dir,
    upload, download."""

    write = _Blocking()
    read = _Blocking()
    list = _Blocking()
    remove = _Blocking()
    write_tar = _Blocking()
    read_tar = _Blocking()
    is_dir = _Blocking()
    upload = _Blocking()
    download = _Blocking()

    def __init__(self, runner: SyncClient, files: SandboxFiles) -> None:
        self._runner, self._target = runner, files


class SyncSandbox:
    exec = _Blocking()
    shell = _Blocking()
    renew = _Blocking()
    release = _Blocking()
    fork = _Blocking(lambda runner, forks: [SyncSandbox(runner, sb) for sb in forks])
    id = _forwarded("id")
    node = _forwarded("node")
    lease = _forwarded("lease")

    def __init__(self, runner: SyncClient, sandbox: Sandbox) -> None:
        self._runner, self._target = runner, sandbox
        self.files = SyncSandboxFiles(runner, sandbox.files)

    def exec_stream(self, cmd: list[str], *args: Any, **kwargs: Any) -> SyncExecStream:
        """Sandbox.exec_stream, as a plain iterator (`for chunk in sb.exec_stream(...)`)."""
        return SyncExecStream(self._runner, self._target.exec_stream(cmd, *args, **kwargs))


class SyncClient:
    """Client, blocking: `with SyncClient(url, token) as c:` (DSEC_URL and DSEC_TOKEN
    when not given); the same methods, answering SyncSandbox where Client answers
    Sandbox."""

    acquire = _Blocking(SyncSandbox)
    lease = _Blocking(SyncSandbox)
    release = _Blocking()
    fork = _Blocking()
    renew = _Blocking()
    get = _Blocking()
    lease_status = _Blocking()
    list = _Blocking()
    nodes = _Blocking()
    drain_node = _Blocking()
    undrain_node = _Blocking()
    pools = _Blocking()
    pool = _Blocking()
    set_pool = _Blocking()
    patch_pool = _Blocking()
    templates = _Blocking()
    template = _Blocking()
    put_template = _Blocking()
    delete_template = _Blocking()
    prewarm = _Blocking()

    def __init__(self, url: str | None = None, token: str | None = None, **options: Any) -> None:
        self._runner = self
        self._target = self._client = Client(url, token, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="dsec-sync-client", daemon=True
        )
        self._thread.start()
        try:
            self._run(self._client.__aenter__())  # the HTTP session belongs to that loop
        except BaseException:
            self._stop_loop()
            raise

    @property
    def url(self) -> str:
        return self._client.url

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._shutdown())
        finally:
            self._stop_loop()

    @contextmanager
    def sandbox(
        self, pool: str = "default", template: str = "base", **kw: Any
    ) -> Iterator[SyncSandbox]:
        """Client.sandbox: a sandbox released when the block ends, also on an error."""
        scope = self._client.sandbox(pool, template, **kw)
        sandbox = self._run(scope.__aenter__())
        try:
            yield SyncSandbox(self, sandbox)
        except BaseException as e:
            if not self._run(scope.__aexit__(type(e), e, e.__traceback__)):
                raise
        else:
            self._run(scope.__aexit__(None, None, None))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a SyncClient cannot be called from its own loop (a callback)")
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this SyncClient is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # a Ctrl-C here stops the call too (a sandbox() still releases)
            raise

    async def _shutdown(self) -> None:
        # calls abandoned by a Ctrl-C: a shielded release gets a moment to finish
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            _, pending = await asyncio.wait(others, timeout=SHUTDOWN_GRACE_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self._client.close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
