"""Explaining what the models look at: recording attention maps and CBAM gates (``record``), attention rollout
and heatmaps (``rollout``), every explanation method behind one call, ``attribute`` (``methods``; AttnLRP's
rules in ``lrp``, Captum's classes as ``captum:NAME`` through ``captum_methods``), the deletion
test of faithfulness (``faithfulness``), deletion / insertion curves with statistics (``perturbation``), the
faithfulness leaderboard (``leaderboard``; ``faithfulness_report`` for whole runs, what ``eval.py --faithfulness``
does), the model-randomisation sanity check (``sanity``), evaluation and comparison reports of trained runs
(``report``) and figures (``figures``, the only place that imports matplotlib).
Imports ``zoo.models`` and ``zoo.layers``; ``report`` also reads data and runs through ``zoo.train`` and times
models through ``zoo.bench``. ``report`` and ``figures`` load only when imported by name."""

from .faithfulness import curve_auc, deletion_curve, deletion_test
from .methods import CLASS_SPECIFIC, METHODS, applicable_methods, attribute
from .record import AttentionRecording, record_attention
from .rollout import attention_rollout, explain, fuse_heads, rollout_heatmap, token_layout

__all__ = [
    "CLASS_SPECIFIC", "METHODS", "AttentionRecording", "applicable_methods", "attention_rollout", "attribute",
    "curve_auc", "deletion_curve", "deletion_test", "explain", "fuse_heads", "record_attention", "rollout_heatmap",
    "token_layout",
]
