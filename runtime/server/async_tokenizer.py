"""The server's tokenizer work (encode, decode, chat-template rendering) off the asyncio event loop.

Tokenizing runs in proportion to the prompt (a 30 MB prompt took 49 s): on the event loop it stalled
every other request and /health with it (fresh-8 F12). `AsyncTokenizer.run(fn, ...)` runs `fn` in one
worker thread, so the loop keeps answering while a prompt is tokenized.

One thread, so calls are serialised: a Hugging Face fast tokenizer is a Rust object behind a RefCell,
and a call that changes its truncation or padding while another call runs fails with RuntimeError
"Already borrowed". vLLM's server makes the same choice (one tokenizer thread). The engine's own
detokenizer (in the engine step thread) only reads the tokenizer, which is safe alongside.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class AsyncTokenizer:
    """`tokenizer`'s calls (and any function using it) awaited from the event loop, one at a time.

    Args:
        tokenizer: the engine's tokenizer (a transformers tokenizer).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fxrewrite-tokenizer")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the tokenizer thread; its result, or its exception raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, **kwargs: Any) -> list[int]:
        """Token ids of `text` (`tokenizer.encode(text, **kwargs)`)."""
        return list(await self.run(self.tokenizer.encode, text, **kwargs))

    async def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        """The text of `token_ids` (`tokenizer.decode(token_ids, **kwargs)`)."""
        return await self.run(self.tokenizer.decode, token_ids, **kwargs)

    def shutdown(self) -> None:
        """Stop the thread once its current call returns; queued calls are cancelled."""
        self._executor.shutdown(wait=False, cancel_futures=True)
