"""A step-cost model fitted to one engine's measured steps, and the preset file that holds it.

``kvpilot calibrate`` (:mod:`training.calibrate`) fits :class:`FittedCost` to the ``steps`` telemetry of a real
server and writes it as a TOML preset; ``--preset PRESET.toml`` then makes ``simulate``, ``evaluate`` and
``bound`` model that server instead of a roofline GPU (:class:`simulator.cost_model.CostModel`). One engine
step costs, for a step that schedules anything (the terms of :mod:`simulator.cost_model`'s inputs)::

    step_time = overhead + prefill_token_s * P + decode_token_s * S
              + prefill_pair_s * A_p + decode_context_s * A_d

Linear, so a step priced for several iterations (the decode stride) and the makespan bound's sums are exact.
The preset also records the engine: vLLM's KV blocks, their size, ``max_num_seqs`` and
``max_num_batched_tokens``; and, where calibrate was given the replayed workload, the client's round trip (from a
finished request to the trajectory's next one, tool wait aside), which the simulator adds to every follow-up.
The simulator's blocks are 16 tokens; a preset of another block size is modelled with the same KV capacity in
tokens. A fitted engine has no host tier (vLLM refuses its native CPU offloading
on a CPU engine): runs on it have the tier off whatever ``offload_gib`` says.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from simulator.cost_model import CostModel, IterationPricing

__all__ = ["EngineShape", "FittedCost", "PresetFileError", "StepCost", "engine_limits", "load_cost",
           "read_preset_file", "write_preset_file"]


class PresetFileError(ValueError):
    """A preset file that cannot be read: the message names the file and the field."""


@dataclass(frozen=True)
class EngineShape:
    """The engine a preset models: vLLM's ``num_gpu_blocks`` (its null block included) and scheduler limits."""

    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class FittedCost(IterationPricing):
    """Seconds of one engine step, linear in what it scheduled (see the module docstring)."""

    name: str
    engine: EngineShape
    step_overhead_s: float
    prefill_token_s: float
    decode_token_s: float
    prefill_pair_s: float
    decode_context_s_per_token: float
    #: No GPU or model spec: a fitted engine prices no training step or weight transfer by peak figures.
    gpu: None = None
    model: None = None
    host_tier: bool = False
    #: The client's round trip between a finished request and the trajectory's next one, measured with
    #: ``kvpilot calibrate --workload``: its quantiles at 0, 5, ..., 100% (``[client]``; empty: not measured),
    #: which the simulator draws each follow-up's from (:class:`simulator.round_trip.RoundTrip`).
    round_trip_quantiles_s: tuple[float, ...] = ()

    def step_time(self, prefill_tokens: int, prefill_context_tokens: int, decode_seqs: int,
                  decode_context_tokens: int) -> float:
        """Seconds of one engine step (0.0 for an empty step)."""
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        return (self.step_overhead_s + self.prefill_token_s * prefill_tokens + self.decode_token_s * decode_seqs
                + self.prefill_pair_s * prefill_context_tokens + self.decode_context_s_per_token
                * decode_context_tokens)

    # The makespan bound's terms (simulator.bound): no weight-read floor, the decode context priced once.
    @property
    def weight_read_s(self) -> float:
        return 0.0

    def linear_s(self, tokens: int | float, decode_tokens: int | float) -> float:
        """Seconds of ``tokens`` tokens' per-token work, ``decode_tokens`` of them decode tokens."""
        return self.prefill_token_s * (tokens - decode_tokens) + self.decode_token_s * decode_tokens

    def decode_context_s(self, context_tokens: int | float) -> float:
        """Seconds decode tokens spend reading ``context_tokens`` tokens of context."""
        return self.decode_context_s_per_token * context_tokens

    def max_kv_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9) -> int:
        """The engine's KV capacity in blocks of ``block_size`` tokens (its null block included), the same
        tokens as the measured engine's; ``gpu_memory_utilization`` is the measured engine's already."""
        usable = (self.engine.num_gpu_blocks - 1) * self.engine.block_size
        return usable // block_size + 1

    def kv_block_bytes(self, block_size: int) -> int:
        raise ValueError(f"the fitted preset {self.name} has no host tier, so no KV bytes to move")

    @property
    def host_link_bytes_per_s(self) -> float:
        raise ValueError(f"the fitted preset {self.name} has no host tier")


_COST_FIELDS = ("step_overhead_s", "prefill_token_s", "decode_token_s", "prefill_pair_s",
                "decode_context_s_per_token")


def write_preset_file(cost: FittedCost, path: str | Path, fit: dict[str, Any] | None = None) -> None:
    """Write ``cost`` as a TOML preset (``[engine]``, ``[cost]`` and, for the record, ``[fit]``)."""
    lines = ["# kvpilot calibrate: a step-cost model fitted to an engine's measured steps (simulator.fitted_cost)",
             f"name = {_toml(cost.name)}", "", "[engine]"]
    lines += [f"{k} = {_toml(v)}" for k, v in asdict(cost.engine).items()]
    lines += ["", "[cost]"] + [f"{k} = {_toml(getattr(cost, k))}" for k in _COST_FIELDS]
    if cost.round_trip_quantiles_s:
        lines += ["", "[client]", f"round_trip_quantiles_s = {_toml(list(cost.round_trip_quantiles_s))}"]
    if fit:
        lines += ["", "[fit]"] + [f"{k} = {_toml(v)}" for k, v in fit.items()]
    Path(path).write_text("\n".join(lines) + "\n")


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def read_preset_file(path: str | Path) -> FittedCost:
    """The :class:`FittedCost` in a TOML preset file; :class:`PresetFileError` names the file and field."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise PresetFileError(f"{path}: no such preset file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise PresetFileError(f"{path}: not a TOML preset file ({e})") from None

    def section(name: str) -> dict[str, Any]:
        value = doc.get(name)
        if not isinstance(value, dict):
            raise PresetFileError(f"{path}: missing section [{name}]")
        return value

    def number(sec: str, key: str, integer: bool) -> Any:
        value = section(sec).get(key)
        if value is None:
            raise PresetFileError(f"{path}: missing field {sec}.{key}")
        ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
        if isinstance(value, bool) or not ok or value < (1 if integer else 0):
            kind = "an integer >= 1" if integer else "a finite number >= 0"
            raise PresetFileError(f"{path}: field {sec}.{key} must be {kind}, got {value!r}")
        return value

    engine = EngineShape(**{f.name: number("engine", f.name, True) for f in fields(EngineShape)})
    trip = section("client").get("round_trip_quantiles_s") if "client" in doc else []  # [client]: optional
    if not (isinstance(trip, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                           and math.isfinite(v) and v >= 0 for v in trip)
            and all(a <= b for a, b in zip(trip, trip[1:]))):
        raise PresetFileError(f"{path}: field client.round_trip_quantiles_s must be a list of non-decreasing "
                              f"numbers >= 0, got {trip!r}")
    return FittedCost(name=str(doc.get("name", path.stem)), engine=engine,
                      round_trip_quantiles_s=tuple(float(v) for v in trip),
                      **{k: float(number("cost", k, False)) for k in _COST_FIELDS})


#: A step-cost model the simulator runs on: a roofline GPU preset or a fitted engine.
StepCost = CostModel | FittedCost


def load_cost(preset: str) -> StepCost:
    """The step-cost model a ``--preset`` names: a roofline preset (``H200-7B``) or a fitted preset file (a path
    ending in ``.toml``); ``ValueError`` names what is wrong."""
    if preset.endswith(".toml"):
        return read_preset_file(preset)
    return CostModel.preset(preset)


def engine_limits(cost: StepCost) -> tuple[int, int]:
    """``max_num_seqs`` and ``max_num_batched_tokens`` of the engine a preset models: a fitted engine's own, else
    vLLM's defaults on a GPU (256, 8192)."""
    if isinstance(cost, FittedCost):
        return cost.engine.max_num_seqs, cost.engine.max_num_batched_tokens
    return 256, 8192
