"""Engine-thread events into asyncio: one `EngineRun` per submitted request.

The engine calls the sink from its own thread; the sink only hands the event
to the event loop (`call_soon_threadsafe`), so the engine never waits on the
HTTP side and never touches asyncio objects itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from skippy_cache.runtime import DoneEvent, Engine, Event, GenerationRequest, RequestHandle


class EngineRun:
    """One request on the engine, seen from the event loop."""

    def __init__(
        self,
        engine: Engine,
        request: GenerationRequest,
        *,
        on_done: Callable[[DoneEvent], None] | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._on_done = on_done
        self.done: DoneEvent | None = None
        # Raises RequestError / QueueFullError / EngineClosedError before anything is queued.
        self.handle: RequestHandle = engine.submit(request, self._sink)

    def _sink(self, event: Event) -> None:
        # Engine thread. A closed loop (server already gone) has no listener left.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver, event)

    def _deliver(self, event: Event) -> None:
        # Event loop. Counted here, not by the consumer, so a request whose
        # client went away is still counted when its cancellation lands.
        if isinstance(event, DoneEvent):
            self.done = event
            if self._on_done is not None:
                self._on_done(event)
        self._queue.put_nowait(event)

    async def events(self) -> AsyncIterator[Event]:
        """Token events, then the one DoneEvent."""
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, DoneEvent):
                return

    async def result(self) -> DoneEvent:
        async for event in self.events():
            if isinstance(event, DoneEvent):
                return event
        raise AssertionError("the engine ended a request without a DoneEvent")

    def cancel(self) -> None:
        """Free the lane at the engine's next step, unless the request already finished."""
        if self.done is None:
            self.handle.cancel()


async def cancel_on_disconnect(request: Request, run: EngineRun | EngineRuns) -> None:
    """Cancel `run` when the client goes away; run as a task next to the response.

    After the body has been read, the next ASGI message is `http.disconnect`
    (sent on client close, or once the response is complete). Works whether or
    not the ASGI server lets Starlette notice the disconnect itself.
    """
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            run.cancel()
            return


class EngineRuns:
    """The runs of one HTTP request, one per choice (`n`), seen as one."""

    def __init__(self, runs: list[EngineRun]) -> None:
        self.runs = runs

    def __len__(self) -> int:
        return len(self.runs)

    def cancel(self) -> None:
        for run in self.runs:
            run.cancel()

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) as they come, until every run has sent its DoneEvent."""
        if len(self.runs) == 1:
            async for event in self.runs[0].events():
                yield 0, event
            return
        merged: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        async def pump(index: int, run: EngineRun) -> None:
            async for event in run.events():
                merged.put_nowait((index, event))

        pumps = [asyncio.create_task(pump(i, run)) for i, run in enumerate(self.runs)]
        try:
            left = len(self.runs)
            while left:
                index, event = await merged.get()
                if isinstance(event, DoneEvent):
                    left -= 1
                yield index, event
        finally:
            for task in pumps:
                task.cancel()
