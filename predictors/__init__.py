"""kvpilot's predictors: response length (LightGBM quantiles) and prefix reuse (LightGBM), with features.

* :mod:`predictors.features`: decision-time features from telemetry (and the workload);
* :mod:`predictors.length`: :class:`~predictors.length.LengthModel` (p50 / p90 output tokens), also a
  :class:`policy.predictors.LengthPredictor`; baselines;
* :mod:`predictors.reuse`: :class:`~predictors.reuse.ReuseModel` (P(reuse within H), time to reuse),
  also a :class:`policy.predictors.ReusePredictor`; baselines;
* :mod:`predictors.session_features`, :mod:`predictors.session`: at a turn's finish, the tool latency,
  P(session continues), turns left and time to next use (:class:`~predictors.session.SessionModel`,
  LightGBM boosted from its baselines; ``predict_rows`` is the vectorised online API);
* :mod:`predictors.compiled`: the same trees compiled (numba) for batched scoring in a scheduler step;
* :mod:`predictors.model_io`: save / load with a checked feature schema;
* :mod:`predictors.metrics`, :mod:`predictors.pipeline`, :mod:`predictors.logs`: reports, training, loading logs.

Nothing here imports vLLM.
"""
