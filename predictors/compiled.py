"""A compiled form of LightGBM boosters: the same trees as flat arrays, walked by a numba-jitted loop.

``Booster.predict`` costs ~70 µs of Python overhead per call plus its per-row
work; inside a scheduler step that overhead dominates. :class:`CompiledForest`
reads the boosters' ``dump_model()`` trees (numerical splits with LightGBM's
missing-value rules, categorical splits as 64-bit masks) and scores several
boosters over a batch in one jitted call. Raw scores only (the sum of leaf
values); a binary booster's probability is its sigmoid. It gives the same
predictions as ``Booster.predict`` (the tests and the benchmark check it); a
booster it cannot represent (a category code >= 64, linear trees, multiclass)
raises ``NotCompilable`` and callers keep LightGBM's own predict.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

try:  # numba ships with vLLM; without it the compiled form is unavailable
    import numba
except ImportError:  # pragma: no cover
    numba = None

_ZERO = 1e-35
_MISSING = {"None": 0, "Zero": 1, "NaN": 2}


class NotCompilable(ValueError):
    pass


def _flatten(booster, offset: int, nodes: dict[str, list]) -> list[int]:
    d = booster.dump_model()
    if d.get("num_tree_per_iteration", 1) != 1 or d.get("average_output"):
        raise NotCompilable("multiclass or averaged (random forest) boosters are not compiled")
    roots = []

    def add(node) -> int:
        i = len(nodes["feat"])
        for k in nodes:
            nodes[k].append(0)
        if "leaf_value" in node or "split_feature" not in node:
            if "leaf_coeff" in node:
                raise NotCompilable("linear trees are not compiled")
            nodes["feat"][i] = -1
            nodes["value"][i] = float(node.get("leaf_value", 0.0))
            return i
        nodes["feat"][i] = int(node["split_feature"])
        nodes["dleft"][i] = 1 if node.get("default_left") else 0
        nodes["mtype"][i] = _MISSING[node.get("missing_type", "None")]
        if node["decision_type"] == "==":
            mask = 0
            for c in str(node["threshold"]).split("||"):
                c = int(c)
                if not 0 <= c < 64:
                    raise NotCompilable(f"category code {c} does not fit a 64-bit mask")
                mask |= 1 << c
            nodes["iscat"][i] = 1
            nodes["catmask"][i] = np.uint64(mask)
        elif node["decision_type"] == "<=":
            nodes["thr"][i] = float(node["threshold"])
        else:
            raise NotCompilable(f"decision type {node['decision_type']!r}")
        nodes["left"][i] = add(node["left_child"])
        nodes["right"][i] = add(node["right_child"])
        return i

    for t in d["tree_info"]:
        roots.append(add(t["tree_structure"]))
    return roots


if numba is not None:

    @numba.njit(cache=False, nogil=True)
    def _walk(X, roots, model_of_tree, feat, thr, dleft, mtype, iscat, catmask, left, right, value, out):
        n = X.shape[0]
        out[:, :] = 0.0
        for t in range(roots.shape[0]):
            root = roots[t]
            m = model_of_tree[t]
            for i in range(n):
                node = root
                while feat[node] >= 0:
                    f = X[i, feat[node]]
                    if iscat[node]:
                        go_left = False
                        if f == f:
                            k = int(f)
                            if k >= 0 and k < 64 and (catmask[node] >> np.uint64(k)) & np.uint64(1):
                                go_left = True
                    else:
                        mt = mtype[node]
                        if f != f:
                            if mt == 2 or mt == 1:
                                go_left = dleft[node] == 1
                            else:
                                go_left = 0.0 <= thr[node]
                        elif mt == 1 and abs(f) <= 1e-35:
                            go_left = dleft[node] == 1
                        else:
                            go_left = f <= thr[node]
                    node = left[node] if go_left else right[node]
                out[i, m] += value[node]


class CompiledForest:
    """Several boosters compiled together; :meth:`predict_raw` returns an (n, n_boosters) array of raw scores."""

    def __init__(self, boosters: Sequence) -> None:
        if numba is None:
            raise NotCompilable("numba is not installed")
        nodes: dict[str, list] = {k: [] for k in ("feat", "thr", "dleft", "mtype", "iscat", "catmask", "left",
                                                  "right", "value")}
        roots, owner = [], []
        for m, b in enumerate(boosters):
            r = _flatten(b, 0, nodes)
            roots += r
            owner += [m] * len(r)
        self.n_models = len(boosters)
        self.n_features = boosters[0].num_feature()
        self.roots = np.asarray(roots, np.int64)
        self.owner = np.asarray(owner, np.int64)
        self.feat = np.asarray(nodes["feat"], np.int64)
        self.thr = np.asarray(nodes["thr"], np.float64)
        self.dleft = np.asarray(nodes["dleft"], np.int8)
        self.mtype = np.asarray(nodes["mtype"], np.int8)
        self.iscat = np.asarray(nodes["iscat"], np.int8)
        self.catmask = np.asarray(nodes["catmask"], np.uint64)
        self.left = np.asarray(nodes["left"], np.int64)
        self.right = np.asarray(nodes["right"], np.int64)
        self.value = np.asarray(nodes["value"], np.float64)
        self.predict_raw(np.full((1, self.n_features), np.nan))  # compile now, not inside a scheduler step

    def predict_raw(self, X: np.ndarray) -> np.ndarray:
        X = np.ascontiguousarray(X, dtype=np.float64)
        out = np.empty((X.shape[0], self.n_models))
        _walk(X, self.roots, self.owner, self.feat, self.thr, self.dleft, self.mtype, self.iscat, self.catmask,
              self.left, self.right, self.value, out)
        return out


class CompiledScoring:
    """Switches a model between LightGBM's ``Booster.predict`` and a :class:`CompiledForest` of its boosters.

    The model sets ``boosters`` (a dict) and names the ones scored together in ``SCORED_BOOSTERS``.
    """

    SCORED_BOOSTERS: tuple[str, ...] = ()
    boosters: dict
    _compiled: "CompiledForest | None" = None

    @property
    def engine(self) -> str:
        """"compiled" when :meth:`compile` succeeded, else "lightgbm" (``Booster.predict``)."""
        return "compiled" if self._compiled is not None else "lightgbm"

    def compile(self) -> bool:
        """Score through :class:`CompiledForest` (same trees, no per-call overhead)."""
        try:
            self._compiled = CompiledForest([self.boosters[k] for k in self.SCORED_BOOSTERS])
        except NotCompilable:
            self._compiled = None
        return self._compiled is not None

    def use_lightgbm(self) -> None:
        """Score through LightGBM's own ``Booster.predict``."""
        self._compiled = None
