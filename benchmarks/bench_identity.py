"""Benchmark: the hook's per-request cost of resolving session identity, beside vLLM's own hashing of the prompt.

For prompts of 1k, 16k and 64k tokens it times, once per request as the hook runs it at ``add_request``:

* ``vllm hash``: vLLM 0.33 building the ``Request`` (sha256 of every full block of the prompt);
* ``ids``:       ``SessionIdentity.meta`` when the request carries kvpilot's session and turn (no look-up);
* ``fresh``:     inferred, a prompt that extends no finished chain (every block looked up: the worst case);
* ``continued``: inferred, the next turn of a finished request (found at its chain's end, near the prompt's).

The index holds ``--chains`` finished chains. The ratios are each identity variant over vLLM's hashing of the
same prompt (inference is one dict look-up per block against vLLM's sha256 per block).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from simulator import fake_runner


def _median_us(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1024, 16384, 65536])
    ap.add_argument("--chains", type=int, default=10_000, help="finished chains in the index")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)

    from serving_hook.identity import SessionIdentity
    from simulator import engine

    ident = SessionIdentity(engine.BLOCK_SIZE)
    for k in range(args.chains):
        r = engine.make_request(f"f{k}", fake_runner.prompt_tokens(f"f{k}", 64), 24)
        r.append_output_token_ids(fake_runner.output_tokens(r.request_id, 24))
        ident.finished(r, ident.meta(r))
    print(f"{'prompt tokens':>13} {'vllm hash us':>13} {'ids us':>8} {'fresh us':>9} {'continued us':>13} "
          f"{'ids/hash':>9} {'fresh/hash':>11} {'cont/hash':>10}")
    for n in args.tokens:
        prompt = fake_runner.prompt_tokens(f"p{n}", n - 40)
        ids = {"kvpilot_session_id": "s", "kvpilot_turn": 1}
        vllm_us = _median_us(lambda p=prompt: engine.make_request("h", p, 8), args.reps)
        prev = engine.make_request(f"prev{n}", prompt, 24)
        prev.append_output_token_ids(fake_runner.output_tokens(prev.request_id, 24))
        ident.finished(prev, ident.meta(prev))
        nxt = engine.make_request("n", list(prev.all_token_ids) + fake_runner.prompt_tokens("tool", 16), 8)
        fresh = engine.make_request("x", fake_runner.prompt_tokens(f"x{n}", n), 8)
        explicit = engine.make_request("e", prompt, 8, extra_args=ids)
        assert ident.meta(nxt).session_id == prev.request_id and ident.meta(fresh).session_id == "x"
        ids_us = _median_us(lambda r=explicit: ident.meta(r), args.reps)
        fresh_us = _median_us(lambda r=fresh: ident.meta(r), args.reps)
        cont_us = _median_us(lambda r=nxt: ident.meta(r), args.reps)
        print(f"{n:>13,} {vllm_us:>13.1f} {ids_us:>8.1f} {fresh_us:>9.1f} {cont_us:>13.1f} "
              f"{ids_us / vllm_us:>9.3f} {fresh_us / vllm_us:>11.3f} {cont_us / vllm_us:>10.3f}")


if __name__ == "__main__":
    main()
