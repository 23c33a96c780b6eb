"""A request's session identity, from every source RL frameworks send it by (``docs/session-identity.md``).

In order of precedence:

1. vLLM's typed ``Request.session_id`` (the OpenAI server fills it from the ``X-Session-ID`` header, the body's
   ``session_id`` or ``vllm_xargs["session_id"]``; SkyRL, prime-rl and NeMo Gym send it);
2. a kvpilot action in the request's ``kv_hints`` (``AsyncLLM.generate(kv_hints=KvHintsEnvelope(...))``):
   ``action_type`` :data:`KV_HINT_ACTION_TYPE`, major version 1, payload ``session_id``, ``turn``, ``tool``,
   ``expected_pause_s``;
3. kvpilot's ``extra_args`` keys (``kvpilot_session_id``, ``kvpilot_turn``, ``kvpilot_tool``,
   ``kvpilot_expected_pause_s``; :mod:`serving_hook.metadata`);
4. the block-hash chain, for what none of them gives (verl and AReaL send no session): a request whose prompt
   extends the chain of a finished request (every full block that request cached, one of them past its prompt)
   continues that request's session, one turn on; a request that extends none opens a session named by its
   own request id, turn 0.

Each field comes from the first source that gives it. Finding the chain costs one dict look-up per full block of
the new request's prompt, and only when no explicit source gives both session and turn; the finished chains are
kept in a bounded, insertion-ordered map (the oldest dropped first).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from policy.interface import RequestMeta
from serving_hook.metadata import KeySpec, read_keys, request_meta, warn_once

__all__ = ["KV_HINT_ACTION_TYPE", "KV_HINT_MAJOR_VERSION", "MAX_CHAINS", "SessionIdentity", "kv_hint_fields"]

#: ``KvHintAction.action_type`` of kvpilot's session action.
KV_HINT_ACTION_TYPE = "kvpilot.session"
#: The payload version this hook reads (``action_version`` "1" or "1.x").
KV_HINT_MAJOR_VERSION = "1"
#: Finished chains remembered for inference (about 150 bytes each).
MAX_CHAINS = 1 << 16

_PAYLOAD: KeySpec = {
    "session_id": ("session_id", "str", 0),
    "turn": ("turn", "int", 0),
    "tool": ("tool", "str", 0),
    "expected_pause_s": ("expected_pause_s", "float", 0),
}


def kv_hint_fields(kv_hints: Any) -> dict[str, Any]:
    """The RequestMeta fields of the first kvpilot session action in a ``KvHintsEnvelope`` (none: empty);
    never raises (bad values are ignored and warned about once)."""
    try:
        actions = kv_hints.actions if kv_hints is not None else None
        if not actions:
            return {}
        for a in actions:
            if a.action_type == KV_HINT_ACTION_TYPE:
                if str(a.action_version).split(".")[0] != KV_HINT_MAJOR_VERSION:
                    warn_once("action_version", a.action_version, f"kv_hints[{KV_HINT_ACTION_TYPE}]")
                    return {}
                return read_keys(a.payload, _PAYLOAD, f"kv_hints[{KV_HINT_ACTION_TYPE}].payload")
    except Exception:
        warn_once("<all>", "unreadable", "kv_hints")
    return {}


def _typed_session(request: Any) -> Optional[str]:
    sid = getattr(request, "session_id", None)
    return sid if isinstance(sid, str) and sid else None


class SessionIdentity:
    """Resolves each request's identity (module docstring) and remembers where finished turns' chains end."""

    def __init__(self, hash_block_size: int, sources: Optional[dict] = None, max_chains: int = MAX_CHAINS) -> None:
        self.block_size = hash_block_size
        self.max_chains = max_chains
        #: chain tip (the block hash of a finished request's last cached block) -> (session id, turn)
        self._tips: dict[Any, tuple[str, int]] = {}
        #: requests counted by where their session came from: "typed", "kv_hints", "extra_args", "chain"
        #: (continued a finished chain), "new" (opened one); the hook's ``HookStats.session_sources``
        self.sources: dict[str, int] = sources if sources is not None else {}

    def meta(self, request: Any) -> RequestMeta:
        """``request``'s metadata, its session identity resolved over every source."""
        meta = request_meta(request)
        changes = kv_hint_fields(getattr(request, "kv_hints", None))
        source = "kv_hints" if "session_id" in changes else "extra_args"
        typed = _typed_session(request)
        if typed is not None:
            changes["session_id"] = typed
            source = "typed"
        sid = changes.get("session_id", meta.session_id)
        turn = changes.get("turn", meta.turn)
        if sid is None or turn is None:
            found = self.continued(request)
            if sid is None:
                source = "chain" if found is not None else "new"
                sid, turn0 = found if found is not None else (request.request_id, -1)
                changes["session_id"] = sid
                if turn is None:
                    changes["turn"] = turn0 + 1
            else:
                changes["turn"] = found[1] + 1 if found is not None and found[0] == sid else 0
        self.sources[source] = self.sources.get(source, 0) + 1
        return dataclasses.replace(meta, **changes) if changes else meta

    def continued(self, request: Any) -> Optional[tuple[str, int]]:
        """(session, turn) of the longest finished chain ``request``'s prompt extends, or None."""
        tips = self._tips
        if not tips:
            return None
        hashes = request.block_hashes
        for i in range(min(len(hashes), request.num_prompt_tokens // self.block_size) - 1, -1, -1):
            hit = tips.get(hashes[i])
            if hit is not None:
                return hit
        return None

    def finished(self, request: Any, meta: RequestMeta) -> None:
        """``request`` finished a turn of ``meta``'s session: remember where its chain ends.

        The chain is every full block of the request's tokens but the last sampled one (vLLM never computes it,
        and a framework may re-render it); a chain that ends inside the prompt is not kept (a GRPO sibling's
        prompt would extend it).
        """
        if meta.session_id is None:
            return
        bs = self.block_size
        n = (request.num_tokens - 1) // bs
        hashes = request.block_hashes
        if n * bs <= request.num_prompt_tokens or len(hashes) < n:
            return
        tips = self._tips
        tip = hashes[n - 1]
        tips.pop(tip, None)
        if len(tips) >= self.max_chains:
            del tips[next(iter(tips))]
        tips[tip] = (meta.session_id, meta.turn or 0)
