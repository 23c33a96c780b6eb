"""A fake model runner for tests and benchmarks that step vLLM's real scheduler by hand (no model, no GPU).

:class:`FakeRunner` plays the model runner: ``step(scheduler)`` calls ``schedule()`` and then
``update_from_output()`` with one token for every scheduled request that is not inside a partial prefill chunk.
Tokens are a deterministic function of (request id, output position) unless the request was given an explicit
output token list, so a caller can arrange that a later turn's prompt equals an earlier turn's prompt + output +
tool tokens. A request ends at its target length (``max_tokens``; ``ignore_eos``). The simulator's own runner is
:mod:`simulator.runner`; this one serves hand-built requests (:func:`simulator.engine.make_request`).
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

from simulator.engine import VOCAB_SIZE, model_runner_output


def output_token(request_id: str, position: int) -> int:
    """The deterministic token a request emits at output ``position``."""
    return 3 + zlib.crc32(f"{request_id}:{position}".encode()) % (VOCAB_SIZE - 3)


def output_tokens(request_id: str, n: int) -> list[int]:
    return [output_token(request_id, i) for i in range(n)]


def prompt_tokens(key: str, n: int) -> list[int]:
    """Deterministic pseudo-random prompt tokens for ``key``."""
    out: list[int] = []
    i = 0
    while len(out) < n:
        h = hashlib.blake2b(f"{key}:{i}".encode(), digest_size=32).digest()
        out.extend(3 + int.from_bytes(h[j : j + 2], "little") % (VOCAB_SIZE - 3) for j in range(0, 32, 2))
        i += 1
    return out[:n]


@dataclass
class FakeRunner:
    """A fake model runner: one token per decoding request per step."""

    #: request id -> explicit output tokens (else :func:`output_token`).
    scripted: dict[str, list[int]] = field(default_factory=dict)
    steps: int = 0
    #: What the last ``update_from_output`` returned (EngineCoreOutputs per client).
    last_outputs: Any = None

    def model_output(self, scheduler, out):
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        requests = scheduler.requests
        for rid in req_ids:
            req = requests.get(rid)
            if req is None:
                sampled.append([])
                continue
            # num_computed_tokens was advanced by schedule(); a request still
            # short of its full token count is inside a partial prefill chunk.
            if req.num_computed_tokens < req.num_tokens:
                sampled.append([])
                continue
            pos = req.num_output_tokens
            script = self.scripted.get(rid)
            tok = script[pos] if script is not None and pos < len(script) else output_token(rid, pos)
            sampled.append([tok])
        return model_runner_output(req_ids, sampled)

    def step(self, scheduler):
        """One engine step: ``schedule()`` then ``update_from_output()``."""
        out = scheduler.schedule()
        self.last_outputs = scheduler.update_from_output(out, self.model_output(scheduler, out))
        self.steps += 1
        return out


def step(scheduler, runner: Optional[FakeRunner] = None):
    """Module-level shortcut: one engine step with a default :class:`FakeRunner`."""
    return (runner or _DEFAULT_RUNNER).step(scheduler)


_DEFAULT_RUNNER = FakeRunner()
