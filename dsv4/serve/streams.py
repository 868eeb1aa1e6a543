"""The engine's output streams of one HTTP request: merged, ended early when the server's shutdown grace
runs out, and abandoned (every sequence aborted) when the client leaves (their counting: `usage`).

A completion with several prompts is several engine requests; `merge` reads them all, and leaving it
for any reason (the client went away, an error, the end of the grace period) closes every stream, which
aborts every one of its sequences in the engine, batched prompts included.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

from starlette.requests import Request
from starlette.responses import Response

from ..engine.client import EngineDeadError, coalesce
from ..engine.sequence import RequestError, StepOutput
from .protocol import APIError

_DONE = object()
ENDED = object()  # put into a merge's queue when the shutdown grace period is over


class Endings:
    """The queues of the merges in flight, so that the end of the shutdown grace period reaches them all."""

    def __init__(self) -> None:
        self.queues: set[asyncio.Queue] = set()
        self.ended = False
        self.draining = False  # shutting down: an engine that stops ends the requests, not fails them

    def end_all(self) -> None:
        self.ended = True
        for q in list(self.queues):
            q.put_nowait(ENDED)


async def merge(
    streams: list[AsyncIterator[StepOutput]], endings: Endings | None = None
) -> AsyncIterator[tuple[int, StepOutput]]:
    """Outputs of several engine requests as they come: (stream index, output). Stops early (closing, i.e.
    aborting, every stream) when `endings.end_all()` is called; the caller then ends its unfinished choices."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[StepOutput]) -> None:
        try:
            async for out in it:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put(e)
        finally:
            await queue.put(_DONE)

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(streams)]
    if endings is not None:
        endings.queues.add(queue)
        if endings.ended:
            queue.put_nowait(ENDED)
    try:
        left = len(tasks)
        while left:
            items = [await queue.get()]
            while not queue.empty():  # a consumer that fell behind takes what waits, merged per choice
                items.append(queue.get_nowait())
            outputs: list[tuple[int, StepOutput]] = []
            end: object = None
            for item in items:
                if item is _DONE:
                    left -= 1
                elif item is ENDED:
                    end = ENDED
                elif isinstance(item, EngineDeadError) and endings is not None and endings.draining:
                    end = ENDED  # (the engine got the signal too: the requests end, as at the grace's end)
                elif isinstance(item, BaseException):
                    end = item
                else:
                    outputs.append(item)
                if end is not None:
                    break
            for pair in _coalesced(outputs):
                yield pair
            if end is ENDED:
                return
            if end is not None:
                raise end
    finally:
        if endings is not None:
            endings.queues.discard(queue)
        for t in tasks:
            t.cancel()
        for it in streams:
            with contextlib.suppress(Exception):
                await it.aclose()


def _coalesced(pairs: list[tuple[int, StepOutput]]) -> list[tuple[int, StepOutput]]:
    """(stream, output) pairs with each stream's outputs of the same choice merged (`coalesce`): one chunk
    per choice for a consumer that fell behind, instead of one per step."""
    if len(pairs) <= 1:
        return pairs
    by_stream: dict[int, list[StepOutput]] = {}
    for i, out in pairs:
        by_stream.setdefault(i, []).append(out)
    return [(i, out) for i, outs in by_stream.items() for out in coalesce(outs)]


async def first(it: AsyncIterator[StepOutput], param: str) -> StepOutput | None:
    """The first output of a request (raises the engine's refusal of it now, as a 400 naming `param`)."""
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None
    except RequestError as e:
        code = "context_length_exceeded" if "context" in str(e) or "cache" in str(e) else None
        raise APIError(400, str(e), param=param, code=code) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), type_="server_error") from None


async def chain(head: StepOutput | None, it: AsyncIterator[StepOutput]) -> AsyncIterator[StepOutput]:
    """The head output, then the rest of the request's outputs."""
    try:
        if head is not None:
            yield head
            async for out in it:
                yield out
    finally:
        with contextlib.suppress(Exception):
            await it.aclose()


async def close_all(streams: list[AsyncIterator[StepOutput]]) -> None:
    """Close (abort) every stream of a request, e.g. when one of its prompts is refused."""
    for it in streams:
        with contextlib.suppress(Exception):
            await it.aclose()


async def until_disconnect(request: Request, work: Awaitable):
    """Run `work`; cancel it when the client disconnects (its streams close: its sequences are aborted)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                return Response(status_code=499)
        return task.result()
    finally:
        if not task.done():  # cancelled from outside (the server's last resort)
            task.cancel()
