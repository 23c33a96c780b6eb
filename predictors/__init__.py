"""kvpilot's predictors: response length (LightGBM quantiles) and prefix reuse (LightGBM), with features.

* :mod:`predictors.features`: decision-time features from telemetry (and the workload);
* :mod:`predictors.length`: :class:`~predictors.length.LengthModel` (p50 / p90 output tokens), also a
  :class:`policy.predictors.LengthPredictor`; baselines;
* :mod:`predictors.reuse`: :class:`~predictors.reuse.ReuseModel` (P(reuse within H), time to reuse),
  also a :class:`policy.predictors.ReusePredictor`; baselines;
* :mod:`predictors.compiled`: the same trees compiled (numba) for batched scoring in a scheduler step;
* :mod:`predictors.model_io`: save / load with a checked feature schema;
* :mod:`predictors.metrics`, :mod:`predictors.pipeline`, :mod:`predictors.logs`: reports, training, loading logs.

Nothing here imports vLLM.
"""
