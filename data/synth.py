"""Seeded synthetic mixed-domain RL rollout workload, calibrated to public RL traces.

``generate(SynthConfig())`` builds a :data:`data.schemas.WORKLOAD` table: RL steps of
GRPO groups (one prompt, ``group_size`` sampled sessions) drawn from several
domains, plus reward-model scoring requests. The same config and seed always give
the same table.

Generative model
----------------
Every length or latency is a *split lognormal*: ``median * exp(sigma * z)`` for a
standard-normal score ``z >= 0`` and ``median * exp(sigma_low * z)`` for ``z < 0``,
clipped to ``[min, max]``. Two spreads fit the traces' left-heavy logs (p10, p50
and p90 all match); the percentiles a config implies are closed-form
(:meth:`SplitLogNormal.quantile`). Correlation enters only through the scores
(a Gaussian copula), so the marginals stay exactly as configured:

* Each prompt has a persistent difficulty ``d ~ N(0, 1)``. In each RL step it
  has ``d_s = sqrt(rho) d + sqrt(1 - rho) nu`` (``rho = step_persistence``,
  an assumption after RhymeRL: a prompt's lengths are stable across epochs).
* A turn's output score is ``sqrt(icc) d_s + sqrt(1 - icc) eps``: ``group_icc``
  is the share of its variance common to the group (measured as the
  intra-class correlation of normal scores in the traces). The traces show no
  extra correlation between turns of one session beyond the group's.
* The prompt's length score is ``prompt_corr * d + sqrt(1 - prompt_corr^2) xi``
  (longer problems run longer), fixed for the prompt across steps.
* Multi-turn domains draw the turn count from ``turn_probs`` through the score
  ``sqrt(turns_icc) t_s + sqrt(1 - turns_icc) zeta``, where ``t`` is a second
  persistent latent of the prompt (its tool-call tendency, carried across steps
  like ``d``): Search-R1 shows turn counts uncorrelated with completion lengths
  (-0.07), and a shared latent would skew the per-turn length distribution
  towards long sessions. Tool latency, appended tool tokens and verification
  latency are independent draws, except that a tool's ``session_icc`` (default
  0) shares part of the latency score across a session's calls.
* An output that reaches ``max_tokens`` is cut there and finishes ``length``
  (DeepCoder: ~15% of code samples hit the 16k cap); a non-last turn that does
  so ends its session. Other last turns finish ``stop``; non-last turns
  ``tool_call``, and turn k+1's prompt is turn k's prompt + output + tool tokens.

Steps and prompts: each step holds ``prompts_per_step`` prompts split across
domains by ``share`` (largest remainder). From step 1 on, ``repeat_fraction`` of
each domain's prompts are re-drawn from the prompts seen in earlier steps (an
epoch-like pool), the rest are new, so a prompt's lengths in earlier steps are a
real feature. Groups are shuffled within a step (a mixed batch); the rows of a
step are its rollout turns, then its scoring requests.

Scoring: for a ``score_fraction`` of a domain's groups, each trajectory gets a
reward-model request (kind ``scoring``, domain ``reward``, paradigm
``reward_model``, session ``<trajectory>-score``, ``scores_session_id`` the
trajectory; it keeps the trajectory's prompt, group and sample ids). Its prompt
is the trajectory's final context (last prompt + last output) plus
``template_tokens`` judge-template tokens, so it is prefill-heavy and hits the
trajectory's cached blocks; its output is a few tokens. Default: every agentic
trajectory (Search-R1 style answers judged by a reward model); math and code
keep their rule-based verifier and sandbox.

Block hashes: block j covering tokens ``[j*B, end)`` of a request hashes
``(owner, end)`` (``end`` fixes ``j``). The owner is the group's prompt (keyed by RL step too,
because a weight update invalidates cached KV, so the same prompt's blocks
differ between steps) while ``end`` is within the prompt, else the trajectory
while ``end`` is within its context, else the request's own session (a scoring
request's judge template). Keying by ``end`` keeps a partial block distinct from
the full block it grows into. Hashes are splitmix64 mixes, as signed int64.

Long-horizon agents: a domain may draw its turn count from a distribution
(``turns``, a split lognormal rounded to whole turns, through the same group-shared
score as ``turn_probs``) and cap its context (``max_context_tokens``: a session
ends at its last turn whose prompt + output fits, as an agent's context window
ends it). :func:`swe_domain` (a coding agent in a sandbox) uses both; its
calibration is in its docstring.

Presets (:data:`PRESETS`, ``kvpilot workload synth --preset``): ``default`` (this
module's defaults), ``short`` (the mix before the swe domain, unchanged bit for bit)
and ``agentic`` (swe 75% / agentic search 25%, 16 prompts per step).

Defaults: each step splits its prompts math 50 / code 25 / agentic 25 / swe 5
(relative shares), and every agentic trajectory is scored. The first three are
calibrated to ``shared/traces/polytrace``
(percentiles p10 / p50 / p90; "ICC" is the intra-class correlation of normal
scores within groups):

* math, DAPO (576 groups): output 172 / 465 / 1041; prompt 108 / 152 / 224;
  ICC 0.094 (a group's longest is ~2.3x its median); prompt length vs the
  group's mean score 0.24 (``prompt_corr`` 0.37 gives that after group noise);
  cap 20480 (DAPO recipe).
* code, DeepCoder (80 groups): output 2154 / 9900 / 16000 with 15% at the 16000
  cap (``sigma`` puts 15% above it); prompt 176 / 435 / 819; ICC 0.84; prompt
  length vs group 0.61 (``prompt_corr`` 0.65). Sandbox reward takes 37-125 s per
  batch of 64, ~1.2 s per trajectory.
* agentic, Search-R1 (768 groups): 1-5 turns with probabilities
  .072/.426/.349/.104/.049 (mean 2.63); completion per turn 28 / 56 / 143 (cap
  3000); per-turn ICC 0.115; turn-count ICC 0.175 (``turns_icc`` 0.2, as
  discrete counts dilute it); initial prompt 316 / 318 / 321; tool latency
  0.031 / 0.171 / 1.386 s (max 3.77 s); tokens appended per tool call (next
  prompt - prompt - completion, as :mod:`data.importers` derives them)
  465 / 524 / 918.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import pyarrow as pa

from data.errors import DataValidationError
from data.hashing import splitmix64
from data.io import with_source
from data.schemas import PARADIGMS, WORKLOAD

_NORMAL = NormalDist()


@dataclass(frozen=True)
class SplitLogNormal:
    """Lognormal with separate log-spreads below and above the median, clipped to [min, max]."""

    median: float
    sigma: float
    sigma_low: float | None = None  # spread below the median; None: same as sigma
    min: float = 0.0
    max: float = math.inf

    def __post_init__(self) -> None:
        if not self.median > 0:
            raise ValueError(f"median must be > 0, got {self.median}")
        if self.sigma < 0 or (self.sigma_low is not None and self.sigma_low < 0):
            raise ValueError("sigma and sigma_low must be >= 0")
        if not self.min <= self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")

    def from_scores(self, z: np.ndarray) -> np.ndarray:
        """Values at standard-normal scores ``z`` (monotone, so correlations carry over)."""
        low = self.sigma if self.sigma_low is None else self.sigma_low
        return np.clip(self.median * np.exp(np.where(z < 0, low, self.sigma) * z), self.min, self.max)

    def quantile(self, q: float) -> float:
        """The q-quantile this distribution implies."""
        return float(self.from_scores(np.array([_NORMAL.inv_cdf(q)]))[0])


@dataclass(frozen=True)
class ToolConfig:
    """The tool a multi-turn domain calls between turns."""

    name: str
    latency_s: SplitLogNormal
    tokens: SplitLogNormal  # tokens the tool's result appends to the context
    #: Share of a call's latency-score variance common to its session (a sandbox's speed persists over its
    #: calls). 0: independent draws, and the table is bit for bit what it was before this knob.
    session_icc: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.session_icc <= 1.0:
            raise ValueError(f"session_icc must be in [0, 1], got {self.session_icc}")


@dataclass(frozen=True)
class DomainConfig:
    """One rollout domain: its prompts, lengths, turns, tool and verifier."""

    paradigm: str
    share: float  # fraction of a step's prompts
    prompt_tokens: SplitLogNormal
    output_tokens: SplitLogNormal  # per turn, before the max_tokens cap
    max_tokens: int
    verify_latency_s: SplitLogNormal
    group_icc: float  # share of a turn's output-score variance common to its group
    prompt_corr: float = 0.0  # correlation of prompt length with difficulty
    turn_probs: tuple[float, ...] = (1.0,)  # P(a session has k+1 turns)
    #: Turns per session as a distribution (rounded; its ``max`` must be finite), for long-horizon agents whose
    #: counts run to ~100; replaces ``turn_probs``.
    turns: SplitLogNormal | None = None
    turns_icc: float = 0.0  # share of the turn-count score common to the group
    tool: ToolConfig | None = None
    score_fraction: float = 0.0  # fraction of groups whose trajectories get a reward-model request
    #: A session ends at its last turn whose context (prompt + output) fits: an agent's context window.
    max_context_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.paradigm not in PARADIGMS:
            raise ValueError(f"paradigm must be one of {PARADIGMS}, got {self.paradigm!r}")
        if self.share < 0 or self.max_tokens < 1:
            raise ValueError("share must be >= 0 and max_tokens >= 1")
        for name in ("group_icc", "turns_icc", "score_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not -1.0 <= self.prompt_corr <= 1.0:
            raise ValueError(f"prompt_corr must be in [-1, 1], got {self.prompt_corr}")
        if not self.turn_probs or min(self.turn_probs) < 0 or abs(sum(self.turn_probs) - 1.0) > 1e-6:
            raise ValueError(f"turn_probs must be non-negative and sum to 1, got {self.turn_probs}")
        if self.turns is not None:
            if self.turn_probs != (1.0,):
                raise ValueError("give turns or turn_probs, not both")
            if not 1 <= self.turns.max <= 10_000:
                raise ValueError(f"turns.max must be finite, in [1, 10000], got {self.turns.max}")
        if self.max_turns > 1 and self.tool is None:
            raise ValueError("a multi-turn domain (turns, or len(turn_probs) > 1) needs a tool")
        if self.max_context_tokens is not None and self.max_context_tokens < 1:
            raise ValueError(f"max_context_tokens must be >= 1, got {self.max_context_tokens}")

    @property
    def max_turns(self) -> int:
        """The most turns a session of this domain can have."""
        return len(self.turn_probs) if self.turns is None else int(round(self.turns.max))


@dataclass(frozen=True)
class ScoringConfig:
    """Reward-model scoring requests sent after a trajectory ends."""

    template_tokens: int = 64  # judge-template tokens after the trajectory's context
    output_tokens: SplitLogNormal = SplitLogNormal(median=4, sigma=0.5, min=1)
    max_tokens: int = 16
    verify_latency_s: SplitLogNormal = SplitLogNormal(median=0.001, sigma=0.0)  # parsing the score

    def __post_init__(self) -> None:
        if self.template_tokens < 1 or self.max_tokens < 1:
            raise ValueError("template_tokens and max_tokens must be >= 1")


def _default_domains() -> dict[str, DomainConfig]:
    """The calibrated mix: math / code / agentic search (the ``short`` preset) plus a small share of ``swe``."""
    return {**_short_domains(), "swe": swe_domain(share=0.05)}


def _short_domains() -> dict[str, DomainConfig]:
    """The calibrated math / code / agentic mix of short-context steps (see the module docstring)."""
    return {
        "math": DomainConfig(
            paradigm="math_verifier",
            share=0.5,
            prompt_tokens=SplitLogNormal(median=152, sigma=0.30, sigma_low=0.27, min=32, max=2048),
            output_tokens=SplitLogNormal(median=465, sigma=0.63, sigma_low=0.78, min=1),
            max_tokens=20480,
            verify_latency_s=SplitLogNormal(median=0.05, sigma=0.5),
            group_icc=0.10,
            prompt_corr=0.37,
        ),
        "code": DomainConfig(
            paradigm="unit_test_sandbox",
            share=0.25,
            prompt_tokens=SplitLogNormal(median=435, sigma=0.49, sigma_low=0.71, min=32, max=4096),
            output_tokens=SplitLogNormal(median=9900, sigma=0.46, sigma_low=1.19, min=1),
            max_tokens=16000,
            verify_latency_s=SplitLogNormal(median=1.2, sigma=0.5),
            group_icc=0.84,
            prompt_corr=0.65,
        ),
        "agentic": DomainConfig(
            paradigm="search_tool",
            share=0.25,
            prompt_tokens=SplitLogNormal(median=318, sigma=0.007, sigma_low=0.005, min=32, max=4096),
            output_tokens=SplitLogNormal(median=56, sigma=0.73, sigma_low=0.54, min=1),
            max_tokens=3000,
            verify_latency_s=SplitLogNormal(median=0.01, sigma=0.5),
            group_icc=0.12,
            turn_probs=(0.072, 0.426, 0.349, 0.104, 0.049),
            turns_icc=0.2,
            tool=ToolConfig(
                name="search",
                latency_s=SplitLogNormal(median=0.171, sigma=1.63, sigma_low=1.33, min=0.01, max=3.8),
                tokens=SplitLogNormal(median=524, sigma=0.44, sigma_low=0.09, min=16, max=10000),
            ),
            score_fraction=1.0,
        ),
    }


def swe_domain(share: float) -> DomainConfig:
    """A coding agent in a sandbox (read files, run tests, edit): long sessions whose context grows to 32k-64k.

    Calibration (public figures, as collected in the project's field notes): turns 29 / 56 / 85 at p50 / p90 / p99,
    at least 5 and at most 99 in recorded coding-agent RL sessions (NVIDIA-NeMo/RL issue 3663; SWE RL caps trajectories
    at 100 steps, NeMo Gym / Nemotron SWE-RL), and turn counts shared within a GRPO group (the same task);
    context cap 64k (DeepSWE trains at 64k; Nemotron SWE-RL at 131k: raise ``max_context_tokens``); a few
    hundred output tokens per turn (a thought and one tool call); tool latency of 0.26-3.2 s per action
    depending on the sandbox (NeMo Gym: 13-160 s per 50-action trajectory), heavy-tailed to tens of seconds
    (a test run), while a coding-agent serving trace saw 86% of next turns within 1 s and 95% within 10 s;
    observations (file views, test output) from about 100 to several thousand tokens; verification runs the
    task's tests once at the end (tens of seconds).
    """
    return DomainConfig(
        paradigm="unit_test_sandbox",
        share=share,
        prompt_tokens=SplitLogNormal(median=2500, sigma=0.35, sigma_low=0.3, min=512, max=8192),
        output_tokens=SplitLogNormal(median=200, sigma=0.6, sigma_low=0.5, min=8),
        max_tokens=4096,
        verify_latency_s=SplitLogNormal(median=15.0, sigma=0.6, min=1.0, max=300.0),
        group_icc=0.3,
        prompt_corr=0.2,
        turns=SplitLogNormal(median=29, sigma=0.51, sigma_low=0.6, min=5, max=99),
        turns_icc=0.4,
        tool=ToolConfig(
            name="sandbox",
            latency_s=SplitLogNormal(median=0.8, sigma=1.25, sigma_low=0.8, min=0.05, max=60.0),
            tokens=SplitLogNormal(median=350, sigma=0.85, sigma_low=0.6, min=64, max=8000),
        ),
        max_context_tokens=65536,
    )


@dataclass(frozen=True)
class SynthConfig:
    """Everything ``generate`` needs; the defaults are the calibrated mixed workload."""

    seed: int = 0
    steps: int = 2
    prompts_per_step: int = 64
    group_size: int = 8
    block_size: int = 16
    repeat_fraction: float = 0.5  # share of a step's prompts re-drawn from earlier steps
    step_persistence: float = 0.9  # correlation of a prompt's latents between two steps
    domains: dict[str, DomainConfig] = field(default_factory=_default_domains)
    scoring: ScoringConfig = ScoringConfig()

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**63:  # (the block hashes mix it in as a 64-bit integer)
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("steps", "prompts_per_step", "group_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("repeat_fraction", "step_persistence"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.domains or sum(d.share for d in self.domains.values()) <= 0:
            raise ValueError("domains must hold at least one domain with share > 0")

    @classmethod
    def preset(cls, name: str) -> SynthConfig:
        """A named workload: one of :data:`PRESETS` (``default``, ``short``, ``agentic``)."""
        try:
            return PRESETS[name]()
        except KeyError:
            raise ValueError(f"unknown workload preset {name!r}; known: {', '.join(PRESETS)}") from None

    @classmethod
    def from_dict(cls, data: Any) -> SynthConfig:
        """The config that ``dataclasses.asdict`` (a synthesized workload's recorded source) gave ``data`` from; a
        ValueError names the key that is wrong."""
        try:
            return _from_plain(cls, data, "")
        except _ConfigError as err:
            raise ValueError(str(err)) from None

    @classmethod
    def from_file(cls, path: str | Path, base: SynthConfig | None = None) -> SynthConfig:
        """Read a TOML config over ``base`` (default: the defaults); keys it leaves out keep their values there
        (domains merge by name), and a table that picks one of a pair of :data:`ALTERNATIVES` (a domain's
        ``turns`` or ``turn_probs``) replaces the base's pick."""
        path = Path(path)
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as err:
            raise DataValidationError(f"not valid TOML: {err}", file=str(path)) from None
        try:
            return _build(cls, data, base if base is not None else cls(), "")
        except _ConfigError as err:
            raise DataValidationError(str(err), file=str(path)) from None


def _agentic() -> SynthConfig:
    """Long-horizon agents: swe sessions (3/4 of the prompts) beside the search agent, 16 prompts x 8 per step."""
    short = _short_domains()
    return SynthConfig(prompts_per_step=16, domains={"swe": swe_domain(share=0.75),
                                                     "agentic": dataclasses.replace(short["agentic"], share=0.25)})


#: Named workloads (``kvpilot workload synth --preset NAME``): ``default`` (:class:`SynthConfig`'s defaults,
#: :file:`default_workload.toml`), ``short`` (the mix before the swe domain, so earlier results reproduce:
#: short-context steps where vLLM default runs close to the bound) and ``agentic`` (long-horizon agents, where
#: KV competition decides throughput).
PRESETS: dict[str, Any] = {
    "default": SynthConfig,
    "short": lambda: SynthConfig(domains=_short_domains()),
    "agentic": _agentic,
}


# ---------------------------------------------------------------- TOML to dataclasses


class _ConfigError(Exception):
    """A bad key or value, named by its dotted path."""


#: Fields that are alternative ways to give one thing, per config class: a table that names one of them replaces
#: the base's choice (the other goes back to its default), so a config overrides a preset field by field.
ALTERNATIVES: dict[type, tuple[tuple[str, str], ...]] = {DomainConfig: (("turns", "turn_probs"),)}


def _field_default(cls: type, name: str) -> Any:
    f = next(f for f in fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _build(cls: type, data: Any, base: Any, where: str) -> Any:
    """An instance of dataclass ``cls`` from a TOML table, over ``base`` (None: field defaults)."""
    if not isinstance(data, dict):
        raise _ConfigError(f"key {where.rstrip('.')!r}: expected a table, got {data!r}")
    names = {f.name for f in fields(cls)}
    for key in data:
        if key not in names:
            raise _ConfigError(f"unknown key {where + key!r} (known: {', '.join(sorted(names))})")
    hints = typing.get_type_hints(cls)
    values = {k: _coerce(v, hints[k], getattr(base, k, None), where + k) for k, v in data.items()}
    if base is not None:
        for a, b in ALTERNATIVES.get(cls, ()):
            for given, other in ((a, b), (b, a)):
                if given in data and other not in data:
                    values[other] = _field_default(cls, other)
    if base is None:
        missing = [
            f.name
            for f in fields(cls)
            if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise _ConfigError(f"table {where.rstrip('.')!r} is missing key(s): {', '.join(missing)}")
    try:
        return dataclasses.replace(base, **values) if base is not None else cls(**values)
    except ValueError as err:
        raise _ConfigError(f"key {where.rstrip('.')!r}: {err}" if where else str(err)) from None


def _from_plain(hint: Any, value: Any, where: str) -> Any:
    """``value`` (plain data, as ``dataclasses.asdict`` gives it) as the annotated type ``hint``: every field
    given, null where the field may be None."""
    if isinstance(hint, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _ConfigError(f"key {where or 'config'!r}: expected a table, got {value!r}")
        hints, names = typing.get_type_hints(hint), [f.name for f in fields(hint)]
        if set(value) != set(names):
            odd = sorted(set(value) ^ set(names))
            raise _ConfigError(f"table {where or 'config'!r}: keys differ from {hint.__name__}'s: {', '.join(odd)}")
        try:
            return hint(**{k: _from_plain(hints[k], value[k], f"{where}.{k}".lstrip(".")) for k in names})
        except ValueError as err:
            raise _ConfigError(f"table {where or 'config'!r}: {err}") from None
    origin = typing.get_origin(hint)
    if origin is dict and isinstance(value, dict):
        return {k: _from_plain(typing.get_args(hint)[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin is tuple and isinstance(value, list):
        return tuple(_from_plain(typing.get_args(hint)[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    return _coerce(value, hint, None, where)


def _coerce(value: Any, hint: Any, base: Any, where: str) -> Any:
    """``value`` converted to the annotated type ``hint``, or a _ConfigError naming ``where``."""
    if isinstance(hint, types.UnionType):  # `X | None`: TOML has no null, so it is an X
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, base, where + ".")
    if origin is dict:
        if not isinstance(value, dict):
            raise _ConfigError(f"key {where!r}: expected a table, got {value!r}")
        item_hint = typing.get_args(hint)[1]
        merged = dict(base or {})
        for k, v in value.items():
            merged[k] = _coerce(v, item_hint, merged.get(k), f"{where}.{k}")
        return merged
    if origin is tuple:
        if not isinstance(value, list):
            raise _ConfigError(f"key {where!r}: expected an array, got {value!r}")
        return tuple(_coerce(v, typing.get_args(hint)[0], None, f"{where}[{i}]") for i, v in enumerate(value))
    ok, what = {
        float: (isinstance(value, (int, float)) and not isinstance(value, bool), "a number"),
        int: (isinstance(value, int) and not isinstance(value, bool), "an integer"),
        str: (isinstance(value, str), "a string"),
    }[hint]
    if not ok:
        raise _ConfigError(f"key {where!r}: expected {what}, got {value!r}")
    return hint(value)


# ---------------------------------------------------------------- generation

_ROLLOUT, _SCORING = 0, 1
_FINISH = ["stop", "length", "tool_call"]
_STOP, _LENGTH, _TOOL_CALL = 0, 1, 2


def generate(cfg: SynthConfig) -> pa.Table:
    """The workload table (schema :data:`data.schemas.WORKLOAD`) that ``cfg`` describes."""
    rng = np.random.default_rng(cfg.seed)
    pools = {name: _Pool() for name in cfg.domains}
    counts = _split(cfg.prompts_per_step, [d.share for d in cfg.domains.values()])
    parts: list[dict[str, np.ndarray]] = []
    n_groups = 0
    for step in range(cfg.steps):
        for code, ((name, dom), n_prompts) in enumerate(zip(cfg.domains.items(), counts)):
            if n_prompts == 0:
                continue
            idx = pools[name].draw(rng, dom, n_prompts, 0.0 if step == 0 else cfg.repeat_fraction)
            rows = _rollouts(rng, cfg, dom, pools[name], idx, first_group=n_groups)
            rows.update(step=np.full(len(rows["turn"]), step), domain_code=np.full(len(rows["turn"]), code))
            n_groups += n_prompts
            parts.append(rows)
            if dom.score_fraction > 0:
                parts.append(_scoring(rng, cfg.scoring, dom, rows))
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    shuffle = rng.permutation(n_groups)  # groups of a step run as one mixed, shuffled batch
    order = np.lexsort((cols["turn"], cols["sample"], shuffle[cols["group_uid"]], cols["kind"], cols["step"]))
    table = _to_table(cfg, {k: v[order] for k, v in cols.items()})
    return with_source(table, {"generator": "kvpilot workload synth", "config": dataclasses.asdict(cfg)})


class _Pool:
    """One domain's prompts seen so far: persistent latents (difficulty, turn tendency) and length."""

    def __init__(self) -> None:
        self.latent = np.empty((0, 2))
        self.prompt_tokens = np.empty(0, dtype=np.int64)

    def draw(self, rng: np.random.Generator, dom: DomainConfig, n: int, repeat: float) -> np.ndarray:
        """Indices of this step's n prompts: round(repeat * n) seen before, the rest new."""
        seen = len(self.latent)
        n_old = min(round(repeat * n), seen)
        old = rng.choice(seen, size=n_old, replace=False)
        latent = rng.standard_normal((n - n_old, 2))
        score = dom.prompt_corr * latent[:, 0] + math.sqrt(1 - dom.prompt_corr**2) * rng.standard_normal(n - n_old)
        new = np.arange(seen, seen + n - n_old)
        self.latent = np.concatenate([self.latent, latent])
        self.prompt_tokens = np.concatenate([self.prompt_tokens, _tokens(dom.prompt_tokens.from_scores(score))])
        return np.concatenate([old, new])


def _split(total: int, shares: list[float]) -> list[int]:
    """``total`` split in proportion to ``shares`` by largest remainder."""
    exact = np.asarray(shares, float) / sum(shares) * total
    counts = np.floor(exact).astype(int)
    counts[np.argsort(-(exact - counts), kind="stable")[: total - counts.sum()]] += 1
    return counts.tolist()


def _tokens(x: np.ndarray) -> np.ndarray:
    """Token counts: rounded, at least 1."""
    return np.maximum(np.rint(x), 1).astype(np.int64)


def _scores(rng: np.random.Generator, shared: np.ndarray, weight: float, shape: tuple[int, ...]) -> np.ndarray:
    """Standard-normal scores taking a ``weight`` share of their variance from ``shared``."""
    return math.sqrt(weight) * shared + math.sqrt(1 - weight) * rng.standard_normal(shape)


def _turn_counts(rng: np.random.Generator, dom: DomainConfig, tendency: np.ndarray) -> np.ndarray:
    """Turns per session from ``turns`` (or ``turn_probs``), through a score sharing ``turns_icc`` with the group."""
    if dom.turns is not None:
        counts = np.rint(dom.turns.from_scores(_scores(rng, tendency, dom.turns_icc, tendency.shape)))
        return np.clip(counts, 1, dom.max_turns).astype(np.int64)
    if len(dom.turn_probs) == 1:
        return np.ones(len(tendency), dtype=np.int64)
    cum = np.clip(np.cumsum(dom.turn_probs)[:-1], 1e-12, 1 - 1e-12)
    cuts = np.array([_NORMAL.inv_cdf(c) for c in cum])
    return np.searchsorted(cuts, _scores(rng, tendency, dom.turns_icc, tendency.shape)) + 1


def _rollouts(
    rng: np.random.Generator, cfg: SynthConfig, dom: DomainConfig, pool: _Pool, idx: np.ndarray, first_group: int
) -> dict[str, np.ndarray]:
    """The rollout turns of one domain's groups in one step, as columns in session and turn order."""
    n_sessions, max_turns = len(idx) * cfg.group_size, dom.max_turns
    difficulty, tendency = _scores(rng, pool.latent[idx], cfg.step_persistence, (len(idx), 2)).T
    group = np.repeat(np.arange(len(idx)), cfg.group_size)
    n_turns = _turn_counts(rng, dom, tendency[group])
    scores = _scores(rng, difficulty[group][:, None], dom.group_icc, (n_sessions, max_turns))
    out = np.minimum(_tokens(dom.output_tokens.from_scores(scores)), dom.max_tokens)
    turn = np.arange(max_turns)
    capped = (out >= dom.max_tokens) & (turn < n_turns[:, None])
    n_turns = np.where(capped.any(axis=1), capped.argmax(axis=1) + 1, n_turns)  # a capped turn ends its session
    if dom.tool is not None:
        tool_tokens = _tokens(dom.tool.tokens.from_scores(rng.standard_normal((n_sessions, max_turns))))
        z = rng.standard_normal((n_sessions, max_turns))
        if dom.tool.session_icc > 0:  # an extra draw only then: at 0 the table is bit for bit as before
            icc = dom.tool.session_icc
            z = math.sqrt(icc) * rng.standard_normal((n_sessions, 1)) + math.sqrt(1 - icc) * z
        tool_latency = dom.tool.latency_s.from_scores(z)
    else:
        tool_tokens, tool_latency = np.zeros((n_sessions, max_turns), np.int64), np.zeros((n_sessions, max_turns))
    verify = dom.verify_latency_s.from_scores(rng.standard_normal(n_sessions))
    first_prompt = pool.prompt_tokens[idx][group]
    grown = np.cumsum(out + tool_tokens, axis=1) - (out + tool_tokens)
    prompt = first_prompt[:, None] + grown
    if dom.max_context_tokens is not None:  # the session ends before the turn whose context would not fit
        over = (prompt + out > dom.max_context_tokens) & (turn > 0) & (turn < n_turns[:, None])
        n_turns = np.where(over.any(axis=1), over.argmax(axis=1), n_turns)
    s, k = np.nonzero(turn < n_turns[:, None])
    last = k == n_turns[s] - 1
    finish = np.where(~last, _TOOL_CALL, np.where(out[s, k] >= dom.max_tokens, _LENGTH, _STOP))
    n = len(s)
    return {
        "kind": np.full(n, _ROLLOUT),
        "group_uid": first_group + group[s],
        "prompt_index": idx[group[s]],
        "sample": s % cfg.group_size,
        "turn": k,
        "prompt_tokens": prompt[s, k],
        "output_tokens": out[s, k],
        "max_tokens": np.full(n, dom.max_tokens),
        "finish": finish,
        "has_tool": ~last,
        "tool_latency_s": tool_latency[s, k],
        "tool_tokens": tool_tokens[s, k],
        "verify_latency_s": np.where(last, verify[s], np.nan),
        "first_prompt": first_prompt[s],
        "shared_end": prompt[s, k],  # tokens of the trajectory's own context this request holds
    }


def _scoring(
    rng: np.random.Generator, sc: ScoringConfig, dom: DomainConfig, rows: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Reward-model requests for the trajectories of a ``score_fraction`` of the groups in ``rows``."""
    groups = np.unique(rows["group_uid"])
    scored = groups[rng.random(len(groups)) < dom.score_fraction]
    pick = (rows["finish"] != _TOOL_CALL) & np.isin(rows["group_uid"], scored)
    n = int(pick.sum())
    context = rows["prompt_tokens"][pick] + rows["output_tokens"][pick]
    out = np.minimum(_tokens(sc.output_tokens.from_scores(rng.standard_normal(n))), sc.max_tokens)
    return {
        **{k: rows[k][pick] for k in ("group_uid", "prompt_index", "sample", "first_prompt", "step", "domain_code")},
        "kind": np.full(n, _SCORING),
        "turn": np.zeros(n, np.int64),
        "prompt_tokens": context + sc.template_tokens,
        "output_tokens": out,
        "max_tokens": np.full(n, sc.max_tokens),
        "finish": np.where(out >= sc.max_tokens, _LENGTH, _STOP),
        "has_tool": np.zeros(n, bool),
        "tool_latency_s": np.zeros(n),
        "tool_tokens": np.zeros(n, np.int64),
        "verify_latency_s": sc.verify_latency_s.from_scores(rng.standard_normal(n)),
        "shared_end": context,
    }


def _to_table(cfg: SynthConfig, c: dict[str, np.ndarray]) -> pa.Table:
    """The WORKLOAD table of the generated columns: ids, nulls and block hashes."""
    names = list(cfg.domains)
    scoring = c["kind"] == _SCORING
    prompt_id = [f"{names[d]}-{i:05d}" for d, i in zip(c["domain_code"].tolist(), c["prompt_index"].tolist())]
    group_id = [f"s{s}-{p}" for s, p in zip(c["step"].tolist(), prompt_id)]
    trajectory = [f"{g}-{i}" for g, i in zip(group_id, c["sample"].tolist())]
    session_id = [f"{t}-score" if sc else t for t, sc in zip(trajectory, scoring.tolist())]
    tools = [d.tool for d in cfg.domains.values()]
    tool_name = [tools[d].name if has else None for d, has in zip(c["domain_code"].tolist(), c["has_tool"].tolist())]
    # scoring rows take the extra label at index len(names)
    label = np.where(scoring, len(names), c["domain_code"])
    paradigms = [d.paradigm for d in cfg.domains.values()]
    no_tool = ~c["has_tool"]
    n = len(scoring)
    columns = {
        "request_id": pa.array([f"{s}-t{k}" for s, k in zip(session_id, c["turn"].tolist())], pa.string()),
        "kind": _labels(["rollout", "scoring"], c["kind"]),
        "step": pa.array(c["step"], pa.int32()),
        "prompt_id": pa.array(prompt_id, pa.string()),
        "group_id": pa.array(group_id, pa.string()),
        "group_size": pa.array(np.full(n, cfg.group_size), pa.int32()),
        "sample_index": pa.array(c["sample"], pa.int32()),
        "session_id": pa.array(session_id, pa.string()),
        "turn": pa.array(c["turn"], pa.int32()),
        "domain": _labels([*names, "reward"], label),
        "paradigm": _labels([*paradigms, "reward_model"], label),
        "prompt_tokens": pa.array(c["prompt_tokens"], pa.int32()),
        "output_tokens": pa.array(c["output_tokens"], pa.int32()),
        "max_tokens": pa.array(c["max_tokens"], pa.int32()),
        "finish_reason": _labels(_FINISH, c["finish"]),
        "block_size": pa.array(np.full(n, cfg.block_size), pa.int32()),
        "block_hashes": _block_hashes(cfg, c),
        "tool": pa.array(tool_name, pa.string()),
        "tool_latency_s": pa.array(c["tool_latency_s"], pa.float64(), mask=no_tool),
        "tool_tokens": pa.array(c["tool_tokens"], pa.int32(), mask=no_tool),
        "verify_latency_s": pa.array(c["verify_latency_s"], pa.float64(), mask=np.isnan(c["verify_latency_s"])),
        "scores_session_id": pa.array([t if sc else None for t, sc in zip(trajectory, scoring.tolist())], pa.string()),
        "arrival_s": pa.nulls(n, pa.float64()),
    }
    return pa.Table.from_arrays(list(columns.values()), schema=WORKLOAD.schema)


def _labels(labels: list[str], codes: np.ndarray) -> pa.Array:
    """A string column from integer codes into ``labels``."""
    return pa.array(labels, pa.string()).take(pa.array(codes))


def _hash(*keys: np.ndarray | int) -> np.ndarray:
    """A 64-bit hash of equal-length integer key columns (scalars broadcast)."""
    n = max(np.size(k) for k in keys)
    h = np.full(n, 0x9E3779B97F4A7C15, dtype=np.uint64)
    for key in keys:
        h = splitmix64(h ^ np.broadcast_to(np.asarray(key).astype(np.uint64), (n,)))
    return h


def _block_hashes(cfg: SynthConfig, c: dict[str, np.ndarray]) -> pa.ListArray:
    """Each request's chain: block j over tokens [j*B, end) hashes (owner, end); see the module docstring."""
    size = cfg.block_size
    n_blocks = -(-c["prompt_tokens"] // size)
    offsets = np.concatenate([[0], np.cumsum(n_blocks)])
    row = np.repeat(np.arange(len(n_blocks)), n_blocks)
    j = np.arange(offsets[-1]) - offsets[row]
    end = np.minimum((j + 1) * size, c["prompt_tokens"][row])
    trajectory = c["group_uid"] * cfg.group_size + c["sample"]
    prompt_key = _hash(cfg.seed, 0, c["step"], c["domain_code"], c["prompt_index"])
    trajectory_key = _hash(cfg.seed, 1, trajectory)
    own_key = np.where(c["kind"] == _SCORING, _hash(cfg.seed, 2, trajectory), trajectory_key)
    owner = np.where(
        end <= c["first_prompt"][row],
        prompt_key[row],
        np.where(end <= c["shared_end"][row], trajectory_key[row], own_key[row]),
    )
    values = _hash(owner, end).view(np.int64)  # end alone fixes j: j = (end - 1) // size
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.int64()))
