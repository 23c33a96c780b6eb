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


#: One tree node, 16 bytes, in pre-order: a node's left child is the next node, so a walk that goes left reads on
#: in the same cache line. Inside a scheduler step the trees are cold in the CPU caches (vLLM's own work evicts
#: them between decisions) and the walk is bound by the lines it reads: with one array per field a node visit read
#: six lines (the walk was 3-8x its warm time), with a 32-byte record one. ``thr``: the split threshold, or a
#: leaf's value; ``right``: the right child; ``feat``: the split feature, -1 for a leaf; ``flags``: bit 0
#: categorical (its categories in :attr:`CompiledForest.catmask`, read only for such nodes), bit 1 default left,
#: bits 2-3 LightGBM's missing type.
NODE = np.dtype([("thr", np.float64), ("right", np.int32), ("feat", np.int16), ("flags", np.int16)], align=True)
_CAT, _DLEFT, _MSHIFT = 1, 2, 2


def _flatten(booster, nodes: list[tuple]) -> list[int]:
    """Append ``booster``'s nodes to ``nodes`` (tuples in :data:`NODE`'s order); the roots of its trees."""
    d = booster.dump_model()
    if d.get("num_tree_per_iteration", 1) != 1 or d.get("average_output"):
        raise NotCompilable("multiclass or averaged (random forest) boosters are not compiled")

    def add(node) -> int:
        i = len(nodes)
        nodes.append(None)
        if "leaf_value" in node or "split_feature" not in node:
            if "leaf_coeff" in node:
                raise NotCompilable("linear trees are not compiled")
            nodes[i] = (float(node.get("leaf_value", 0.0)), 0, 0, 0, -1, 0)
            return i
        flags = (_DLEFT if node.get("default_left") else 0) | (_MISSING[node.get("missing_type", "None")] << _MSHIFT)
        thr, mask = 0.0, 0
        if node["decision_type"] == "==":
            for c in str(node["threshold"]).split("||"):
                c = int(c)
                if not 0 <= c < 64:
                    raise NotCompilable(f"category code {c} does not fit a 64-bit mask")
                mask |= 1 << c
            flags |= _CAT
        elif node["decision_type"] == "<=":
            thr = float(node["threshold"])
        else:
            raise NotCompilable(f"decision type {node['decision_type']!r}")
        left = add(node["left_child"])
        right = add(node["right_child"])
        nodes[i] = (thr, mask, left, right, int(node["split_feature"]), flags)
        return i

    return [add(t["tree_structure"]) for t in d["tree_info"]]


if numba is not None:

    @numba.njit(cache=False)
    def _walk(X, roots, model_of_tree, nodes, catmask, out):
        n = X.shape[0]
        out[:, :] = 0.0
        for t in range(roots.shape[0]):
            root = roots[t]
            m = model_of_tree[t]
            for i in range(n):
                j = root
                nd = nodes[j]
                while nd.feat >= 0:
                    f = X[i, nd.feat]
                    flags = nd.flags
                    if flags & 1:  # categorical
                        go_left = False
                        if f == f:
                            k = int(f)
                            if k >= 0 and k < 64 and (catmask[j] >> np.uint64(k)) & np.uint64(1):
                                go_left = True
                    else:
                        mt = flags >> 2
                        if f != f:
                            if mt == 2 or mt == 1:
                                go_left = (flags & 2) != 0
                            else:
                                go_left = 0.0 <= nd.thr
                        elif mt == 1 and abs(f) <= _ZERO:
                            go_left = (flags & 2) != 0
                        else:
                            go_left = f <= nd.thr
                    j = j + 1 if go_left else nd.right
                    nd = nodes[j]
                out[i, m] += nd.thr


class CompiledForest:
    """Several boosters compiled together; :meth:`predict_raw` returns an (n, n_boosters) array of raw scores."""

    def __init__(self, boosters: Sequence) -> None:
        if numba is None:
            raise NotCompilable("numba is not installed")
        nodes: list[tuple] = []
        roots, owner = [], []
        for m, b in enumerate(boosters):
            r = _flatten(b, nodes)
            roots += r
            owner += [m] * len(r)
        self.n_models = len(boosters)
        self.n_features = boosters[0].num_feature()
        if any(nd[4] >= 0 and nd[2] != i + 1 for i, nd in enumerate(nodes)):
            raise NotCompilable("a tree not in pre-order")  # (_flatten writes pre-order: never)
        if self.n_features >= 1 << 15:
            raise NotCompilable(f"{self.n_features} features do not fit a 16-bit feature index")
        self.roots = np.asarray(roots, np.int64)
        self.owner = np.asarray(owner, np.int64)
        self.nodes = np.array([(thr, right, feat, flags) for thr, _, _, right, feat, flags in nodes], dtype=NODE)
        #: each node's categories (a categorical split's left set as a 64-bit mask; 0 elsewhere)
        self.catmask = np.array([nd[1] for nd in nodes], dtype=np.uint64)
        self.predict_raw(np.full((1, self.n_features), np.nan))  # compile now, not inside a scheduler step

    def predict_raw(self, X: np.ndarray) -> np.ndarray:
        X = np.ascontiguousarray(X, dtype=np.float64)
        out = np.empty((X.shape[0], self.n_models))
        _walk(X, self.roots, self.owner, self.nodes, self.catmask, out)
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
