"""What the HTTP application holds: the engine client, the tokenizer, the limits and the shutdown state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..engine.client import EngineClient
from .metrics import ServerMetrics
from .streams import Endings
from .validate import Limits


@dataclass
class ServerState:
    engine: EngineClient
    tokenizer: object  # encode(text, bos=...) / decode(ids, skip_special_tokens=...)
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    metrics: ServerMetrics | None = None
    limits: Limits | None = None  # default: from max_model_len, a 2^20-token vocabulary
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # shutting down: new requests get 503
    endings: Endings = field(default_factory=Endings)
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="dsv4-prepare")
    )

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = Limits(
                vocab_size=1 << 20, max_model_len=self.max_model_len, max_sequence_tokens=self.max_model_len
            )

    async def offload(self, fn: Callable, *args):
        """fn(*args) in a worker thread (the event loop goes on meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def begin_drain(self) -> None:
        """Stop admitting requests (503); those in flight go on."""
        self.draining = self.endings.draining = True

    def end_in_flight(self) -> None:
        """End every request still in flight now (a final chunk with finish_reason "abort")."""
        self.endings.end_all()
